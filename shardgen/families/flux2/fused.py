"""Fused FLUX.2 blocks: the memory-bound work between the matmuls in fewer passes, eagerly and compiled.

FLUX.2-dev's blocks are GEMM-bound, but eagerly about a fifth of a step goes to the elementwise passes around the
GEMMs over (batch, 4608, 6144)-sized activations (and the single blocks' 36864-wide MLP). The fused forwards do
the same arithmetic with the intermediate roundings eager diffusers makes, in fewer passes:

- **LayerNorm + modulation** (``(1 + scale) * LayerNorm(x) + shift``): one Triton pass per token row instead of
  four (the norm, ``1 + scale``, the product, the sum), rounding to bf16 where eager does.
- **q/k RMSNorm + RoPE + the attention layout**: FLUX.1's ``rms_rope`` kernel (shardgen/speed/fused_kernels.py):
  FLUX.2 uses the same norm and the same interleaved real RoPE.
- **SwiGLU** (``silu(a) * b`` over the two halves of the up-projection): one pass reading the GEMM output in
  place (the single blocks' MLP half is a strided view of the fused QKV+MLP projection).
- **the single blocks' output projection** over ``cat([attention, mlp])``: two GEMMs over the weight's column
  blocks, the second accumulating into the first's output (``addmm_``), so the 24576-wide concatenation is never
  written (one more bf16 rounding of a partial sum: bf16 noise).
- **gated residuals** (``x + gate * y``): one pass instead of two (``fused_kernels.gated``), and in bf16 the same
  pass computes the LayerNorm + modulation that reads the result (``fused_kernels.gated_ln_modulate_for``): the MLPs'
  norms, and the next block's first norms, handed to it (``shardgen/speed/block_chain.py``).
- with ``fp8=true``'s float8 layers, eagerly on CUDA: the SwiGLU computed in the pass that writes the next layer's
  float8 rows (``fp8.joined_rows``: its bf16 output never written), for the feed-forward's down-projection and for
  the single blocks' output projection, whose attention part joins the same rows (one GEMM, no sum of two).

Off CUDA (or without Triton) every op runs the torch ops eager diffusers runs, so CPU runs keep its exact
arithmetic. ``enable(transformer)`` swaps the attention processors and returns the block forwards (run eagerly
or compiled by shardgen/speed/accel.py); ``disable`` restores diffusers' processors. Only plain
``Flux2Transformer2DModel`` blocks with diffusers' own processors, the native attention backend and no
context/tensor-parallel config are touched; a call with extra attention arguments (FLUX.2's reference-image KV
cache) goes to diffusers' processor.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.nn.functional as F

from shardgen.speed import block_chain
from shardgen.speed.fp8 import Float8Linear, joined_rows
from shardgen.speed.fused_kernels import (for_layer, gated, gated_ln_modulate_for, layer_norm_problem, ln_modulate_for,
                                         norm_eps, norm_weight, one_eps, processor_problem, restore_processors, rope_attention,
                                         swap_processors, tl, triton, triton_ok)

log = logging.getLogger("shardgen.flux2_fused")

COMPILED = False
"""Compiled blocks compile diffusers' own forwards: inductor fuses these passes itself."""


# --- SwiGLU --------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _swiglu_kernel(x_ptr, out_ptr, half, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < half
        a = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(x_ptr + row * stride_x + half + col, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (a / (1.0 + tl.exp(-a))).to(dtype).to(tl.float32)  # eager rounds silu(a) before the product
        tl.store(out_ptr + row * half + col, (silu * g).to(dtype), mask=mask)


@torch.library.custom_op("shardgen::flux2_swiglu", mutates_args=())
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``Flux2SwiGLU``: ``silu(x[..., :half]) * x[..., half:]``, in one pass on CUDA (``x`` may be a
    column slice of a wider tensor). An opaque op, so a compiler keeps the one pass."""
    half = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])  # a view for a column slice of a contiguous tensor
    if not triton_ok(x) or rows.data_ptr() != x.data_ptr() or x.shape[-1] % 2:
        return F.silu(x[..., :half]) * x[..., half:]
    out = torch.empty(*x.shape[:-1], half, device=x.device, dtype=x.dtype)
    block = 1024
    _swiglu_kernel[(rows.shape[0], triton.cdiv(half, block))](rows, out, half, rows.stride(0), BLOCK=block,
                                                              num_warps=4)
    return out


@swiglu.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


# --- the attention processors ------------------------------------------------------------------------------

def _plain_call(attention_mask, image_rotary_emb, kwargs, attn) -> bool:
    return attention_mask is None and image_rotary_emb is not None and not kwargs and one_eps(attn)


class FusedFlux2AttnProcessor:
    """diffusers' ``Flux2AttnProcessor`` (double-stream blocks; no mask, native SDPA) with q/k RMSNorm + RoPE +
    layout in one op per tensor."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, fallback):
        self.fallback = fallback  # the processor it replaced: takes any call this one does not handle

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        if not _plain_call(attention_mask, image_rotary_emb, kwargs, attn) or encoder_hidden_states is None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                 **kwargs)
        cos, sin = image_rotary_emb
        heads_dim = (-1, attn.head_dim)
        img = [attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)]
        txt = [attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states),
               attn.add_v_proj(encoder_hidden_states)]
        (q, k, v), (tq, tk, tv) = ([t.unflatten(-1, heads_dim) for t in part] for part in (img, txt))
        eps = norm_eps(attn.norm_q, q.dtype)
        # text tokens first, as diffusers joins them
        wq = [norm_weight(attn.norm_added_q, q), norm_weight(attn.norm_q, q)]
        wk = [norm_weight(attn.norm_added_k, k), norm_weight(attn.norm_k, k)]
        out = rope_attention([tq, q], [tk, k], [tv, v], wq, wk, cos, sin, eps)
        text = encoder_hidden_states.shape[1]
        encoder_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        return (attn.to_out[1](attn.to_out[0](for_layer(attn.to_out[0], out))),
                attn.to_add_out(for_layer(attn.to_add_out, encoder_out)))


class FusedFlux2ParallelSelfAttnProcessor:
    """diffusers' ``Flux2ParallelSelfAttnProcessor`` (single-stream blocks: attention and MLP share the input and
    output projections) with q/k RMSNorm + RoPE in one op, the SwiGLU in one pass and the output projection over
    the two parts without their concatenation."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, fallback):
        self.fallback = fallback

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None, **kwargs):
        fp8 = isinstance(attn.to_out, Float8Linear)
        if not _plain_call(attention_mask, image_rotary_emb, kwargs, attn) or not (
                fp8 or type(attn.to_out) is torch.nn.Linear):
            return self.fallback(attn, hidden_states, attention_mask, image_rotary_emb, **kwargs)
        cos, sin = image_rotary_emb
        proj = attn.to_qkv_mlp_proj(hidden_states)
        inner = attn.inner_dim
        heads_dim = (-1, attn.head_dim)
        q, k, v = (proj[..., i * inner:(i + 1) * inner].unflatten(-1, heads_dim) for i in range(3))
        eps = norm_eps(attn.norm_q, q.dtype)
        out = rope_attention([q], [k], [v], [norm_weight(attn.norm_q, q)], [norm_weight(attn.norm_k, k)], cos, sin, eps)
        if fp8:  # the SwiGLU computed where the joined float8 rows are written; else each part on its own
            rows = joined_rows(out, proj[..., 3 * inner:], "swiglu")
            return attn.to_out(rows) if rows is not None else attn.to_out.forward_parts(
                [out, swiglu(proj[..., 3 * inner:])])
        mlp = swiglu(proj[..., 3 * inner:])
        if not out.is_cuda:  # eager's one GEMM over the concatenation: its exact bytes
            return attn.to_out(torch.cat([out, mlp], dim=-1))
        w = attn.to_out.weight
        result = F.linear(out, w[:, :inner], attn.to_out.bias)
        flat = result.view(-1, result.shape[-1])
        flat.addmm_(mlp.reshape(-1, mlp.shape[-1]), w[:, inner:].t())
        return result


# --- block forwards ------------------------------------------------------------------------------------------

def _split_mod(mod: torch.Tensor, sets: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    return Flux2Modulation.split(mod, sets)


def _ff(ff: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``Flux2FeedForward`` with the SwiGLU in one pass: into a float8 down-projection's rows where that
    pass can write them (``joined_rows``)."""
    h = ff.linear_in(x)
    rows = joined_rows(None, h, "swiglu") if isinstance(ff.linear_out, Float8Linear) else None
    return ff.linear_out(rows if rows is not None else swiglu(h))


def double_block_forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
                         image_rotary_emb=None, joint_attention_kwargs=None):
    """``Flux2TransformerBlock.forward`` with fused LayerNorm+modulation, SwiGLU and gated residuals; each gated
    residual in one pass with the norm that reads it (the MLPs' norms, and the next block's first norms, which it
    hands over: ``shardgen/speed/block_chain.py``)."""
    call = (temb_mod_img, temb_mod_txt, image_rotary_emb, joint_attention_kwargs)
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = _split_mod(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = _split_mod(temb_mod_txt, 2)
    eps, attn = self.norm1.eps, self.attn
    pre = block_chain.take_over(self, (encoder_hidden_states, hidden_states), call)
    if pre is None:
        into, c_into = _double_norm_readers(self, image_rotary_emb, joint_attention_kwargs)
        pre = (ln_modulate_for(into, hidden_states, shift_msa, scale_msa, eps),
               ln_modulate_for(c_into, encoder_hidden_states, c_shift_msa, c_scale_msa, eps))
    attn_output, context_attn_output = attn(hidden_states=pre[0], encoder_hidden_states=pre[1],
                                            image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states, normed = gated_ln_modulate_for([self.ff.linear_in], hidden_states, gate_msa, attn_output,
                                                  shift_mlp, scale_mlp, eps)
    ff = _ff(self.ff, normed)
    nxt = _successor(self, hidden_states, joint_attention_kwargs)
    into, c_into = ([], []) if nxt is None else _double_norm_readers(nxt, image_rotary_emb, joint_attention_kwargs)
    hidden_states, handed = _last_residual(nxt, into, hidden_states, gate_mlp, ff, shift_msa, scale_msa)
    encoder_hidden_states, normed = gated_ln_modulate_for([self.ff_context.linear_in], encoder_hidden_states,
                                                          c_gate_msa, context_attn_output, c_shift_mlp, c_scale_mlp,
                                                          eps)
    ff = _ff(self.ff_context, normed)
    encoder_hidden_states, c_handed = _last_residual(nxt, c_into, encoder_hidden_states, c_gate_mlp, ff, c_shift_msa,
                                                     c_scale_msa)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if nxt is not None:
        block_chain.hand_over(nxt, (encoder_hidden_states, hidden_states), call, (handed, c_handed))
    return encoder_hidden_states, hidden_states


def single_block_forward(self, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb=None,
                         joint_attention_kwargs=None, split_hidden_states=False, text_seq_len=None):
    """``Flux2SingleTransformerBlock.forward`` with fused LayerNorm+modulation and gated residual; the residual in
    one pass with the next single block's norm of it, which it hands over (``shardgen/speed/block_chain.py``)."""
    call = (temb_mod, image_rotary_emb, joint_attention_kwargs)
    pre = block_chain.take_over(self, (hidden_states, encoder_hidden_states), call)
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = _split_mod(temb_mod, 1)[0]
    if pre is None:
        pre = ln_modulate_for(_single_norm_readers(self, image_rotary_emb, joint_attention_kwargs), hidden_states,
                              shift, scale, self.norm.eps)
    attn_output = self.attn(hidden_states=pre, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    nxt = None if split_hidden_states else _successor(self, hidden_states, joint_attention_kwargs)
    into = _single_norm_readers(nxt, image_rotary_emb, joint_attention_kwargs) if nxt is not None else []
    hidden_states, handed = _last_residual(nxt, into, hidden_states, gate, attn_output, shift, scale)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    if nxt is not None:
        block_chain.hand_over(nxt, (hidden_states, None), call, handed)
    return hidden_states


def _double_norm_readers(block, image_rotary_emb, joint_attention_kwargs) -> tuple[list, list]:
    """The layers reading a double block's first norms: q, k, v of the image and text streams when the fused
    processor projects them (it only projects its inputs: they may come as float8 rows), else none."""
    attn = block.attn
    if not (isinstance(attn.processor, FusedFlux2AttnProcessor)
            and _plain_call(None, image_rotary_emb, joint_attention_kwargs or {}, attn)):
        return [], []
    return [attn.to_q, attn.to_k, attn.to_v], [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj]


def _single_norm_readers(block, image_rotary_emb, joint_attention_kwargs) -> list:
    """The layer reading a single block's norm when the fused processor computes its call with float8 layers (the
    joint QKV + MLP projection), else none."""
    attn = block.attn
    rows = (isinstance(attn.processor, FusedFlux2ParallelSelfAttnProcessor)
            and _plain_call(None, image_rotary_emb, joint_attention_kwargs or {}, attn)
            and isinstance(attn.to_out, Float8Linear))
    return [attn.to_qkv_mlp_proj] if rows else []


def _successor(block: torch.nn.Module, x: torch.Tensor, joint_attention_kwargs) -> torch.nn.Module | None:
    """The next block of the same kind when it will take its first norms from this one (``block_chain``): bf16 (fp16
    clips between the residual and the norm), eager, and no attention arguments (FLUX.2's reference-image KV cache
    changes them from block to block)."""
    if torch.compiler.is_compiling() or x.dtype != torch.bfloat16 or joint_attention_kwargs:
        return None
    return block_chain.successor(block, _TAKERS)


def _last_residual(nxt, into: list, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, shift: torch.Tensor,
                   scale: torch.Tensor):
    """``gated(x, gate, y)`` and None, or for a successor ``nxt`` with its first norm of the result in the same pass
    (FLUX.2's blocks share their modulation: ``shift`` and ``scale`` are the next block's too)."""
    if nxt is None:
        return gated(x, gate, y), None
    eps = nxt.norm1.eps if hasattr(nxt, "norm1") else nxt.norm.eps
    return gated_ln_modulate_for(into, x, gate, y, shift, scale, eps)


_FORWARDS = {"Flux2SingleTransformerBlock": single_block_forward, "Flux2TransformerBlock": double_block_forward}
_PROCESSORS = {"Flux2AttnProcessor": FusedFlux2AttnProcessor,
               "Flux2ParallelSelfAttnProcessor": FusedFlux2ParallelSelfAttnProcessor}
_FUSED = tuple(_PROCESSORS.values())
_TAKERS = (single_block_forward, double_block_forward)


# --- switching it on and off ---------------------------------------------------------------------------------

def applicable(transformer: torch.nn.Module) -> str | None:
    """None when the fused blocks can replace this transformer's, else why not."""
    if type(transformer).__name__ != "Flux2Transformer2DModel":
        return f"{type(transformer).__name__} is not Flux2Transformer2DModel"
    return processor_problem(transformer, tuple(_PROCESSORS), _FUSED) or layer_norm_problem(transformer)


def enable(transformer: torch.nn.Module) -> dict[torch.nn.Module, Any]:
    """Swap in the fused attention processors; {block: fused forward (bound)}. Empty (nothing touched) when
    ``applicable`` says no."""
    why = applicable(transformer)
    if why is not None:
        log.info("fused FLUX.2 blocks not used: %s", why)
        return {}
    swap_processors(transformer, _PROCESSORS)
    block_chain.link(_chains(transformer))
    return {mod: types.MethodType(_FORWARDS[type(mod).__name__], mod) for mod in transformer.modules()
            if type(mod).__name__ in _FORWARDS}


def disable(transformer: torch.nn.Module) -> None:
    """Put diffusers' own processors back (the caller restores the forwards) and unlink the blocks."""
    restore_processors(transformer)
    block_chain.unlink(_chains(transformer))


def _chains(transformer: torch.nn.Module) -> list:
    """The double and the single blocks, each in the order the transformer's forward runs them."""
    return [transformer.transformer_blocks, transformer.single_transformer_blocks]
