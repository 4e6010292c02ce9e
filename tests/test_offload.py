"""parallel/offload.py: which text encoders device_map streams, and the pinned copy they stream from, packed into
blocks (on CPU: the packing unpinned; the pinned copy and the side stream are walked by tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import parallel.memory as memory
from parallel.offload import ALIGN, block_plan, pack, pin_streamed, pinned_bytes, stream_plan

GiB = 1 << 30
MiB = 1 << 20


def test_an_encoder_too_large_to_move_in_beside_the_transformer_is_streamed():
    """FLUX.2-dev on an 80 GB card: its 24B text encoder (44.7 GiB) cannot be moved in beside the 30.8 GiB fp8
    transformer to encode, so it is streamed; FLUX.1-dev's two encoders move in whole where they fit together, the
    largest streamed first where they do not."""
    assert stream_plan({"text_encoder": int(44.7 * GiB)}, 36 * GiB) == ["text_encoder"]
    assert stream_plan({"text_encoder": int(44.7 * GiB)}, 90 * GiB) == []
    flux = {"text_encoder": GiB // 4, "text_encoder_2": int(9.5 * GiB)}
    assert stream_plan(flux, 20 * GiB) == []
    assert stream_plan(flux, 9 * GiB) == ["text_encoder_2"]
    assert stream_plan(flux, GiB // 8) == ["text_encoder_2", "text_encoder"]
    assert stream_plan({}, 0) == []


def test_the_pinned_copy_of_flux2_s_encoder_is_packed_into_about_its_own_size():
    """Mistral-Small-24B's tensors (an embedding and an output layer of 1.25 GiB, 40 layers of 320 MiB MLP matrices,
    40 MiB attention ones, 10 MiB key/value ones, small norms): pinned one by one each would be rounded up to a power
    of two (71 GiB for 44.7); packed into 2 GiB blocks, one block more than the fewest that could hold them at most,
    and no two tensors overlap."""
    sizes = [int(1.25 * GiB)] * 2 + [320 * MiB] * 120 + [40 * MiB] * 80 + [10 * MiB] * 80 + [10240] * 81
    blocks, places = block_plan(sizes)
    assert set(blocks) == {2 * GiB} and len(blocks) <= -(-sum(sizes) // (2 * GiB)) + 1
    assert sorted(i for i, _, _ in places) == list(range(len(sizes)))
    for b in range(len(blocks)):
        spans = sorted((off, off + sizes[i]) for i, bb, off in places if bb == b)
        assert all(off % ALIGN == 0 for off, _ in spans) and spans[-1][1] <= blocks[b]
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert sum(1 << (n - 1).bit_length() for n in sizes) > 1.5 * sum(sizes)  # what pinning one by one would take
    assert block_plan([]) == ([], [])


def test_packing_moves_every_tensor_into_the_blocks_and_changes_no_output():
    """An encoder packed (unpinned here) computes what it did; each tensor lives in one of the blocks, tied weights
    stay one tensor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 50, bias=False))
    model[3].weight = model[0].weight  # tied, as an embedding and an output layer may be
    model.register_buffer("scale", torch.full((16,), 2.0))
    ids = torch.randint(0, 50, (2, 7))
    before = model(ids) * 1.0
    made = pack(model, pin=False)
    assert made == pinned_bytes(model) == GiB  # one block: the smallest a block is
    assert torch.equal(model(ids), before)
    assert model[3].weight is model[0].weight
    bases = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert len(bases) == 1  # all in the one block


@pytest.mark.parametrize("ranks, pinned", [(1, True), (8, False)])
def test_a_streamed_encoder_is_pinned_only_where_the_machine_has_the_ram_for_its_copy(monkeypatch, ranks, pinned):
    """Each rank's share of the RAM decides: FLUX.2-dev's packed copy (~46 GiB) fits one rank's share of 100 GiB, not
    one of 8 ranks'."""
    monkeypatch.setattr(memory, "available_bytes", lambda device, n: (100 * GiB // n, "the CPU"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert pin_streamed(46 * GiB) is pinned
    assert pin_streamed(GiB)


def test_the_pinned_blocks_an_earlier_job_left_in_the_host_cache_are_returned_before_the_ram_is_read(monkeypatch):
    """A second job in one process (the GPU matrix) would read the RAM of the first job's packed encoder, cached by
    torch's pinned-memory allocator, as taken, and stream from pageable memory: the cache is emptied first."""
    import parallel.offload as offload

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("emptied"), raising=False)
    monkeypatch.setattr(memory, "available_bytes", lambda device, n: (calls.append("read"), (100 * GiB, "the CPU"))[1])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert offload.pin_streamed(46 * GiB)
    assert calls == ["emptied", "read"]
