"""sdpa_backend=sage: SDPA calls SageAttention takes go to it (keys smoothed out of place, softmax unchanged), the
others to torch; it is recorded as lossy, the gate's lossless settings turn it off, and a CPU run is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardgen.quality.gate import lossless
from shardgen.speed import sage
from shardgen.speed.techniques import AccelError, AccelOptions, validate


def fake_sageattn(calls, sdpa=F.scaled_dot_product_attention):
    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True):
        calls.append((tensor_layout, smooth_k, q.shape))
        return sdpa(q, k, v, scale=sm_scale)  # torch's exact kernel, where the real one rounds to INT8
    return sageattn


def test_smoothed_keys_give_the_same_attention_and_the_callers_keys_are_untouched(monkeypatch):
    calls = []
    monkeypatch.setattr(sage, "_sageattn", lambda: fake_sageattn(calls))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 64, generator=g, dtype=torch.float64) for _ in range(3))
    k = k + 5.0  # a large common offset: what the smoothing removes
    keys = k.clone()
    out = sage.attention(q, k, v)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, keys, v), atol=1e-10)
    assert torch.equal(k, keys) and calls == [("HND", False, q.shape)]


def test_takes_only_what_the_kernel_can_do():
    q = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    assert not sage.takes(q, q, q)  # not on CUDA
    if torch.cuda.is_available():
        c = q.cuda()
        assert sage.takes(c, c, c) and not sage.takes(c, c, c, is_causal=True)
        assert not sage.takes(c[..., :48], c[..., :48], c[..., :48])  # head size 48


def test_it_is_lossy_and_the_lossless_settings_turn_it_off():
    opts = AccelOptions(sdpa="sage", fp8=True)
    assert opts.lossy == {"fp8": True, "sdpa": "sage"}
    exact = lossless(opts)
    assert (exact.sdpa, exact.fp8, exact.lossy) == ("auto", False, {})


def test_a_cpu_run_is_refused_in_one_line():
    with pytest.raises(AccelError, match="sdpa_backend=sage: SageAttention runs on CUDA GPUs only.*sdpa_backend=auto"):
        validate(AccelOptions(sdpa="sage"), "cpu")


@pytest.mark.parametrize("kernel", ["sage", "fp8", "fa3_fp8"])
def test_auto_times_torchs_kernels_before_the_8bit_kernel_replaces_sdpa(monkeypatch, kernel):
    """sdpa_backend=sage/fp8 still puts auto's kernel first for the calls the 8-bit kernel does not take; auto's
    timing must see torch's SDPA, not the 8-bit kernel."""
    import types

    from shardgen.speed import sdpa

    original, seen = F.scaled_dot_product_attention, []

    def choose(device, dtype, shape):
        seen.append(F.scaled_dot_product_attention is original)
        return "cudnn", {}

    monkeypatch.setattr(sdpa, "choose_sdpa", choose)
    monkeypatch.setattr(sdpa, "_uses_native_attention", lambda transformer: True)
    pipe = types.SimpleNamespace(_execution_device=torch.device("cuda"),
                                 transformer=types.SimpleNamespace(dtype=torch.bfloat16))
    with sdpa.sdpa_context(pipe, AccelOptions(sdpa=kernel), (1, 2, 16, 64)):
        assert F.scaled_dot_product_attention is not original
    assert seen == [True] and F.scaled_dot_product_attention is original
