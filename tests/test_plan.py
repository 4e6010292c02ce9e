"""The plan, alone: each sample's seed, and the split of prompt rows into shards (no model, no job)."""

from __future__ import annotations

import json

import pytest

from shardgen.dataio.plan import build_plan, load_plan, sample_key, sample_seed
from shardgen.dataio.prompts import PromptRow
from shardgen.dataio.rundir import RunDir


def test_sample_seed_is_pinned():
    """Changing the hash would change every image of a resumed run: these values are the contract."""
    assert [sample_seed(0, 0), sample_seed(0, 1), sample_seed(7, 123)] == [
        7070836379803831727, 1227844342346046657, 7660209823117301031]


def test_a_row_seed_wins_and_every_seed_fits_a_torch_generator():
    assert sample_seed(5, 3, row_seed=42) == 42
    seeds = [sample_seed(s, i) for s in (0, 1, 2**40) for i in range(1000)]
    assert all(0 <= x < 2**63 for x in seeds)


def test_neighbouring_run_seeds_share_no_noise():
    """run_seed + index would give run 1's row 0 the seed of run 0's row 1; the hash does not."""
    run0 = {sample_seed(0, i) for i in range(5000)}
    run1 = {sample_seed(1, i) for i in range(5000)}
    assert len(run0) == 5000 and not run0 & run1


def rows(n: int, reject_every: int = 0, seeded: dict | None = None):
    for i in range(n):
        bad = reject_every and i % reject_every == reject_every - 1
        yield PromptRow(index=i, line=i + 1, prompt=None if bad else f"prompt {i}",
                        seed=(seeded or {}).get(i), reject="empty prompt" if bad else None)


def test_build_plan_splits_rows_into_shards_in_order(tmp_path):
    run = RunDir(tmp_path / "run")
    plan = build_plan(run, rows(10, reject_every=4, seeded={2: 99}), samples_per_shard=4, run_seed=3,
                      prompt_file="p.txt")
    assert (plan.num_rows, plan.num_shards, plan.num_rejects) == (10, 3, 2)
    assert [len(plan.shard_range(s)) for s in range(3)] == [4, 4, 2]
    got = [r for s in range(3) for r in plan.rows(s)]
    assert [r.index for r in got] == list(range(10))
    assert [r.key for r in got[:2]] == [sample_key(0), sample_key(1)] == ["0000000000", "0000000001"]
    assert got[2].seed == 99 and got[5].seed == sample_seed(3, 5)
    assert [r.index for r in got if r.reject] == [3, 7]
    assert load_plan(run) == plan


def test_a_bad_row_half_way_leaves_no_plan(tmp_path):
    def failing():
        yield from rows(5)
        raise ValueError("p.txt line 6: not UTF-8")

    run = RunDir(tmp_path / "run")
    with pytest.raises(ValueError, match="line 6"):
        build_plan(run, failing(), samples_per_shard=2, run_seed=0, prompt_file="p.txt")
    assert load_plan(run) is None
    assert not [p for p in run.root.iterdir() if p.name.startswith(".plan-")]


def test_a_second_plan_adopts_the_first(tmp_path):
    """Two jobs racing to plan the same run: the first rename wins and the other reads it."""
    run = RunDir(tmp_path / "run")
    first = build_plan(run, rows(6), samples_per_shard=3, run_seed=0, prompt_file="p.txt")
    second = build_plan(run, rows(6), samples_per_shard=3, run_seed=0, prompt_file="p.txt")
    assert second == first
    assert json.loads((run.plan_dir / "plan.json").read_text())["num_shards"] == 2
