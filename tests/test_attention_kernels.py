"""The attention kernel choice: what ``sdpa_backend=auto`` takes and the memory its timing needs,
FlashAttention-4 by name (``sdpa_backend=fa4``), the adapter torch's hook calls, and the error an unusable
``sdpa_backend=fa4`` gives. The kernels themselves run on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from shardgen.speed import fa4, sdpa
from shardgen.speed.accel import AccelError, AccelOptions


def timings(**ms):
    return {name: ({"ms": t, "max_abs_diff": 0.0} if isinstance(t, float) else {"error": t}) for name, t in ms.items()}


@pytest.mark.parametrize("measured, chosen", [
    (timings(flash=3.09, cudnn=1.573, efficient=5.97), "cudnn"),   # FLUX.1's shape on an H200
    (timings(flash=3.09, cudnn=2.990, efficient=5.97), "flash"),   # within 5% of torch's own choice: kept
    (timings(flash="no kernel", cudnn=1.6, efficient=6.0), "cudnn"),
    (timings(flash="no kernel", cudnn="no kernel", efficient="no kernel"), "default"),
])
def test_auto_takes_the_fastest_of_torchs_kernels(measured, chosen):
    assert sdpa.pick_kernel(measured) == chosen


def test_a_kernel_that_disagrees_with_the_others_is_never_taken():
    measured = timings(flash=3.0, cudnn=1.6, efficient=6.0)
    measured["cudnn"]["max_abs_diff"] = 0.5
    assert sdpa.pick_kernel(measured) == "flash"


@pytest.fixture
def sdpa_calls(monkeypatch):
    """What ``sdpa_context`` asks torch for (its kernel order), and whether it switched FA4 on."""
    from torch.nn import attention

    calls = []
    monkeypatch.setattr(fa4, "activate", lambda: calls.append("fa4 on"))
    monkeypatch.setattr(attention, "sdpa_kernel", lambda backends, set_priority=False:
                        calls.append([b.name for b in backends]) or contextlib.nullcontext())
    monkeypatch.setattr(sdpa, "choose_sdpa", lambda device, dtype, shape: ("cudnn", {}))
    monkeypatch.setattr(sdpa, "_uses_native_attention", lambda transformer: True)
    return calls


def test_sdpa_backend_fa4_switches_fa4_on_and_puts_the_flash_kernel_first(sdpa_calls):
    pipe = types.SimpleNamespace(_execution_device=torch.device("cuda"), transformer=None)
    sdpa.sdpa_context(pipe, AccelOptions(sdpa="fa4"), (4, 24, 4608, 128))
    assert sdpa_calls == ["fa4 on", ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]]


def test_auto_never_switches_fa4_on(sdpa_calls):
    pipe = types.SimpleNamespace(_execution_device=torch.device("cuda"), transformer=types.SimpleNamespace(dtype=None))
    sdpa.sdpa_context(pipe, AccelOptions(sdpa="auto"), (2, 12, 14040, 128))
    assert sdpa_calls == [["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]]


def test_fa4_asked_for_where_it_cannot_run_is_a_config_error_saying_what_to_do(monkeypatch):
    monkeypatch.setattr(fa4, "unavailable_reason", lambda device: "flash-attn-4 does not import (ModuleNotFoundError)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
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


@pytest.mark.parametrize("shape, batch", [
    ((4, 24, 4608, 128), 4),   # FLUX.1 at 1024x1024: 113 MB a tensor
    ((4, 12, 32760, 128), 4),  # Wan 1.3B, 81 frames of 480x832: 403 MB
    ((4, 40, 75600, 128), 1),  # Wan 14B, 81 frames of 720x1280: 3.1 GB at batch 4, timed one video at a time
])
def test_kernels_are_timed_without_more_memory_than_the_runs_own_attention(shape, batch):
    assert sdpa.measure_batch(*shape) == batch


def test_timing_a_long_attention_runs_one_sample_and_checks_the_kernels_agree(monkeypatch):
    """measure_sdpa's own path (CUDA events stubbed, so it runs here: torch's CPU flash kernel answers, the CUDA-only
    kernels say why not): a batch past MEASURE_BYTES is timed at one sample."""
    import torch.nn.functional as F

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            import time
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(sdpa, "MEASURE_BYTES", 3 * 16 * 8 * 4)  # one sample of (3 heads, 16 tokens, 8) fits
    shapes, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: shapes.append(tuple(q.shape))
                        or real(q, k, v, **kw))
    res = sdpa.measure_sdpa(torch.device("cpu"), torch.float32, 4, 3, 16, 8, iters=2)
    assert set(shapes) == {(1, 3, 16, 8)}
    assert res["flash"]["max_abs_diff"] == 0.0 and res["flash"]["ms"] > 0
    assert "error" in res["cudnn"] and "error" in res["efficient"]


def test_auto_takes_flashattention_3_where_it_is_the_fastest_and_agrees():
    assert sdpa.pick_kernel(timings(flash=3.09, cudnn=1.568, efficient=5.97, fa3=1.463)) == "fa3"  # H100, FLUX.1
    assert sdpa.pick_kernel(timings(flash=3.09, cudnn=1.568, efficient=5.97, fa3=1.60)) == "cudnn"
    broken = timings(flash=3.09, cudnn=1.568, efficient=5.97, fa3=1.0)
    broken["fa3"]["max_abs_diff"] = 0.5
    assert sdpa.pick_kernel(broken) == "cudnn"


@pytest.mark.parametrize("asked", ["auto", "fa3"])
def test_fa3_chosen_or_asked_for_takes_the_calls_it_can_and_torch_s_fastest_takes_the_rest(sdpa_calls, monkeypatch,
                                                                                          asked):
    """Under auto's choice of FA3 (or sdpa_backend=fa3), a plain SDPA call goes to FA3's kernel and a masked one to
    torch's kernels with the fastest of them (cuDNN here) first; after the pipeline call SDPA is torch's again."""
    from shardgen.speed import fa3

    measured = timings(flash=3.09, cudnn=1.568, efficient=5.97, fa3=1.463)
    monkeypatch.setattr(sdpa, "choose_sdpa", lambda device, dtype, shape: (sdpa.pick_kernel(measured), measured))
    seen = []
    monkeypatch.setattr(fa3, "takes", lambda q, k, v, attn_mask=None, **kw: attn_mask is None)  # CPU tensors
    monkeypatch.setattr(fa3, "attention", lambda q, k, v, scale=None: seen.append("fa3") or q * 0)
    original = torch.nn.functional.scaled_dot_product_attention
    pipe = types.SimpleNamespace(_execution_device=torch.device("cuda"), transformer=types.SimpleNamespace(dtype=None))
    q = torch.randn(1, 2, 8, 64)
    with sdpa.sdpa_context(pipe, AccelOptions(sdpa=asked), (1, 2, 8, 64)):
        assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, q, q), q * 0)
        masked = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=bool))
    assert seen == ["fa3"] and torch.allclose(masked, original(q, q, q))
    assert sdpa_calls == [["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]]
    assert torch.nn.functional.scaled_dot_product_attention is original


def test_fa3_asked_for_where_it_cannot_run_is_a_config_error_saying_what_to_do(monkeypatch):
    from shardgen.speed import fa3

    monkeypatch.setattr(fa3, "unavailable_reason", lambda device: "fa3-fwd does not import (ModuleNotFoundError)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(AccelError) as err:
        sdpa.validate(AccelOptions(sdpa="fa3"), "cuda")
    assert str(err.value) == ("sdpa_backend=fa3: fa3-fwd does not import (ModuleNotFoundError). pip install fa3-fwd "
                              "(FlashAttention-3's forward kernels for Hopper, built for CUDA 13 and torch>=2.10); or "
                              "use sdpa_backend=auto (measures the kernels this machine has)")
