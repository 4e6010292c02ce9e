"""sdpa_backend=fa3_fp8: FlashAttention-3's float8 kernel (the fa3-fwd package, Hopper only). On CPU: its inputs'
quantisation (one e4m3 scale per sample and head, the keys smoothed), what the method costs against exact attention
(``fa3_fp8.reference``: the GPU test holds the kernel to it), which SDPA calls it takes, and the one-line refusals
where it cannot run; the path from a fused processor's projections (the queries in one pass on a static scale), its
routing and its compiled operator; with Triton installed, the query pass run by Triton's interpreter. The kernel
itself runs in tests/test_gpu_fp8.py; the routing, self-check and compiled-operator tests shared with the other
8-bit kernels are in tests/test_fp8_attention.py."""

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


@pytest.mark.parametrize("tokens, every", [(None, 1), (2100, 4)])
def test_the_keys_scale_is_the_smoothed_keys_amax_without_a_smoothed_copy(tokens, every):
    """The keys less their mean (over each ``every``-th token where they are many) on the smoothed keys' largest
    magnitude, found from each channel's extremes."""
    k = _qkv(key_offset=30.0)[1] if tokens is None else torch.randn(1, 2, tokens, 64) + 30.0
    y, s = fa3_fp8.quantise(k, smooth=True)
    smoothed = k - k[:, :, ::every].mean(dim=2, keepdim=True)
    assert fa3_fp8.key_mean_every(k.shape[2]) == every
    assert torch.allclose(s, smoothed.abs().amax(dim=(2, 3)) / 448.0, rtol=1e-5)
    assert y.float().abs().max().item() == 448.0  # the range is used to its top
    back = y.float().transpose(1, 2) * s[:, :, None, None]
    assert ((back - smoothed).abs() <= smoothed.abs() * 2.0 ** -4 + s[:, :, None, None] * 2.0 ** -9).all()


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
    monkeypatch.setattr(fa3_fp8, "fa3_forward", absent)
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
    monkeypatch.setattr(fa3_fp8, "fa3_forward", lambda: _fa3_as_documented)
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


def _parts(seed=5, batch=2, heads=3, dim=64, tokens=(7, 33)):
    """A fused processor's inputs: q, k and v parts as views of the projections' (batch, tokens, heads * dim)
    outputs, RMSNorm weights and a RoPE of random angles over the joint sequence."""
    g = torch.Generator().manual_seed(seed)
    proj = [(torch.randn(batch, n, 3 * heads * dim, generator=g) * 2 + 0.5).bfloat16() for n in tokens]
    qs, ks, vs = ([p[..., i * heads * dim:(i + 1) * heads * dim].unflatten(-1, (heads, dim)) for p in proj]
                  for i in range(3))
    wq, wk = ([(torch.rand(dim, generator=g) + 0.5).bfloat16() for _ in tokens] for _ in range(2))
    ang = torch.rand(sum(tokens), dim // 2, generator=g) * 6
    return qs, ks, vs, wq, wk, ang.cos().repeat_interleave(2, -1).contiguous(), ang.sin().repeat_interleave(2, -1)


def test_attention_from_the_projections_hands_fa3_queries_and_keys_on_their_static_scales(monkeypatch):
    """``rms_rope_attention`` (what a fused processor hands fa3_fp8 instead of q, k and v in SDPA's layout): the
    queries reach FA3 as ``rms_rope``'s output on one static scale (sqrt(D) times the norms' largest weight, over
    448), the keys less their mean over the tokens on twice that, the values as ``attention`` gives them; the output
    comes back as (batch, tokens, heads, dim), a few percent from exact attention like ``attention``'s."""
    from shardgen.speed.fused_kernels import rms_rope

    monkeypatch.setattr(fa3_fp8, "fa3_forward", lambda: _fa3_as_documented)
    qs, ks, vs, wq, wk, cos, sin = _parts()
    out = fa3_fp8.rms_rope_attention(qs, ks, vs, wq, wk, cos, sin, 1e-6)
    assert out.shape == (2, 40, 3, 64) and out.dtype == torch.bfloat16
    bound = max(w.float().abs().max().item() for w in wq) * 64 ** 0.5 * fa3_fp8.QUERY_BOUND_MARGIN / 448.0
    q8, q_scale = fa3_fp8.quantise_queries(qs, wq, cos, sin, 1e-6)
    assert torch.allclose(q_scale, torch.full((2, 3), bound))
    query = rms_rope(qs, wq, cos, sin, 1e-6)
    assert torch.equal(q8.float(), (query.float() / bound).to(torch.float8_e4m3fn).float().transpose(1, 2))
    k_bound = 2 * max(w.float().abs().max().item() for w in wk) * 64 ** 0.5 * fa3_fp8.QUERY_BOUND_MARGIN / 448.0
    k8, k_scale = fa3_fp8.quantise_keys(ks, wk, cos, sin, 1e-6)
    key = rms_rope(ks, wk, cos, sin, 1e-6).float()
    assert torch.allclose(k_scale, torch.full((2, 3), k_bound))
    smoothed = ((key - key.mean(dim=2, keepdim=True)) / k_bound).to(torch.float8_e4m3fn)
    assert torch.equal(k8.float(), smoothed.float().transpose(1, 2))
    v8, v_scale = fa3_fp8.quantise_values(vs, cos)
    assert torch.equal(v8.float(), fa3_fp8.quantise(torch.cat(vs, 1).transpose(1, 2))[0].float())
    expected = _fa3_as_documented(q8, k8, v8, q_scale, k_scale, v_scale, softmax_scale=64 ** -0.5)[0]
    assert torch.equal(out, expected)
    exact = F.scaled_dot_product_attention(query.float(), key, torch.cat(vs, 1).transpose(1, 2).float())
    assert 0.005 < _rel(out.transpose(1, 2), exact) < 0.065
    # the self-check's pair: the path from the projections against exact attention of the normed, RoPE-d inputs
    q, k, v = _qkv(dim=64)
    assert 0.005 < _rel(fa3_fp8.check_parts(q, k, v), fa3_fp8.check_parts_exact(q, k, v)) < 0.065


@pytest.mark.parametrize("offset, turn", [(0.0, 6.0), (3.0, 6.0), (30.0, 0.3), (100.0, 0.3)])
def test_the_keys_static_scale_costs_attention_what_each_heads_own_maximum_costs(offset, turn):
    """The smoothed keys on ``key_scale``'s static scale (twice the norm's bound) against each head's own largest
    magnitude, in the same float8 attention arithmetic: as far from exact attention, within 5%, on random keys and on
    keys whose projections share a mean up to 50 times their spread (little RoPE turn: the mean survives the
    rotation), where the static scale sits over 100 times above the smoothed keys' largest value (float8 keeps its
    relative precision down to the subnormals)."""
    from shardgen.speed.fused_kernels import rms_rope_reference

    g = torch.Generator().manual_seed(0)
    b, h, n, d = 1, 4, 512, 128
    proj = [torch.randn(b, n, h, d, generator=g) * 2 + offset for _ in range(2)]
    w = [(torch.rand(d, generator=g) + 0.5).bfloat16() for _ in range(2)]
    ang = torch.rand(n, d // 2, generator=g) * turn
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    q, k = (rms_rope_reference([x.bfloat16()], [wx], cos, sin, 1e-6).float() for x, wx in zip(proj, w))
    v = torch.randn(b, h, n, d, generator=g)
    exact = torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v  # peaked: a softmax scale of 2 / sqrt(d)
    q8 = fa3_fp8.quantise(q)
    q_back = q8[0].float().transpose(1, 2) * q8[1][:, :, None, None]
    smoothed = k - k.mean(dim=2, keepdim=True)
    own = smoothed.abs().amax(dim=(2, 3)) / 448.0
    static = fa3_fp8.key_scale([w[1]], b, h, d)
    errors = []
    for scale in (own, static):
        k_back = (smoothed / scale[:, :, None, None]).to(torch.float8_e4m3fn).float() * scale[:, :, None, None]
        errors.append(_rel(torch.softmax(q_back @ k_back.transpose(-1, -2) / 4, -1) @ v, exact))
    assert (static / own).min() > (5 if offset < 10 else 50)  # the static scale is well above the keys' maximum
    assert errors[1] < 1.05 * errors[0] + 1e-4, errors


def test_the_queries_static_scale_holds_a_query_whose_magnitude_sits_in_one_element():
    """The static scale's bound is reached when a head's whole magnitude sits in one element (RMSNorm then makes it
    sqrt(D) times its weight) of the largest weight: it lands just under e4m3's top, not past it; an ordinary query
    keeps e4m3's precision."""
    w = [torch.full((64,), 0.5, dtype=torch.bfloat16), torch.linspace(-1.5, 1.5, 64).to(torch.bfloat16)]
    ordinary = torch.randn(1, 5, 2, 64, generator=torch.Generator().manual_seed(0))
    spike = torch.zeros(1, 3, 2, 64)
    spike[..., 63] = 1000.0  # where the image part's weight is 1.5, the largest of both parts
    cos, sin = torch.ones(8, 64), torch.zeros(8, 64)  # no rotation: the element stays where it is
    q8, scale = fa3_fp8.quantise_queries([ordinary.bfloat16(), spike.bfloat16()], w, cos, sin, 1e-6)
    top = q8[0, 5:].float().abs().amax().item()
    assert 448.0 / fa3_fp8.QUERY_BOUND_MARGIN - 8 <= top <= 448.0  # sqrt(64) * 1.5 on a scale of 8 * 1.5 * 1.01
    back = q8[0, :5].float() * scale[0, 0]
    normed = torch.nn.functional.rms_norm(ordinary[0].bfloat16().float(), (64,), w[0].float(), 1e-6)
    assert (back - normed).norm() / normed.norm() < 0.05


def test_the_static_scales_are_worked_out_once_per_norm_weights_and_again_when_they_change(monkeypatch):
    """The queries' and keys' static descales depend on the norm weights alone: a layer's every call after the first
    reuses them (no kernels), another batch shape, an in-place change to a weight or a cast of it works them out
    again, and a freed weight leaves nothing behind; weights made under inference mode (no version counter) are
    worked out each call."""
    import gc

    made = []
    bound = fa3_fp8._norm_bound
    monkeypatch.setattr(fa3_fp8, "_STATIC_SCALES", {})
    monkeypatch.setattr(fa3_fp8, "_norm_bound", lambda w, d: made.append(d) or bound(w, d))
    w = [torch.full((64,), 0.5), torch.linspace(0.5, 1.0, 64)]
    first = fa3_fp8.query_scale(w, 2, 3, 64)
    assert torch.equal(first, (bound(w, 64) / 448.0).expand(2, 3)) and first.is_contiguous()
    assert fa3_fp8.query_scale(w, 2, 3, 64) is first and len(made) == 1
    keys = fa3_fp8.key_scale(w, 2, 3, 64)
    assert torch.equal(keys, 2.0 * first) and fa3_fp8.key_scale(w, 2, 3, 64) is keys and len(made) == 2
    assert fa3_fp8.query_scale(w, 4, 3, 64).shape == (4, 3) and len(made) == 3
    w[1].mul_(4.0)
    assert torch.allclose(fa3_fp8.query_scale(w, 2, 3, 64), (bound(w, 64) / 448.0).expand(2, 3)) and len(made) == 4
    assert fa3_fp8.query_scale(w, 2, 3, 64).max() > 3.0 * first.max()
    w[1].data = w[1].data.to(torch.float64) * 2.0  # a cast in place of the data (module.to): no version bump
    assert torch.allclose(fa3_fp8.query_scale(w, 2, 3, 64), (bound(w, 64) / 448.0).expand(2, 3)) and len(made) == 5
    del w
    gc.collect()
    assert fa3_fp8._STATIC_SCALES == {}
    with torch.inference_mode():
        frozen = [torch.rand(64) + 0.5]
        for _ in range(2):
            assert torch.equal(fa3_fp8.query_scale(frozen, 1, 2, 64), (bound(frozen, 64) / 448.0).expand(1, 2))
    assert len(made) == 5 + 2 and fa3_fp8._STATIC_SCALES == {}


def test_a_fused_processor_hands_the_projections_to_fa3_fp8_and_to_no_other_kernel(monkeypatch):
    """Within fa3_fp8's context the FLUX blocks' fused processor calls ``rms_rope_attention`` with its parts (the
    queries on their static scale: within float8's rounding of the routed SDPA path); outside it, or when the parts
    are not the kernel's, it calls rms_rope and SDPA."""
    from shardgen.families.flux import fused as flux_fused
    from tests.test_flux_fused import run, small_flux, small_inputs

    monkeypatch.setattr(fa3_fp8, "fa3_forward", lambda: _fa3_as_documented)
    monkeypatch.setattr(fa3_fp8, "takes", lambda q, k, v, attn_mask=None, **kw: attn_mask is None)  # CPU tensors
    tr, kw = small_flux(torch.bfloat16), small_inputs(torch.bfloat16)
    flux_fused.enable(tr)
    calls = []
    real = fa3_fp8.rms_rope_attention
    monkeypatch.setattr(fa3_fp8, "rms_rope_attention", lambda *a: calls.append(len(a[0])) or real(*a))
    monkeypatch.setattr(fa3_fp8, "takes_parts", lambda qs, ks, vs, cos: False)
    with fa3_fp8.context():
        routed = run(tr, kw)
    assert calls == []
    monkeypatch.setattr(fa3_fp8, "takes_parts", lambda qs, ks, vs, cos: True)
    with fa3_fp8.context():
        direct = run(tr, kw)
    assert calls == [2, 2, 1, 1]  # 2 double blocks (text and image parts), 2 single blocks
    assert not torch.equal(direct, routed) and _rel(direct, routed) < 0.05
    calls.clear()
    run(tr, kw)  # no kernel routed: rms_rope and torch's SDPA
    assert calls == []


_INTERPRETED = '''
import torch
from shardgen.speed import fa3_fp8, fused_kernels
from tests.test_fa3_fp8 import _parts
fa3_fp8.parts_kernel_ok = lambda xs, cos: True  # CPU tensors, run by Triton's interpreter
qs, ks, vs, wq, wk, cos, sin = _parts(tokens=(7, 139))
joint = fused_kernels.rms_rope_triton(qs, wq, cos, sin, 1e-6)
scale = fa3_fp8.query_scale(wq, joint.shape[0], joint.shape[1], joint.shape[3])
old = torch.empty(joint.shape[0], joint.shape[2], joint.shape[1], joint.shape[3], dtype=torch.float8_e4m3fn)
fa3_fp8._quantise_heads[((joint.shape[2] + 63) // 64, joint.shape[0] * joint.shape[1])](
    joint, old, scale, scale, *joint.stride()[:3], joint.shape[1], joint.shape[2], ROWS=64, D=joint.shape[3],
    SUB_MEAN=False)
new, new_scale = fa3_fp8.quantise_queries(qs, wq, cos, sin, 1e-6)
assert torch.equal(new_scale, scale)
assert torch.equal(new.view(torch.uint8), old.view(torch.uint8))
print("ok")
'''


def test_the_query_pass_writes_what_rms_rope_then_the_quantising_pass_write(tmp_path):
    """``quantise_queries``' Triton pass, run by Triton's interpreter on the CPU, against the kernels it replaces
    (``rms_rope``'s, then the quantising pass on the same static scale): the same float8 bytes, from two parts with a
    part-filled tile."""
    from tests.test_fp8_attention import interpreted

    assert interpreted(_INTERPRETED, tmp_path) == "ok"


_INTERPRETED_KV = '''
import torch
from shardgen.speed import fa3_fp8, fused_kernels
from tests.test_fa3_fp8 import _parts
fa3_fp8.parts_kernel_ok = lambda xs, cos: True  # CPU tensors, run by Triton's interpreter


def old_way(x):  # quantise's amax in torch ops, its float8 in its Triton kernel (as on CUDA)
    b, h, n, d = x.shape
    amax = torch.linalg.vector_norm(x, float("inf"), dim=(2, 3), dtype=torch.float32)
    scale = (amax.clamp_min(1e-20) / fa3_fp8.FP8_MAX).contiguous()
    y = torch.empty(b, n, h, d, dtype=torch.float8_e4m3fn)
    fa3_fp8._quantise_heads[((n + 63) // 64, b * h)](x, y, scale, scale, *x.stride()[:3], h, n, ROWS=64, D=d,
                                                       SUB_MEAN=False)
    return y, scale


fa3_fp8.KEY_MEAN_TOKENS = KEY_MEAN_TOKENS
qs, ks, vs, wq, wk, cos, sin = _parts(tokens=(7, 139))
joint = fused_kernels.rms_rope_triton(ks, wk, cos, sin, 1e-6)
scale = fa3_fp8.key_scale(wk, 2, 3, 64)
every = fa3_fp8.key_mean_every(146)
assert every == EVERY, every
index = fa3_fp8.key_mean_tokens([7, 139], every)  # each every-th token of each part
mean = joint.index_select(2, index).mean(dim=2, dtype=torch.float32).contiguous()
old_k = torch.empty(2, 146, 3, 64, dtype=torch.float8_e4m3fn)
fa3_fp8._quantise_heads[(3, 6)](joint, old_k, scale, mean, *joint.stride()[:3], 3, 146, ROWS=64, D=64, SUB_MEAN=True)
new_k, new_k_scale = fa3_fp8.quantise_keys(ks, wk, cos, sin, 1e-6)
assert new_k.shape == (2, 146, 3, 64) and new_k.dtype == torch.float8_e4m3fn and torch.equal(new_k_scale, scale)
# the mean is summed in another order: its float32 rounding may move a value across a float8 rounding boundary
steps = (new_k.view(torch.uint8).int() - old_k.view(torch.uint8).int()).abs()
assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3, (steps.max(), (steps > 0).float().mean())
old_v, old_v_scale = old_way(torch.cat(vs, 1).transpose(1, 2))
new_v, new_v_scale = fa3_fp8.quantise_values(vs, cos)
assert torch.equal(new_v_scale, old_v_scale)
assert torch.equal(new_v.view(torch.uint8), old_v.view(torch.uint8))
# SDPA's q or v (Qwen-Image's processors): quantise's two passes, from a tokens-major view and from heads-major memory
fa3_fp8._heads_kernel_ok = lambda x: True
for x in (torch.cat(vs, 1).transpose(1, 2), torch.randn(2, 3, 146, 64).bfloat16()):
    (y, s), (old_y, old_s) = fa3_fp8.quantise(x), old_way(x)
    assert torch.equal(s, old_s) and torch.equal(y.view(torch.uint8), old_y.view(torch.uint8))
print("ok")
'''


@pytest.mark.parametrize("mean_tokens, every", [(512, 1), (16, 9)])
def test_the_key_and_value_passes_write_what_rms_rope_or_the_join_then_quantise_write(tmp_path, mean_tokens, every):
    """The keys' and values' two Triton passes each (statistics, then float8), run by Triton's interpreter on the
    CPU, against what they replace: the values' bytes and scales exactly those of quantising the joined values (and
    ``quantise``'s of SDPA's queries or values, from either memory layout); the
    keys those of ``rms_rope``'s output less its mean on the same static scale, but for a float8 step where the mean,
    summed in another order, rounds differently; the mean over every token of a short sequence, and over each
    9th token of each part where the sequence is long for ``KEY_MEAN_TOKENS``. Two parts, the second over two
    statistics blocks, the last part-filled."""
    from tests.test_fp8_attention import interpreted

    code = f"KEY_MEAN_TOKENS, EVERY = {mean_tokens}, {every}\n" + _INTERPRETED_KV
    assert interpreted(code, tmp_path) == "ok"


def test_the_keys_mean_reads_each_every_th_token_of_each_part_and_at_least_key_mean_tokens():
    """Up to twice ``KEY_MEAN_TOKENS`` tokens the keys' mean reads them all; beyond, each ``every``-th token of each
    part from the part's first, at least ``KEY_MEAN_TOKENS`` in all (FLUX.1-dev at 1024x1024: 512 text + 4,096
    image tokens, each 9th)."""
    assert fa3_fp8.key_mean_every(1023) == 1 and fa3_fp8.key_mean_every(4608) == 9
    index = fa3_fp8.key_mean_tokens([7, 139], 9)
    assert index.tolist() == [0, *range(7, 146, 9)]
    for lengths in ([512, 4096], [512, 16384], [77, 1024], [4096]):
        every = fa3_fp8.key_mean_every(sum(lengths))
        assert len(fa3_fp8.key_mean_tokens(lengths, every)) >= fa3_fp8.KEY_MEAN_TOKENS


@pytest.mark.parametrize("offset", [0.0, 30.0])
def test_the_keys_mean_from_a_ninth_of_the_tokens_costs_attention_what_the_whole_mean_costs(offset):
    """``quantise_keys`` smoothing 4,608 keys (two parts, as FLUX.1-dev's text and image tokens) by the mean of each
    9th token: attention in the float8 arithmetic is as far from exact as with the keys' whole mean (within 3%), on
    random keys and on keys whose projections share a mean 15 times their spread."""
    from shardgen.speed.fused_kernels import rms_rope_reference

    g = torch.Generator().manual_seed(0)
    b, h, d, cuts = 1, 2, 64, (512, 4096)
    n = sum(cuts)
    proj = [torch.randn(b, n, h, d, generator=g) * 2 + offset for _ in range(2)]
    w = [(torch.rand(d, generator=g) + 0.5).bfloat16() for _ in range(2)]
    ang = torch.rand(n, d // 2, generator=g) * 0.3
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    q, k = (rms_rope_reference([p.bfloat16() for p in x.split(list(cuts), dim=1)], [wx, wx], cos, sin, 1e-6).float()
            for x, wx in zip(proj, w))
    v = torch.randn(b, h, n, d, generator=g)
    rows = slice(0, 256)  # the first 256 queries: bounded memory
    exact = torch.softmax(q[:, :, rows] @ k.transpose(-1, -2) / 4, -1) @ v
    q8, q_scale = fa3_fp8.quantise(q[:, :, rows])
    q_back = q8.float().transpose(1, 2) * q_scale[:, :, None, None]
    ks = [x.bfloat16() for x in proj[1].split(list(cuts), dim=1)]
    k8, scale = fa3_fp8.quantise_keys(ks, [w[1], w[1]], cos, sin, 1e-6)  # CPU: rms_rope, then torch ops
    whole = ((k - k.mean(dim=2, keepdim=True)) / scale[:, :, None, None]).to(torch.float8_e4m3fn)
    errors = []
    for keys in (whole.float(), k8.float().transpose(1, 2)):
        k_back = keys * scale[:, :, None, None]
        errors.append(_rel(torch.softmax(q_back @ k_back.transpose(-1, -2) / 4, -1) @ v, exact))
    assert fa3_fp8.key_mean_every(n) == 9
    assert errors[1] < 1.03 * errors[0] + 1e-4, errors


def test_compiled_blocks_hand_fa3_fp8_the_projections_as_one_operator(monkeypatch):
    """Under torch.compile the path from the projections is the operator ``shardgen::fa3_fp8_rms_rope_attention``
    (inductor does not trace into its Triton passes): a compiled processor body computes what the eager one does."""
    from torch._dynamo.backends.debugging import aot_eager

    from shardgen.speed.fused_kernels import rope_attention

    monkeypatch.setattr(fa3_fp8, "fa3_forward", lambda: _fa3_as_documented)
    monkeypatch.setattr(fa3_fp8, "takes_parts", lambda qs, ks, vs, cos: True)  # CPU tensors
    qs, ks, vs, wq, wk, cos, sin = _parts()

    def body(qs, ks, vs):
        return rope_attention(qs, ks, vs, wq, wk, cos, sin, 1e-6) * 2.0

    graphs = []

    def backend(gm, inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes})
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    compiled = torch.compile(body, backend=backend, fullgraph=True)
    with fa3_fp8.context():
        eager, out = body(qs, ks, vs), compiled(qs, ks, vs)
    assert torch.equal(out, eager) and out.shape == (2, 40, 3 * 64)
    assert "shardgen.fa3_fp8_rms_rope_attention.default" in graphs[0]
    torch._dynamo.reset()
