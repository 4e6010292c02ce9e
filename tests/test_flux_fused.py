"""shardgen/speed/flux_fused.py on the CPU: the fused FLUX blocks compute what diffusers' blocks compute.

The Triton kernel itself runs only on CUDA (tests/test_gpu.py checks it against eager there); here
``rms_rope`` takes its torch path, which is eager diffusers' own sequence of ops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardgen.families.flux import fused as flux_fused
from shardgen.speed import accel, block_chain, fused_kernels, techniques
from shardgen.run.generation import to_pixels

SMALL_FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True,
                  axes_dims_rope=(4, 6, 6))


def small_flux(dtype=torch.float64, seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    tr = FluxTransformer2DModel(**SMALL_FLUX).eval()
    for p in tr.parameters():  # .to(dtype) would warn about fp32 modules (there are none)
        p.data = p.data.to(dtype)
    with torch.no_grad():  # non-trivial norm weights and biases, so a swapped weight would show
        for name, p in tr.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return tr


def small_inputs(dtype=torch.float64, batch=2, side=6, text=5):
    g = torch.Generator().manual_seed(1)
    ar = torch.arange(side, dtype=torch.float32)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), ar, ar, indexing="ij"), -1)
    return dict(hidden_states=torch.randn(batch, side * side, 16, generator=g, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 24, generator=g, dtype=dtype),
                pooled_projections=torch.randn(batch, 12, generator=g, dtype=dtype),
                timestep=torch.tensor([0.3, 0.8][:batch], dtype=dtype), guidance=torch.full((batch,), 3.5, dtype=dtype),
                img_ids=ids.reshape(-1, 3).to(dtype), txt_ids=torch.zeros(text, 3, dtype=dtype), return_dict=False)


@torch.no_grad()
def run(tr, kw):
    return tr(**kw)[0]


def test_fused_attention_processor_is_bit_identical_to_diffusers():
    tr, kw = small_flux(), small_inputs()
    ref = run(tr, kw)
    forwards = flux_fused.enable(tr)
    assert len(forwards) == 4  # 2 double + 2 single blocks
    assert all(isinstance(m.processor, flux_fused.FusedFluxAttnProcessor) for m in tr.modules() if hasattr(m, "processor"))
    assert torch.equal(run(tr, kw), ref)  # processors swapped, stock block forwards: same ops, same order
    flux_fused.disable(tr)
    assert all(type(m.processor).__name__ == "FluxAttnProcessor" for m in tr.modules() if hasattr(m, "processor"))


def test_fused_block_forwards_match_the_stock_blocks():
    tr, kw = small_flux(), small_inputs()
    ref = run(tr, kw)
    for block, fwd in flux_fused.enable(tr).items():
        block.forward = fwd
    out = run(tr, kw)
    # only the single blocks' proj_out is summed in another order (two GEMMs): float64 rounding
    assert (out - ref).abs().max() < 1e-12 * ref.abs().max()
    assert not torch.equal(out, torch.zeros_like(out))


def test_the_eager_cuda_block_bodies_compute_the_stock_blocks(monkeypatch):
    """The bodies the fused blocks run eagerly on CUDA (one-pass LayerNorm + modulation, addcmul residuals, the
    second proj_out GEMM accumulating into the first's output), here with their torch fallbacks in float64: every
    modulation tensor and gate goes where diffusers' blocks put it."""
    tr, kw = small_flux(), small_inputs()
    ref = run(tr, kw)
    monkeypatch.setattr(flux_fused, "EAGER_DEVICES", ("cpu",))
    calls = []
    for name in ("_double_block_eager", "_single_block_eager"):
        body = getattr(flux_fused, name)
        monkeypatch.setattr(flux_fused, name, lambda *a, _body=body, **k: calls.append(_body) or _body(*a, **k))
    for block, fwd in flux_fused.enable(tr).items():
        block.forward = fwd
    out = run(tr, kw)
    assert len(calls) == 4  # both bodies ran, in every block
    assert (out - ref).abs().max() < 1e-12 * ref.abs().max() and not torch.equal(out, ref)


def test_the_eager_fusions_stay_out_of_compiled_graphs_and_off_affine_norms(monkeypatch):
    tr = small_flux()
    block = tr.transformer_blocks[0]
    x = torch.zeros(1)
    monkeypatch.setattr(flux_fused, "EAGER_DEVICES", ("cpu",))
    assert flux_fused._eager_fusable(x, block.norm1, block.norm2)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # inductor fuses these passes itself
    assert not flux_fused._eager_fusable(x, block.norm1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    block.norm2 = torch.nn.LayerNorm(block.norm2.normalized_shape, eps=1e-6)  # with a weight: not ln_modulate's
    assert not flux_fused._eager_fusable(x, block.norm1, block.norm2)
    monkeypatch.setattr(flux_fused, "EAGER_DEVICES", ("cuda",))
    assert not flux_fused._eager_fusable(x, tr.single_transformer_blocks[0].norm)  # a CPU tensor: stock ops


def test_compile_blocks_fused_compiles_the_fused_forwards_and_uncompile_restores(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    tr, kw = small_flux(), small_inputs()
    ref = run(tr, kw)
    assert accel.compile_blocks(tr, fused=True) == 4
    assert sorted(f.__func__.__name__ for f in compiled) == ["double_block_forward"] * 2 + ["single_block_forward"] * 2
    assert (run(tr, kw) - ref).abs().max() < 1e-12 * ref.abs().max()
    accel.uncompile_blocks(tr)
    assert all("forward" not in b.__dict__ for b in accel.repeated_blocks(tr))
    assert not any(isinstance(getattr(m, "processor", None), flux_fused.FusedFluxAttnProcessor) for m in tr.modules())
    assert torch.equal(run(tr, kw), ref)


class _Pipe:
    """What ``accel.prepare`` reads of a pipeline: its transformer and execution device."""

    def __init__(self, tr, device="cpu"):
        self.transformer, self._execution_device = tr, torch.device(device)


def test_fused_blocks_run_eagerly_on_cuda_only_and_switch_back(monkeypatch):
    """compile=false with fused_blocks (the default): the fused forwards run uncompiled on CUDA; on the CPU the
    stock blocks stay (diffusers' bytes); fused_blocks=false or compiling puts them back / takes them over."""
    tr, kw = small_flux(), small_inputs()
    ref = run(tr, kw)
    pipe = _Pipe(tr)
    accel.prepare(pipe, accel.AccelOptions(compile=False, sdpa="default"))
    assert all("forward" not in b.__dict__ for b in accel.repeated_blocks(tr))  # CPU: untouched
    assert torch.equal(run(tr, kw), ref)
    pipe._execution_device = torch.device("cuda")  # only the device type is read; the blocks still run on the CPU
    monkeypatch.setattr(techniques, "validate", lambda opts, device=None: None)
    done = accel.prepare(pipe, accel.AccelOptions(compile=False, sdpa="flash"))
    assert done["fused_eager_blocks"] == 4
    assert sorted(b.forward.__func__.__name__ for b in accel.repeated_blocks(tr)) == \
        ["double_block_forward"] * 2 + ["single_block_forward"] * 2
    out = run(tr, kw)
    assert (out - ref).abs().max() < 1e-12 * ref.abs().max() and not torch.equal(out, ref)
    accel.prepare(pipe, accel.AccelOptions(compile=False, sdpa="flash", fused_blocks=False))
    assert all("forward" not in b.__dict__ for b in accel.repeated_blocks(tr))
    assert not any(isinstance(getattr(m, "processor", None), flux_fused.FusedFluxAttnProcessor) for m in tr.modules())
    assert torch.equal(run(tr, kw), ref)
    accel.prepare(pipe, accel.AccelOptions(compile=False, sdpa="default"))  # fused again, then compiled
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    accel.prepare(pipe, accel.AccelOptions(compile=True, sdpa="default", compile_tuning=False))
    assert len(compiled) == 4  # every block compiled (none skipped as "already prepared")
    assert (run(tr, kw) - ref).abs().max() < 1e-12 * ref.abs().max()


def test_blocks_wrapped_by_a_hook_keep_it_and_their_stock_forward():
    """device_map places blocks with accelerate hooks that wrap forward: fusing would drop them, so it is left."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    tr, kw = small_flux(), small_inputs()
    ref = run(tr, kw)
    calls = []

    class Count(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(module)
            return args, kwargs

    for block in accel.repeated_blocks(tr):
        add_hook_to_module(block, Count())
    assert accel.fuse_blocks_eager(tr) == 0
    assert not any(isinstance(getattr(m, "processor", None), flux_fused.FusedFluxAttnProcessor) for m in tr.modules())
    assert torch.equal(run(tr, kw), ref) and len(calls) == 4


@pytest.mark.slow  # a real torch.compile on the CPU
def test_really_compiled_fused_blocks_match_eager():
    tr, kw = small_flux(torch.float32), small_inputs(torch.float32)
    ref = run(tr, kw)
    accel.compile_blocks(tr, fused=True)
    try:
        out = run(tr, kw)
    finally:
        accel.uncompile_blocks(tr)
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()


def test_parallel_configs_and_other_models_keep_the_stock_blocks():
    tr = small_flux()
    tr.transformer_blocks[0].attn.processor._parallel_config = object()  # what context parallel sets
    assert "parallel config" in flux_fused.applicable(tr)
    assert flux_fused.enable(tr) == {}
    assert type(tr.transformer_blocks[0].attn.processor).__name__ == "FluxAttnProcessor"
    assert "not FluxTransformer2DModel" in flux_fused.applicable(torch.nn.Linear(2, 2))


def test_fp8_linears_inside_the_fused_forwards_stay_as_close_to_full_precision():
    tr, kw = small_flux(torch.float32), small_inputs(torch.float32)
    exact = run(tr, kw)
    accel.enable_fp8(tr)
    stock = run(tr, kw)
    forwards = flux_fused.enable(tr)
    for block, fwd in forwards.items():
        block.forward = fwd
    fused = run(tr, kw)
    err = lambda out: float((out - exact).norm() / exact.norm())  # noqa: E731
    # the single blocks' proj_out takes its two parts quantised apart (no concatenation): other float8 values
    # than the stock blocks', no further from full precision
    assert not torch.equal(fused, stock)
    assert 0 < err(fused) < 0.1 and err(fused) <= 1.25 * err(stock)


def _text_and_image_parts(seed: int):
    """Two parts of a joint sequence (batch 2: 3 text and 5 image tokens, 4 heads of 8), their norm weights and the
    joint sequence's RoPE cos/sin."""
    g = torch.Generator().manual_seed(seed)
    xt, xi = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 5, 4, 8, generator=g)
    wt, wi = torch.rand(8, generator=g) + 0.5, torch.rand(8, generator=g) + 0.5
    ang = torch.rand(8, 4, generator=g)
    return xt, xi, wt, wi, ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)


def test_rms_rope_reference_is_diffusers_norm_then_rope():
    from diffusers.models.embeddings import apply_rotary_emb

    xt, xi, wt, wi, cos, sin = _text_and_image_parts(3)
    out = fused_kernels.rms_rope([xt, xi], [wt, wi], cos, sin, 1e-6)
    joint = torch.cat([torch.nn.functional.rms_norm(xt, (8,), wt, 1e-6), torch.nn.functional.rms_norm(xi, (8,), wi, 1e-6)], 1)
    assert out.shape == (2, 4, 8, 8) and out.is_contiguous()
    assert torch.equal(out, apply_rotary_emb(joint, (cos, sin), sequence_dim=1).transpose(1, 2))


def test_rms_rope_tokens_major_is_the_same_values_in_diffusers_layout():
    """``tokens_major``: the same (batch, heads, tokens, head_dim) values, as a view of (batch, tokens, heads,
    head_dim) memory (what diffusers hands SDPA), through the torch path and the registered operator's fake."""
    xt, xi, wt, wi, cos, sin = _text_and_image_parts(4)
    heads_major = fused_kernels.rms_rope([xt, xi], [wt, wi], cos, sin, 1e-6)
    tokens_major = fused_kernels.rms_rope([xt, xi], [wt, wi], cos, sin, 1e-6, True)
    assert torch.equal(tokens_major, heads_major) and not tokens_major.is_contiguous()
    assert tokens_major.transpose(1, 2).is_contiguous()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = fused_kernels.rms_rope([mode.from_tensor(x) for x in (xt, xi)], [mode.from_tensor(w) for w in (wt, wi)],
                                      mode.from_tensor(cos), mode.from_tensor(sin), 1e-6, True)
    assert fake.shape == tokens_major.shape and fake.stride() == tokens_major.stride()


_INTERPRETED_TOKENS_MAJOR = '''
import torch
from shardgen.speed import fused_kernels
from tests.test_fa3_fp8 import _parts
qs, ks, vs, wq, wk, cos, sin = _parts(tokens=(7, 139))
heads_major = fused_kernels.rms_rope_triton(qs, wq, cos, sin, 1e-6)
tokens_major = fused_kernels.rms_rope_triton(qs, wq, cos, sin, 1e-6, tokens_major=True)
assert heads_major.is_contiguous() and tokens_major.transpose(1, 2).is_contiguous()
assert torch.equal(tokens_major, heads_major)
print("ok")
'''


def test_the_rms_rope_kernel_writes_tokens_major_memory_when_asked(tmp_path):
    """The q/k RMSNorm + RoPE kernel (Triton's interpreter on the CPU) with ``tokens_major``: the values it writes in
    its own layout, from two parts of 7 and 139 tokens, into (batch, tokens, heads, head_dim) memory."""
    from tests.test_fp8_attention import interpreted

    assert interpreted(_INTERPRETED_TOKENS_MAJOR, tmp_path) == "ok"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pixels_round_like_diffusers_numpy_to_pil(dtype):
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    finite, pixels = to_pixels(images)
    expected = (images.permute(0, 2, 3, 1).float().numpy() * 255).round().astype("uint8")  # numpy_to_pil
    assert finite == [True, True] and np.array_equal(pixels, expected)


def test_attention_with_differing_norm_eps_takes_diffusers_path():
    tr, kw = small_flux(), small_inputs()
    tr.transformer_blocks[0].attn.norm_added_q.eps = 1e-3  # rms_rope takes one eps per tensor
    ref = run(tr, kw)
    flux_fused.enable(tr)
    assert torch.equal(run(tr, kw), ref)
    assert not flux_fused.one_eps(tr.transformer_blocks[0].attn) and flux_fused.one_eps(tr.transformer_blocks[1].attn)


def test_a_single_block_takes_the_previous_single_block_s_output_without_copying_it(monkeypatch):
    """The single blocks' input join (``joined``): the halves the previous single block returned are taken as the
    tensor they are views of (no copy, same values as diffusers' concatenation); any other pair is concatenated."""
    whole = torch.randn(2, 9, 4, dtype=torch.float64)
    text, image = whole[:, :3], whole[:, 3:]
    same = flux_fused.joined(text, image)
    assert same.data_ptr() == whole.data_ptr() and torch.equal(same, torch.cat([text, image], 1))
    for t, i in [(text, whole[:, 4:]), (whole[:, 3:], text), (text.clone(), image), (text, image.clone())]:
        out = flux_fused.joined(t, i)  # not adjacent, swapped, separate tensors: a copy, the same values as cat
        assert out.data_ptr() != whole.data_ptr() and torch.equal(out, torch.cat([t, i], 1))
    tr, kw = small_flux(), small_inputs()
    ref = run(tr, kw)
    for block, fwd in flux_fused.enable(tr).items():
        block.forward = fwd
    real = flux_fused.joined
    shared = []  # per single block: whether its input is its text half's own memory
    monkeypatch.setattr(flux_fused, "joined", lambda t, i: shared.append(real(t, i).data_ptr() == t.data_ptr())
                        or real(t, i))
    out = run(tr, kw)
    assert shared == [False, True]  # the first takes the double blocks' separate outputs: a copy
    assert (out - ref).abs().max() < 1e-12 * ref.abs().max()
    monkeypatch.setattr(flux_fused, "joined", lambda t, i: torch.cat([t, i], 1))
    assert torch.equal(run(tr, kw), out)  # the same values as the concatenation


def _fed_rows(monkeypatch, tr, kw, family):
    """The transformer's output with the fused blocks' float8 layers and how many of their calls took float8 rows
    made by the LayerNorm + modulation pass (``ln_modulate_for``, ``gated_ln_modulate_for``); then the same two with
    that pass writing bf16 for the layers to quantise themselves (``family``: the fused blocks' module)."""
    from shardgen.speed import fp8, fused_kernels

    fed = []
    real_forward = fp8.Float8Linear.forward
    monkeypatch.setattr(fp8.Float8Linear, "forward",
                        lambda self, x: fed.append(isinstance(x, fp8.Fp8Rows)) or real_forward(self, x))
    rows_out = run(tr, kw)
    made = sum(fed)
    fed.clear()
    plain = fused_kernels.ln_modulate
    monkeypatch.setattr(family, "ln_modulate_for", lambda layers, x, shift, scale, eps: plain(x, shift, scale, eps))
    if hasattr(family, "gated_ln_modulate_for"):
        def two_passes(layers, x, gate, y, shift, scale, eps):
            h = fused_kernels.gated(x, gate, y)
            return h, plain(h, shift, scale, eps)

        monkeypatch.setattr(family, "gated_ln_modulate_for", two_passes)
    return rows_out, made, run(tr, kw), sum(fed)


def test_with_fp8_the_norm_pass_hands_the_float8_layers_their_rows(monkeypatch):
    """fp8=true, the eager fused blocks: each adaLN LayerNorm + modulation whose every reader is a float8 layer (q, k
    and v through the fused processor, the MLP's up-projection) gives them its float8 rows itself; the same bytes as
    the layers quantising its bf16 output."""
    tr, kw = small_flux(torch.bfloat16), small_inputs(torch.bfloat16)
    accel.enable_fp8(tr)
    monkeypatch.setattr(flux_fused, "EAGER_DEVICES", ("cpu",))
    for block, fwd in flux_fused.enable(tr).items():
        block.forward = fwd
    rows_out, made, plain_out, plain_made = _fed_rows(monkeypatch, tr, kw, flux_fused)
    assert made == 2 * (3 + 3 + 1 + 1) + 2 * (1 + 3)  # per double block q/k/v twice and two MLPs; per single 4
    assert plain_made == 0 and torch.equal(rows_out, plain_out)


@pytest.mark.parametrize("fp8", [False, True])
def test_each_block_hands_the_next_its_first_norm_and_the_output_stays_the_same(monkeypatch, fp8):
    """Eagerly on CUDA (here the torch fallbacks, bf16) a block's last gated residual and the next block's adaLN norm
    of it come from one pass, and the next block takes that norm instead of computing it: the second double and the
    second single block take it (the first single block follows a double one: it computes its own), and the output
    is the same bytes as without the hand-over. A hook between two blocks that returns new tensors, or a wrapped
    next block, leaves the next block computing its norm itself, with the same output."""
    tr, kw = small_flux(torch.bfloat16), small_inputs(torch.bfloat16)
    if fp8:
        accel.enable_fp8(tr)
    monkeypatch.setattr(flux_fused, "EAGER_DEVICES", ("cpu",))
    for block, fwd in flux_fused.enable(tr).items():
        block.forward = fwd
    taken, real_take = [], block_chain.take_over
    monkeypatch.setattr(block_chain, "take_over", lambda *a: _record(taken, real_take, *a))
    out = run(tr, kw)
    assert taken == [False, True, False, True]
    assert not any(block_chain._HANDOVER in b.__dict__ for b in tr.modules())  # nothing outlives the call
    monkeypatch.setattr(flux_fused, "_successor", lambda *a: None)
    taken.clear()
    assert torch.equal(run(tr, kw), out) and taken == [False] * 4
    monkeypatch.undo()
    monkeypatch.setattr(flux_fused, "EAGER_DEVICES", ("cpu",))
    monkeypatch.setattr(block_chain, "take_over", lambda *a: _record(taken, real_take, *a))
    taken.clear()
    hook = tr.transformer_blocks[0].register_forward_hook(lambda m, args, kwargs, out: tuple(t.clone() for t in out),
                                                          with_kwargs=True)
    assert torch.equal(run(tr, kw), out) and taken == [False, False, False, True]
    hook.remove()
    single = tr.single_transformer_blocks[1]
    single.forward = lambda *a, **k: flux_fused.single_block_forward(single, *a, **k)  # wrapped: not a taker
    taken.clear()
    assert torch.equal(run(tr, kw), out) and taken == [False, True, False, False]


def _record(taken: list, take, *args):
    got = take(*args)
    taken.append(got is not None)
    return got


_INTERPRETED_GATED = '''
import torch
from shardgen.speed import fused_kernels
g = torch.Generator().manual_seed(0)
x, y = (torch.randn(3, 37, 100, generator=g).bfloat16() for _ in range(2))
gate = (torch.randn(3, 6 * 100, generator=g) * 0.3).bfloat16().chunk(6, dim=1)[2][:, None]
out = fused_kernels.gated_triton(x, gate, y)
exact = x.float() + gate.float() * y.float()
# float32 converted once; the interpreter's conversion to bf16 truncates (a GPU's rounds to nearest: tests/test_gpu.py)
ref = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
assert out.shape == ref.shape and torch.equal(out, ref)
print("ok")
'''


def test_the_gated_residual_kernel_adds_each_sample_s_gated_rows(tmp_path):
    """The gated residual's Triton kernel, run by Triton's interpreter on the CPU: each row of x plus its own
    sample's gate row (a strided row of the modulation output) times y, in float32 rounded once to bf16; three
    samples of 37 rows of 100 (neither a multiple of its tile)."""
    from tests.test_fp8_attention import interpreted

    assert interpreted(_INTERPRETED_GATED, tmp_path) == "ok"


_INTERPRETED_GATED_LN = '''
import torch
from shardgen.speed import fp8, fused_kernels
fused_kernels.triton_ok = lambda *xs: True  # CPU tensors, run by Triton's interpreter
g = torch.Generator().manual_seed(2)
x, y = (torch.randn(3, 37, 100, generator=g).bfloat16() for _ in range(2))
mods = (torch.randn(3, 6 * 100, generator=g) * 0.3).bfloat16().chunk(6, dim=1)
gate, shift, scale = (m[:, None] for m in mods[2:5])
layer = fp8.Float8Linear(torch.nn.Linear(100, 8).bfloat16())
for layers in ([], [layer]):
    h, normed = fused_kernels.gated_ln_modulate_for(layers, x, gate, y, shift, scale, 1e-6)
    h_ref = fused_kernels.gated_triton(x, gate, y)
    ref = fused_kernels.ln_modulate_for(layers, h_ref, shift, scale, 1e-6)
    assert torch.equal(h, h_ref)
    if layers:
        assert isinstance(normed, fp8.Fp8Rows) and normed.shape == (3, 37, 100)
        assert torch.equal(normed.scale, ref.scale)
        assert torch.equal(normed.data.view(torch.uint8), ref.data.view(torch.uint8))
    else:
        assert normed.shape == (3, 37, 100) and torch.equal(normed, ref)
print("ok")
'''


def test_the_gated_residual_and_the_next_norm_in_one_pass_write_what_the_two_passes_write(tmp_path):
    """``gated_ln_modulate_for``'s Triton kernel, run by Triton's interpreter on the CPU: the residual it writes is the
    gated kernel's, and the LayerNorm + modulation of it (bf16, or float8 rows for float8 readers) the norm kernel's,
    byte for byte; three samples of 37 rows of 100 (no power of two)."""
    from tests.test_fp8_attention import interpreted

    assert interpreted(_INTERPRETED_GATED_LN, tmp_path) == "ok"
