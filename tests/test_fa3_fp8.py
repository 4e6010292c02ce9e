"""sdpa_backend=fa3_fp8: FlashAttention-3's float8 kernel (the fa3-fwd package, Hopper only). On CPU: its inputs'
quantisation (one e4m3 scale per sample and head, the keys smoothed), what the method costs against exact attention
(``fa3_fp8.reference``: the GPU test holds the kernel to it), which SDPA calls it takes, and the one-line refusals
where it cannot run. The kernel itself runs in tests/test_gpu_fp8.py; the routing, self-check and compiled-operator
tests shared with the other 8-bit kernels are in tests/test_fp8_attention.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardgen.speed import fa3_fp8, sdpa
from shardgen.speed.techniques import AccelError, AccelOptions, validate
from tests.test_fp8_attention import _qkv, _rel


def test_each_head_is_quantised_on_its_own_scale_into_fa3s_layout():
    """FA3 reads (batch, tokens, heads, dim) float8 and one descale per (batch, head): a head 100x larger than
    the other keeps the small one's precision, and every value comes back within e4m3's half step (2**-4)."""
    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(1))
    x[:, 1] *= 100.0
    y, s = fa3_fp8.quantise(x)
    assert y.dtype == torch.float8_e4m3fn and y.shape == (2, 50, 3, 64) and y.is_contiguous()
    assert s.shape == (2, 3) and s.dtype == torch.float32
    assert torch.allclose(s, x.abs().amax(dim=(2, 3)) / 448.0)
    back = y.float().transpose(1, 2) * s[:, :, None, None]
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + s[:, :, None, None] * 2.0 ** -9).all()


def test_the_keys_scale_is_the_smoothed_keys_amax_without_a_smoothed_copy():
    k = _qkv(key_offset=30.0)[1]
    y, s = fa3_fp8.quantise(k, smooth=True)
    smoothed = k - k.mean(dim=2, keepdim=True)
    assert torch.allclose(s, smoothed.abs().amax(dim=(2, 3)) / 448.0, rtol=1e-5)
    assert y.float().abs().max().item() == 448.0  # the range is used to its top


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("peak, bound", [(1.0, 0.065), (4.0, 0.1)])  # flat and peaked attention
def test_the_arithmetic_costs_a_few_percent_of_exact_attention(dim, peak, bound):
    """e4m3 in both products: ~5% off on flat attention (the self-check's random inputs, bound 8%), ~8.5% on peaked
    attention, where Q K^T's 3-bit mantissa dominates (shardgen's own kernel does Q K^T in INT8 for this)."""
    q, k, v = _qkv(dim=dim, peak=peak)
    exact = F.scaled_dot_product_attention(q, k, v)
    err = _rel(fa3_fp8.reference(q, k, v), exact)
    assert 0.005 < err < bound, err


def test_smoothing_the_keys_keeps_a_large_common_offset_from_spending_their_range():
    q, k, v = _qkv(key_offset=300.0)
    exact = F.scaled_dot_product_attention(q, k, v)
    assert _rel(fa3_fp8.reference(q, k, v), exact) < 0.065

    def unsmoothed(q, k, v):  # the same per-head e4m3 keys without the mean taken out
        s = k.abs().amax(dim=(2, 3), keepdim=True) / 448.0
        return F.scaled_dot_product_attention(q, (k / s).to(torch.float8_e4m3fn).float() * s, v)

    assert _rel(unsmoothed(q, k, v), exact) > 0.2  # what the smoothing saves


def test_takes_only_what_the_kernel_can_do():
    q = torch.randn(1, 2, 4, 128, dtype=torch.bfloat16)
    assert not fa3_fp8.takes(q, q, q)  # not on CUDA
    if torch.cuda.is_available():
        c = q.cuda()
        assert fa3_fp8.takes(c, c, c) and not fa3_fp8.takes(c, c, c, is_causal=True)
        assert not fa3_fp8.takes(c[..., :80], c[..., :80], c[..., :80])  # head size 80: no kernel for it
        assert not fa3_fp8.takes(c, c, c, attn_mask=torch.ones(4, 4, dtype=torch.bool, device="cuda"))
        assert not fa3_fp8.takes(c.float(), c.float(), c.float())


def test_a_cpu_run_is_refused_in_one_line_naming_the_package_and_the_lossless_way():
    with pytest.raises(AccelError) as e:
        validate(AccelOptions(sdpa="fa3_fp8"), "cpu")
    assert str(e.value) == (f"sdpa_backend=fa3_fp8: FlashAttention-3 runs on CUDA GPUs only. {fa3_fp8.INSTALL}; or "
                            "sdpa_backend=auto (lossless)")


def test_a_gpu_that_is_not_hopper_is_refused_before_the_package_is_looked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fa3_fp8.unavailable_reason("cuda:0") == ("FlashAttention-3 is built for Hopper GPUs (compute capability "
                                                    "9.0); this GPU is 8.9")


def test_a_missing_package_is_named_with_its_install_line(monkeypatch):
    def absent():
        raise ModuleNotFoundError("No module named 'fa3_fwd_interface'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa3_fp8, "_fa3_forward", absent)
    with pytest.raises(AccelError) as e:
        sdpa.validate(AccelOptions(sdpa="fa3_fp8"), "cuda:0")
    assert str(e.value) == ("sdpa_backend=fa3_fp8: fa3-fwd does not import (ModuleNotFoundError: No module named "
                            f"'fa3_fwd_interface'). {fa3_fp8.INSTALL}; or sdpa_backend=auto (lossless)")


_TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, also while a context routes SDPA


def _fa3_as_documented(q, k, v, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, **kw):
    """FA3's forward as its interface documents it, in torch ops: float8 (batch, tokens, heads, dim) inputs, float32
    descales (batch, heads), bf16 (batch, tokens, heads, dim) output first (the package itself is Hopper-only)."""
    assert q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn and not kw
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    b, _, h, _ = q.shape
    assert q_descale.shape == k_descale.shape == v_descale.shape == (b, h)
    deq = [t.float() * s[:, None, :, None] for t, s in ((q, q_descale), (k, k_descale), (v, v_descale))]
    out = _TORCH_SDPA(*(t.transpose(1, 2) for t in deq), scale=softmax_scale)
    return out.transpose(1, 2).to(torch.bfloat16), None


@pytest.mark.parametrize("scale", [None, 0.05])
def test_attention_hands_fa3_its_layout_and_scales_and_gives_sdpa_its_view(monkeypatch, scale):
    """The wiring around the kernel, on CPU: inputs in the processors' (batch, tokens, heads, dim) memory seen as
    SDPA's (batch, heads, tokens, dim); FA3 gets contiguous float8 and per-head descales; the caller gets SDPA's
    view of FA3's output (so a processor's transpose and flatten copy nothing), equal to exact attention on the
    quantised inputs."""
    monkeypatch.setattr(fa3_fp8, "_fa3_forward", lambda: _fa3_as_documented)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 40, 3, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2, 3, 40, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    out = fa3_fp8.attention(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.transpose(1, 2).is_contiguous()
    p_exact = _rel(out, F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale))
    assert 0.005 < p_exact < 0.06, p_exact  # the quantisation's cost, nothing more
    monkeypatch.setattr(fa3_fp8, "takes", lambda q, k, v, attn_mask=None, **kw: attn_mask is None)  # CPU tensors
    with fa3_fp8.context():  # the routed call takes the same path
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, scale=scale), out)
