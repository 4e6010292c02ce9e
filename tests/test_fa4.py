"""FlashAttention-4 as an attention kernel: when ``sdpa_backend=auto`` takes it, the adapter torch's hook calls,
and the error an unusable ``sdpa_backend=fa4`` gives. The kernel itself runs on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from shardgen.speed import fa4, sdpa
from shardgen.speed.accel import AccelError, AccelOptions


def timings(**ms):
    return {name: ({"ms": t, "max_abs_diff": 0.0} if isinstance(t, float) else {"error": t}) for name, t in ms.items()}


@pytest.mark.parametrize("measured, chosen", [
    (timings(flash=3.09, cudnn=1.573, efficient=5.97, fa4=1.557), "cudnn"),     # FLUX.1 on an H200: 1% is not worth it
    (timings(flash=6.70, cudnn=4.170, efficient=13.8, fa4=3.476), "fa4"),       # Wan 1.3B's 14k tokens: 17% faster
    (timings(flash=2.55, cudnn=1.861, efficient=5.80, fa4=1.492), "fa4"),       # SD3.5's 64-wide heads: 20%
    (timings(flash=3.09, cudnn=1.573, efficient=5.97, fa4="not installed"), "cudnn"),
    (timings(flash="no kernel", cudnn="no kernel", efficient="no kernel", fa4=2.0), "fa4"),
    (timings(flash="no kernel", cudnn="no kernel", efficient="no kernel", fa4="no"), "default"),
])
def test_auto_takes_fa4_only_where_it_is_clearly_faster(measured, chosen):
    assert sdpa.pick_kernel(measured) == chosen


def test_a_kernel_that_disagrees_with_the_others_is_never_taken():
    measured = timings(flash=3.0, cudnn=1.6, efficient=6.0, fa4=1.0)
    measured["fa4"]["max_abs_diff"] = 0.5
    assert sdpa.pick_kernel(measured) == "cudnn"


def test_fa4_asked_for_where_it_cannot_run_is_a_config_error_saying_what_to_do(monkeypatch):
    monkeypatch.setattr(fa4, "unavailable_reason", lambda device: "flash-attn-4 does not import (ModuleNotFoundError)")
    with pytest.raises(AccelError) as err:
        sdpa.validate(AccelOptions(sdpa="fa4"), "cuda")
    msg = str(err.value)
    assert "sdpa_backend=fa4: flash-attn-4 does not import" in msg
    assert "pip install flash-attn-4" in msg and "sdpa_backend=auto" in msg
    sdpa.validate(AccelOptions(sdpa="fa4"), "cpu")  # off CUDA every kernel choice is a no-op, as documented


def test_fa4_is_unavailable_off_cuda_with_a_reason():
    assert fa4.unavailable_reason("cpu") == "FA4 runs on CUDA GPUs only"
    assert fa4.unavailable_reason(None) == "FA4 runs on CUDA GPUs only"


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash-attn-4's interface module as the adapter sees it: a forward returning five values, as 4.0 does."""
    calls = []
    module = types.ModuleType(fa4.FA4_MODULE)

    def forward(q, k, v, **kwargs):
        calls.append(kwargs)
        if q.shape[-1] == 72:
            raise NotImplementedError("head dim 72")
        return q + 1, torch.zeros(q.shape[0], q.shape[2], q.shape[1]), None, None, None

    module._flash_attn_fwd = forward
    module._flash_attn_bwd = lambda *a, **k: ("dq", "dk", "dv")
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fa4.FA4_MODULE, module)
    fa4._interface.cache_clear()
    yield calls
    fa4._interface.cache_clear()


def test_the_adapter_hands_torch_the_out_and_lse_pair_it_unpacks(fake_fa4):
    q = torch.zeros(2, 16, 3, 64)
    out, lse = fa4._flash_attn_fwd(q, q, q, softmax_scale=0.125, causal=False, return_lse=True)
    assert torch.equal(out, q + 1) and lse.shape == (2, 3, 16)
    assert fake_fa4 == [{"softmax_scale": 0.125, "causal": False, "return_lse": True}]
    assert fa4._flash_attn_bwd() == ("dq", "dk", "dv")


def test_a_call_fa4_cannot_take_with_options_only_fa4_has_raises_its_error(fake_fa4):
    q = torch.zeros(1, 8, 2, 72)
    with pytest.raises(NotImplementedError, match="head dim 72"):
        fa4._flash_attn_fwd(q, q, q, window_size_left=4, window_size_right=None)


@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                    reason="this torch has no flash-attention hook (torch>=2.11 has)")
def test_activation_goes_through_torchs_hook_and_is_undone(fake_fa4):
    assert not fa4.active()
    fa4.activate()
    try:
        assert fa4.active()
        assert torch.nn.attention.current_flash_attention_impl() == fa4.IMPL
        fa4.activate()  # a second choice of FA4 in the process changes nothing
        assert fa4.active()
    finally:
        fa4.restore()
    assert not fa4.active() and torch.nn.attention.current_flash_attention_impl() is None
