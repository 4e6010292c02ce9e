"""ParallelDims, alone: the replica layout every rank derives from the degrees, and the degree checks."""

from __future__ import annotations

import pytest

from parallel.dims import ParallelConfigError, ParallelDims, divisors


def test_replicas_are_contiguous_slices_led_by_their_first_rank():
    d = ParallelDims(world_size=8, strategy="cp_unified", ring=2, ulysses=2)
    assert (d.dp, d.replica_size, d.replica_dims()) == (2, 4, (("ring", 2), ("ulysses", 2)))
    assert [d.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.leader_of(r) for r in range(8)] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [r for r in range(8) if d.is_leader(r)] == [0, 4]
    t = ParallelDims(world_size=6, strategy="tp", tp=3)
    assert (t.dp, t.replica_dims(), t.describe()) == (2, (("tp", 3),), "tp_degree=3")
    assert ParallelDims(world_size=3).dp == 3


@pytest.mark.parametrize("strategy,degrees,fix", [
    ("tp", dict(tp=2, ulysses=2), "set ulysses_degree=1 ring_degree=1"),
    ("cp_ulysses", dict(tp=2, ulysses=2), "set tp_degree=1"),
])
def test_tensor_and_context_parallelism_are_refused_together(strategy, degrees, fix):
    with pytest.raises(ParallelConfigError, match=f"are not combined in one replica; {fix}"):
        ParallelDims(world_size=8, strategy=strategy, **degrees)


def test_the_world_must_hold_whole_replicas():
    with pytest.raises(ParallelConfigError, match="2 ranks per replica .* do not divide the world of 3 ranks; "
                                                  "launch a multiple of 2"):
        ParallelDims(world_size=3, strategy="tp", tp=2)


def test_no_mesh_before_it_is_built():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(world_size=2, strategy="tp", tp=2).mesh("tp")


def test_divisors():
    assert divisors(12) == [2, 3, 4, 6, 12] and divisors(1) == []
