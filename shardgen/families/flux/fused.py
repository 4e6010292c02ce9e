"""Fused FLUX blocks, compiled and eager: the memory-bound work around the matmuls, done in fewer passes.

Under regional compilation, inductor already fuses the FLUX blocks' elementwise chains, but three
patterns stay expensive on an H100/H200 (measured with ``benchmarks/probe_transformer.py``):

- **q/k RMSNorm + RoPE + the attention layout**: inductor emits a looped reduction that reads q and k
  twice and writes them transposed for SDPA at ~1.4 TB/s. ``rms_rope`` does it in one pass per
  (tokens x head) tile with a Triton kernel: RMSNorm in fp32, rounded to bf16 where eager rounds
  (after the weight), RoPE in fp32 on the rounded values, written straight into the (batch, heads,
  tokens, head_dim) layout that SDPA reads, text and image parts of the joint sequence into one buffer.
  Its numerics are eager diffusers' (``torch.nn.RMSNorm`` then ``apply_rotary_emb``); off CUDA (or
  without Triton) the op runs exactly those torch ops.
- **the MLP up-projection's tanh-GELU**: computed in cuBLASLt's GEMM epilogue
  (``torch._addmm_activation(use_gelu=True)``) from the fp32 accumulator, instead of a separate pass
  over the 12288-wide activation.
- **the single-stream block's ``proj_out(cat([attn, mlp]))``**: the concatenation copies a
  15360-wide activation per block; two GEMMs over the two parts (the weight's column blocks) summed in
  the block's fused residual kernel compute the same product without it (one more bf16 rounding of a
  partial sum: bf16 noise).

Eagerly on CUDA (``compile=false``, a ``compile: auto`` process before or without its switch) the blocks also do
what inductor's fusion does compiled: each adaLN LayerNorm + modulation in one Triton pass (``ln_modulate``,
rounding where eager rounds), each gated residual in one pass (``gated``), and the single block's second ``proj_out``
GEMM accumulating into the first's output. Off CUDA every op is eager diffusers' own. Uncompiled, anywhere, a single
block's input is the previous single block's output as it is (``joined``: the text and image halves it returned are
views of one tensor) instead of their concatenation, a copy of the whole activation per block.

``enable(transformer)`` swaps the attention processors and returns the block forwards that
``shardgen.speed.accel.compile_blocks`` compiles instead of the blocks' own; ``disable`` restores them. Only
plain ``FluxTransformer2DModel`` blocks with diffusers' own ``FluxAttnProcessor``, the native attention
backend and no context/tensor-parallel config are touched; anything else keeps the stock forward.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.nn.functional as F

from shardgen.speed import block_chain
from shardgen.speed.fp8 import Float8Linear, gelu_rows, joined_rows
from shardgen.speed.fused_kernels import (ff_input_layers, for_layer, gated, gated_ln_modulate_for, gelu_feed_forward,
                                         gelu_up, ln_modulate_for, norm_eps, norm_weight, one_eps, processor_problem,
                                         restore_processors, rope_attention, swap_processors)

log = logging.getLogger("shardgen.flux_fused")

COMPILED = True
"""Compiled blocks compile these forwards too (inductor leaves the three patterns above slow)."""
EAGER_DEVICES = ("cuda",)
"""Where the eager-only fusions run (elsewhere the stock ops keep eager diffusers' exact bytes)."""

# --- the attention processor ------------------------------------------------------------------------

class FusedFluxAttnProcessor:
    """diffusers' ``FluxAttnProcessor`` (no mask, no IP adapter, native SDPA) with q/k RMSNorm + RoPE
    + layout in one op per tensor (``rms_rope``)."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, fallback):
        self.fallback = fallback  # the processor it replaced: takes any call this one does not handle

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, **kwargs):
        if attention_mask is not None or image_rotary_emb is None or kwargs or not one_eps(attn):
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                 **kwargs)
        cos, sin = image_rotary_emb
        heads_dim = (-1, attn.head_dim)
        q = attn.to_q(hidden_states).unflatten(-1, heads_dim)
        k = attn.to_k(hidden_states).unflatten(-1, heads_dim)
        v = attn.to_v(hidden_states).unflatten(-1, heads_dim)
        qs, ks, vs = [q], [k], [v]
        wq, wk = [norm_weight(attn.norm_q, q)], [norm_weight(attn.norm_k, k)]
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:  # text tokens first, as diffusers joins them
            qs.insert(0, attn.add_q_proj(encoder_hidden_states).unflatten(-1, heads_dim))
            ks.insert(0, attn.add_k_proj(encoder_hidden_states).unflatten(-1, heads_dim))
            vs.insert(0, attn.add_v_proj(encoder_hidden_states).unflatten(-1, heads_dim))
            wq.insert(0, norm_weight(attn.norm_added_q, q))
            wk.insert(0, norm_weight(attn.norm_added_k, k))
        out = rope_attention(qs, ks, vs, wq, wk, cos, sin, norm_eps(attn.norm_q, q.dtype))
        if encoder_hidden_states is None:
            return out
        text = encoder_hidden_states.shape[1]
        encoder_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        out = attn.to_out[1](attn.to_out[0](for_layer(attn.to_out[0], out)))
        return out, attn.to_add_out(for_layer(attn.to_add_out, encoder_out))


# --- block forwards ------------------------------------------------------------------------------------

def single_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                         joint_attention_kwargs=None):
    """``FluxSingleTransformerBlock.forward`` with the GELU in the GEMM epilogue and ``proj_out`` over
    the concatenation computed as two GEMMs (no 15360-wide copy)."""
    return _single_block(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                         joint_attention_kwargs, split=True)


def single_block_forward_cat(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                             joint_attention_kwargs=None):
    """As ``single_block_forward`` but ``proj_out`` over the concatenation, as diffusers does it."""
    return _single_block(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                         joint_attention_kwargs, split=False)


def _single_block(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs,
                  split: bool):
    text_seq_len = encoder_hidden_states.shape[1]
    call = (temb, image_rotary_emb, joint_attention_kwargs)
    pre = block_chain.take_over(self, (encoder_hidden_states, hidden_states), call)
    hidden_states = joined(encoder_hidden_states, hidden_states)
    nxt = None
    if split and isinstance(self.proj_out, Float8Linear) and isinstance(self.proj_mlp, Float8Linear):
        hidden_states, nxt = _single_block_fp8(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs,
                                               pre)
    elif split and _eager_fusable(hidden_states, self.norm) and type(self.proj_out) is torch.nn.Linear:
        hidden_states, nxt = _single_block_eager(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs,
                                                 pre)
    else:
        hidden_states = _single_block_stock(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs,
                                            split)
    text, image = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    if torch.compiler.is_compiling():
        # the first single block gets the double blocks' contiguous outputs, the others these views (batch
        # stride text + image tokens): dynamo's stride guards made that two graphs of this block, each compiled
        # from scratch on a fresh cache. Contiguous halves keep one graph; inductor can write them from the
        # residual's kernel. Eagerly the views stay (a copy there would cost a pass over the activations each).
        text, image = text.contiguous(), image.contiguous()
    elif nxt is not None:
        block_chain.hand_over(nxt[0], (text, image), call, nxt[1])
    return text, image


def joined(text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """``torch.cat([text, image], dim=1)``, without the copy when the two are the halves a single block returned: the
    views of one contiguous (batch, text + image tokens, dim) tensor, text first (the next single block's input, 37
    times a step for FLUX.1-dev: a copy of the whole activation each, ~3% of an fp8 step). The same values either way.
    Compiled blocks always copy (their halves are made contiguous, so dynamo sees one graph)."""
    b, t, d = text.shape
    whole = (b, t + image.shape[1], d)
    if (not torch.compiler.is_compiling() and image.dim() == 3 and image.shape[::2] == (b, d)
            and text.dtype == image.dtype and text.device == image.device
            and text.stride() == image.stride() == (whole[1] * d, d, 1)
            and text.untyped_storage().data_ptr() == image.untyped_storage().data_ptr()
            and image.storage_offset() == text.storage_offset() + t * d):
        return text.as_strided(whole, text.stride())
    return torch.cat([text, image], dim=1)


def _single_block_stock(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs, split: bool):
    """The single block's body as diffusers computes it, with the GELU in the GEMM epilogue and (``split``)
    ``proj_out`` as two GEMMs over the two parts of its input."""
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = gelu_up(self.proj_mlp, norm_hidden_states)
    attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                            **(joint_attention_kwargs or {}))
    if split and type(self.proj_out) is torch.nn.Linear:
        dim, w = attn_output.shape[-1], self.proj_out.weight
        proj = F.linear(attn_output, w[:, :dim], self.proj_out.bias) + F.linear(mlp_hidden_states, w[:, dim:])
    else:
        proj = self.proj_out(torch.cat([attn_output, mlp_hidden_states], dim=2))
    hidden_states = residual + gate.unsqueeze(1) * proj
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states


def _single_block_fp8(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs, pre=None):
    """The single block's body with fp8=true's float8 layers: the normed input quantised once for the MLP and
    q/k/v; eagerly on CUDA the LayerNorm + modulation in one pass, which writes the float8 rows themselves when the
    fused processor takes them, and ``proj_out``'s input (the attention output beside the MLP's GELU) quantised in
    one pass that computes the GELU and writes the concatenation's float8 rows (``joined_rows``: one GEMM, no
    bf16 GELU or concatenation written). Elsewhere ``proj_out`` takes the two parts one GEMM each, each quantised
    with its own row scales, the GELU written straight into float8. ``pre``: this block's normed input, handed over
    by the block before (``block_chain.take_over``). (the block's output, what it hands the next block or None)."""
    if pre is not None:
        normed, (gate,) = pre[0]
    elif _eager_fusable(hidden_states, self.norm):
        normed, (gate,) = _ada_norm(self.norm, hidden_states, temb, 3,
                                    _single_norm_readers(self, image_rotary_emb, joint_attention_kwargs) or [])
    else:
        normed, gate = self.norm(hidden_states, emb=temb)
    attn_output = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    mlp = self.proj_mlp(normed)  # after the attention: its bf16 activation (12288 wide) lives until the next pass only
    rows = joined_rows(attn_output, mlp, "gelu")
    proj = self.proj_out(rows) if rows is not None else self.proj_out.forward_parts([attn_output, gelu_rows(mlp)])
    hidden_states, nxt = _last_residual(self, hidden_states, gate[:, None], proj,
                                        (temb, image_rotary_emb, joint_attention_kwargs))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states, nxt


def _single_block_eager(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs, pre=None):
    """The single block's body eagerly on CUDA: LayerNorm + modulation in one pass, ``proj_out``'s second GEMM
    accumulating into the first's output (no sum pass), the gated residual in one pass (``gated``), or with the
    next block's LayerNorm + modulation (``_last_residual``). (the block's output, what it hands the next block)."""
    normed, (gate,) = pre[0] if pre is not None else _ada_norm(self.norm, hidden_states, temb, 3)
    mlp_hidden_states = gelu_up(self.proj_mlp, normed)
    attn_output = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    dim, w = attn_output.shape[-1], self.proj_out.weight
    proj = F.linear(attn_output, w[:, :dim], self.proj_out.bias)
    proj.view(-1, proj.shape[-1]).addmm_(mlp_hidden_states.reshape(-1, mlp_hidden_states.shape[-1]), w[:, dim:].t())
    hidden_states, nxt = _last_residual(self, hidden_states, gate[:, None], proj,
                                        (temb, image_rotary_emb, joint_attention_kwargs))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states, nxt


def _plain_layer_norm(norm: torch.nn.Module) -> bool:
    return type(norm) is torch.nn.LayerNorm and not norm.elementwise_affine


def _eager_fusable(x: torch.Tensor, *norms: torch.nn.Module) -> bool:
    """The eager-only fusions apply: a CUDA tensor outside a compiler's trace (compiled, inductor fuses these passes
    with their neighbours itself, and better), adaLN modules (``AdaLayerNormZero``/``...Single``) without their own
    embedding, and plain LayerNorms (no weight): ``ln_modulate``'s arithmetic."""
    if x.device.type not in EAGER_DEVICES or torch.compiler.is_compiling():
        return False
    for norm in norms:
        inner = getattr(norm, "norm", norm)
        if getattr(norm, "emb", None) is not None or not _plain_layer_norm(inner):
            return False
    return True


def _ada_norm(norm: torch.nn.Module, x: torch.Tensor, temb: torch.Tensor, chunks: int,
              into: list[torch.nn.Module] = ()):
    """diffusers' ``AdaLayerNormZero`` (``chunks=6``) or ``AdaLayerNormZeroSingle`` (3) with its LayerNorm and
    modulation in one pass: (the modulated ``x``, the other modulation tensors). ``into``: the layers that read
    it (``ln_modulate_for``: float8 rows when all are float8)."""
    mods = norm.linear(norm.silu(temb)).chunk(chunks, dim=1)
    return ln_modulate_for(list(into), x, mods[0][:, None], mods[1][:, None], norm.norm.eps), mods[2:]


def _processor_takes_rows(attn, image_rotary_emb, joint_attention_kwargs) -> bool:
    """The fused processor will compute this call (not hand it to diffusers' own): it only projects its inputs, so
    they may come as float8 rows."""
    return (isinstance(attn.processor, FusedFluxAttnProcessor) and image_rotary_emb is not None
            and not joint_attention_kwargs and one_eps(attn))


def double_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                         joint_attention_kwargs=None):
    """``FluxTransformerBlock.forward`` with both MLPs' GELU in the GEMM epilogue (eagerly on CUDA also the
    LayerNorm + modulation passes and the gated residuals fused: ``_double_block_eager``)."""
    if _eager_fusable(hidden_states, self.norm1, self.norm1_context, self.norm2, self.norm2_context):
        return _double_block_eager(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                   joint_attention_kwargs)
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb)
    attention_outputs = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states,
                                  image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    attn_output, context_attn_output = attention_outputs[:2]
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * gelu_feed_forward(self.ff, norm_hidden_states)
    if len(attention_outputs) == 3:
        hidden_states = hidden_states + attention_outputs[2]
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_encoder_hidden_states = (self.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp[:, None])
                                  + c_shift_mlp[:, None])
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * gelu_feed_forward(self.ff_context,
                                                                                   norm_encoder_hidden_states)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _double_block_eager(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs):
    """The double block's body eagerly on CUDA: each LayerNorm + modulation in one pass, each gated residual in one
    pass with the LayerNorm + modulation that reads it (``gated_ln_modulate_for``: the MLPs' norms here, the next
    block's first norms at the end: ``block_chain``); compiled, inductor fuses the same passes
    (``double_block_forward``'s torch ops)."""
    call = (temb, image_rotary_emb, joint_attention_kwargs)
    pre = block_chain.take_over(self, (encoder_hidden_states, hidden_states), call)
    if pre is None:
        into, c_into = _double_norm1_readers(self, image_rotary_emb, joint_attention_kwargs)
        pre = (_ada_norm(self.norm1, hidden_states, temb, 6, into),
               _ada_norm(self.norm1_context, encoder_hidden_states, temb, 6, c_into))
    (normed, (gate_msa, shift_mlp, scale_mlp, gate_mlp)), (c_normed, (c_gate_msa, c_shift_mlp, c_scale_mlp,
                                                                      c_gate_mlp)) = pre
    attention_outputs = self.attn(hidden_states=normed, encoder_hidden_states=c_normed,
                                  image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    attn_output, context_attn_output = attention_outputs[:2]
    hidden_states, normed = gated_ln_modulate_for(ff_input_layers(self.ff), hidden_states, gate_msa[:, None],
                                                  attn_output, shift_mlp[:, None], scale_mlp[:, None], self.norm2.eps)
    ff = gelu_feed_forward(self.ff, normed)
    nxt = _successor(self, hidden_states, call) if len(attention_outputs) == 2 else None
    if nxt is None:
        hidden_states = gated(hidden_states, gate_mlp[:, None], ff)
        if len(attention_outputs) == 3:
            hidden_states = hidden_states + attention_outputs[2]
    else:
        into, c_into = _double_norm1_readers(nxt, image_rotary_emb, joint_attention_kwargs)
        hidden_states, handed = _gated_ada_norm(nxt.norm1, hidden_states, gate_mlp[:, None], ff, temb, 6, into)
    encoder_hidden_states, c_normed = gated_ln_modulate_for(
        ff_input_layers(self.ff_context), encoder_hidden_states, c_gate_msa[:, None], context_attn_output,
        c_shift_mlp[:, None], c_scale_mlp[:, None], self.norm2_context.eps)
    ff = gelu_feed_forward(self.ff_context, c_normed)
    if nxt is None:
        encoder_hidden_states = gated(encoder_hidden_states, c_gate_mlp[:, None], ff)
    else:
        encoder_hidden_states, c_handed = _gated_ada_norm(nxt.norm1_context, encoder_hidden_states,
                                                          c_gate_mlp[:, None], ff, temb, 6, c_into)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if nxt is not None:
        block_chain.hand_over(nxt, (encoder_hidden_states, hidden_states), call, (handed, c_handed))
    return encoder_hidden_states, hidden_states


def _double_norm1_readers(block, image_rotary_emb, joint_attention_kwargs) -> tuple[list, list]:
    """The layers reading a double block's first two norms (``ln_modulate_for``'s ``layers``): q, k and v of the
    image and the text stream when the fused processor projects them (float8 rows for float8 layers), else none."""
    attn = block.attn
    if not _processor_takes_rows(attn, image_rotary_emb, joint_attention_kwargs):
        return [], []
    return [attn.to_q, attn.to_k, attn.to_v], [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj]


def _single_norm_readers(block, image_rotary_emb, joint_attention_kwargs) -> list | None:
    """The layers reading a single block's norm in its eager bodies (``_single_block_fp8``: the MLP's up-projection
    and q, k, v when the fused processor projects them; ``_single_block_eager``: none), or None when the block runs
    neither (diffusers' own ops: ``_single_block_stock``)."""
    if isinstance(block.proj_out, Float8Linear) and isinstance(block.proj_mlp, Float8Linear):
        attn = block.attn
        return ([block.proj_mlp, attn.to_q, attn.to_k, attn.to_v]
                if _processor_takes_rows(attn, image_rotary_emb, joint_attention_kwargs) else [])
    return [] if type(block.proj_out) is torch.nn.Linear else None


# --- a block's last residual and the next block's first norm, in one pass (shardgen/speed/block_chain.py) -----------

def _successor(block: torch.nn.Module, x: torch.Tensor, call: tuple) -> torch.nn.Module | None:
    """The block after ``block`` when it will take its first norms from ``block`` (``block_chain``): the fused
    forward of the same kind, eagerly on CUDA in bf16 (fp16 clips between the residual and the norm), through a body
    that computes that norm with ``_ada_norm``; else None."""
    if x.device.type not in EAGER_DEVICES or torch.compiler.is_compiling() or x.dtype != torch.bfloat16:
        return None
    nxt = block_chain.successor(block, _TAKERS)
    if nxt is None:
        return None
    if type(nxt).__name__ == "FluxTransformerBlock":
        return nxt if _eager_fusable(x, nxt.norm1, nxt.norm1_context, nxt.norm2, nxt.norm2_context) else None
    return nxt if _eager_fusable(x, nxt.norm) and _single_norm_readers(nxt, *call[1:]) is not None else None


def _gated_ada_norm(norm: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, temb: torch.Tensor,
                    chunks: int, into: list[torch.nn.Module]):
    """(``gated(x, gate, y)``, ``_ada_norm(norm, <that>, temb, chunks, into)``) from one pass over the rows."""
    mods = norm.linear(norm.silu(temb)).chunk(chunks, dim=1)
    h, normed = gated_ln_modulate_for(list(into), x, gate, y, mods[0][:, None], mods[1][:, None], norm.norm.eps)
    return h, (normed, mods[2:])


def _last_residual(block: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, call: tuple):
    """A single block's last gated residual ``x + gate * y``: (it, None), or with the next single block's norm of it
    in one pass (``_successor``): (it, (that block, its ``_ada_norm`` result))."""
    nxt = _successor(block, x, call)
    if nxt is None:
        return gated(x, gate, y), None
    h, normed = _gated_ada_norm(nxt.norm, x, gate, y, call[0], 3, _single_norm_readers(nxt, *call[1:]))
    return h, (nxt, (normed,))


_FORWARDS = {"FluxSingleTransformerBlock": single_block_forward, "FluxTransformerBlock": double_block_forward}
_TAKERS = (single_block_forward, double_block_forward)
"""The forwards that take their first norm from the block before (``single_block_forward_cat`` runs diffusers' ops)."""


# --- switching it on and off ---------------------------------------------------------------------------

def applicable(transformer: torch.nn.Module) -> str | None:
    """None when the fused blocks can replace this transformer's, else why not."""
    if type(transformer).__name__ != "FluxTransformer2DModel":
        return f"{type(transformer).__name__} is not FluxTransformer2DModel"
    return processor_problem(transformer, ("FluxAttnProcessor",), (FusedFluxAttnProcessor,))


def enable(transformer: torch.nn.Module, split_proj_out: bool = True) -> dict[torch.nn.Module, Any]:
    """Swap in the fused attention processors; {block: fused forward (bound)} for the compiler.
    Empty (nothing touched) when ``applicable`` says no. ``split_proj_out=False`` keeps the single
    blocks' concatenation (bit-closer to eager, a little slower)."""
    why = applicable(transformer)
    if why is not None:
        log.info("fused FLUX blocks not used: %s", why)
        return {}
    swap_processors(transformer, {"FluxAttnProcessor": FusedFluxAttnProcessor})
    forwards = {}
    for mod in transformer.modules():
        fwd = _FORWARDS.get(type(mod).__name__)
        if fwd is single_block_forward and not split_proj_out:
            fwd = single_block_forward_cat
        if fwd is not None:
            forwards[mod] = types.MethodType(fwd, mod)
    block_chain.link(_block_lists(transformer))
    return forwards


def disable(transformer: torch.nn.Module) -> None:
    """Put diffusers' own processors back (the compiler restores the forwards) and unlink the blocks."""
    restore_processors(transformer)
    block_chain.unlink(_block_lists(transformer))


def _block_lists(transformer: torch.nn.Module) -> list:
    """The transformer's double and single blocks, each list in the order its forward runs them."""
    return [getattr(transformer, name, None) or [] for name in ("transformer_blocks", "single_transformer_blocks")]
