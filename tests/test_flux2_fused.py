"""shardgen/speed/flux2_fused.py on the CPU: the fused FLUX.2 blocks compute what diffusers' blocks compute.

The Triton kernels run only on CUDA (tests/test_gpu.py checks them against eager there); here every fused op takes
its torch path, which is eager diffusers' own sequence of ops, so the transformer's output keeps its exact bytes.
"""

from __future__ import annotations

import pytest
import torch

from shardgen.families.flux2 import fused as flux2_fused
from shardgen.speed import accel, fused_kernels
from shardgen.speed.blocks import fused_blocks

SMALL_FLUX2 = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32, mlp_ratio=3.0,
                   axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=True)


def small_flux2(dtype=torch.float32, seed=0):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    tr = Flux2Transformer2DModel(**SMALL_FLUX2).eval()
    for p in tr.parameters():
        p.data = p.data.to(dtype)
    with torch.no_grad():  # non-trivial norm weights, so a swapped weight would show
        for p in tr.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return tr


def small_inputs(dtype=torch.float32, batch=2, side=6, text=5):
    g = torch.Generator().manual_seed(1)
    ar = torch.arange(side, dtype=torch.float32)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), ar, ar, torch.zeros(1), indexing="ij"), -1).reshape(-1, 4)
    txt_ids = torch.zeros(text, 4)
    txt_ids[:, 3] = torch.arange(text)
    return dict(hidden_states=torch.randn(batch, side * side, 16, generator=g, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 24, generator=g, dtype=dtype),
                timestep=torch.tensor([0.3, 0.8][:batch], dtype=dtype), guidance=torch.full((batch,), 3.5, dtype=dtype),
                img_ids=img_ids, txt_ids=txt_ids, return_dict=False)


@torch.no_grad()
def run(tr, kw):
    return tr(**kw)[0]


def _install(tr):
    forwards = flux2_fused.enable(tr)
    for block, fwd in forwards.items():
        block.forward = fwd
    return forwards


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_flux2_blocks_give_diffusers_bytes_on_the_cpu(dtype):
    tr, kw = small_flux2(dtype), small_inputs(dtype)
    ref = run(tr, kw)
    forwards = _install(tr)
    assert len(forwards) == 4  # 2 double + 2 single blocks
    procs = [type(m.processor).__name__ for m in tr.modules() if hasattr(m, "processor")]
    assert procs.count("FusedFlux2AttnProcessor") == 2 and procs.count("FusedFlux2ParallelSelfAttnProcessor") == 2
    out = run(tr, kw)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    flux2_fused.disable(tr)
    for block in forwards:
        del block.forward
    assert {type(m.processor).__name__ for m in tr.modules() if hasattr(m, "processor")} == {
        "Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"}
    assert torch.equal(run(tr, kw), ref)


def test_the_fused_ops_torch_paths_are_diffusers_modules():
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 40, generator=g, dtype=torch.bfloat16)
    wide = torch.randn(2, 7, 64, generator=g, dtype=torch.bfloat16)
    assert torch.equal(flux2_fused.swiglu(wide[..., 24:]), Flux2SwiGLU()(wide[..., 24:]))  # a strided view
    mod = torch.randn(2, 1, 120, generator=g, dtype=torch.bfloat16)
    shift, scale, _ = mod.chunk(3, dim=-1)
    norm = torch.nn.LayerNorm(40, elementwise_affine=False, eps=1e-6)
    assert torch.equal(fused_kernels.ln_modulate(x, shift, scale, 1e-6), (1 + scale) * norm(x) + shift)


def test_calls_the_fused_processors_do_not_handle_go_to_diffusers():
    tr = small_flux2()
    _install(tr)
    calls = []
    for m in tr.modules():
        proc = getattr(m, "processor", None)
        if proc is not None:
            orig = proc.fallback
            proc.fallback = lambda *a, _o=orig, **k: calls.append(1) or _o(*a, **k)
    attn = tr.transformer_blocks[0].attn
    hs = torch.randn(2, 36, 32)
    ehs = torch.randn(2, 5, 32)
    attn.processor(attn, hs, ehs, attention_mask=torch.ones(2, 41, dtype=torch.bool), image_rotary_emb=None)
    assert calls == [1]


def test_the_family_names_its_fused_blocks_and_tensor_parallel_or_a_backend_keeps_the_stock_ones():
    tr = small_flux2()
    assert fused_blocks(tr) is flux2_fused and not flux2_fused.COMPILED
    assert fused_blocks(torch.nn.Linear(2, 2)) is None
    tr.transformer_blocks[0].attn.processor._attention_backend = "flash"
    assert "attention backend" in flux2_fused.applicable(tr)
    assert flux2_fused.enable(tr) == {}
    assert "not Flux2Transformer2DModel" in flux2_fused.applicable(torch.nn.Linear(2, 2))


def test_compiled_flux2_blocks_compile_diffusers_forwards_and_eager_fusing_is_undone():
    tr = small_flux2()
    assert accel.fuse_blocks_eager(tr) == 4
    assert any(type(m.processor).__name__.startswith("Fused") for m in tr.modules() if hasattr(m, "processor"))
    accel.uncompile_blocks(tr)
    assert not any(type(m.processor).__name__.startswith("Fused") for m in tr.modules() if hasattr(m, "processor"))
    assert all("forward" not in b.__dict__ for b in accel.repeated_blocks(tr))


def test_with_fp8_the_norm_pass_hands_the_float8_layers_their_rows(monkeypatch):
    """FLUX.2's fused blocks with fp8=true: the LayerNorm + modulation passes give q/k/v (through the fused
    processors), the fused QKV + MLP projection and the feed-forwards their float8 rows; the same bytes as the layers
    quantising the bf16 output."""
    from tests.test_flux_fused import _fed_rows

    tr, kw = small_flux2(torch.bfloat16), small_inputs(torch.bfloat16)
    accel.enable_fp8(tr)
    _install(tr)
    rows_out, made, plain_out, plain_made = _fed_rows(monkeypatch, tr, kw, flux2_fused)
    assert made == 2 * (3 + 3 + 1 + 1) + 2 * 1  # per double block q/k/v twice and two feed-forwards; per single 1
    assert plain_made == 0 and torch.equal(rows_out, plain_out)


@pytest.mark.parametrize("fp8", [False, True])
def test_each_flux2_block_hands_the_next_its_first_norm_and_the_output_stays_the_same(monkeypatch, fp8):
    """In bf16 a FLUX.2 block's last gated residual and the next block's norm of it come from one pass, and the next
    block takes that norm: the second double and the second single block take it (the first single block follows
    the join of the two streams), with the same output bytes as diffusers' blocks and as without the hand-over, and
    nothing left on the blocks after the call. With attention arguments (the reference-image KV cache) none is made."""
    from shardgen.speed import block_chain
    from tests.test_flux_fused import _record

    tr, kw = small_flux2(torch.bfloat16), small_inputs(torch.bfloat16)
    if fp8:
        accel.enable_fp8(tr)
    ref = run(tr, kw)
    _install(tr)
    taken, real_take = [], block_chain.take_over
    monkeypatch.setattr(block_chain, "take_over", lambda *a: _record(taken, real_take, *a))
    out = run(tr, kw)
    assert taken == [False, True, False, True]
    assert not any(block_chain._HANDOVER in b.__dict__ for b in tr.modules())
    if not fp8:
        assert torch.equal(out, ref)
    first, second = tr.transformer_blocks
    x = kw["hidden_states"]
    assert flux2_fused._successor(first, x, None) is second
    assert flux2_fused._successor(first, x, {"kv_cache": None}) is None and flux2_fused._successor(second, x, None) is None
    monkeypatch.setattr(flux2_fused, "_successor", lambda *a: None)
    taken.clear()
    assert torch.equal(run(tr, kw), out) and taken == [False] * 4
    flux2_fused.disable(tr)
    assert not any(block_chain._NEXT in b.__dict__ for b in tr.modules())
