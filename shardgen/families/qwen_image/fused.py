"""Fused Qwen-Image blocks for the eager path: the memory-bound work between the matmuls in fewer passes.

Compiled, inductor fuses Qwen-Image's elementwise chains itself; eagerly (``compile=false``, a ``compile: auto``
process that stays eager or has not switched yet) each is a string of separate passes over (batch, 4096, 3072)
activations and the 12288-wide MLP. The fused block forward does the same arithmetic in fewer passes, with the
kernels of the FLUX blocks (shardgen/speed/fused_kernels.py):

- **LayerNorm + modulation** (``LayerNorm(x) * (1 + scale) + shift``) in one pass, rounding where eager does;
- **gated residuals** (``x + gate * y``) in one pass (``fused_kernels.gated``), and in bf16 the same pass computes
  the LayerNorm + modulation that reads the result: the MLP's norm, and the next block's first norms, handed to it
  (``shardgen/speed/block_chain.py``);
- **the MLP's tanh-GELU** in the up-projection's GEMM epilogue;
- **q/k RMSNorm + RoPE + the attention layout** in one pass per tensor (``fused_qk``, called by Qwen's prefix
  attention processor, shardgen/families/qwen_image/speed.py, while the RoPE frequencies are diffusers' complex ones; compiled
  blocks take real frequencies and keep their own path).

Off CUDA every op runs eager diffusers' torch ops. Blocks called with ``modulate_index`` or made with
``zero_cond_t`` (the edit models' per-token modulation) run diffusers' forward.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardgen.speed import block_chain, fused_kernels
from shardgen.speed.fp8 import is_tensor_parallel
from shardgen.speed.fused_kernels import (ff_input_layers, gated, gated_ln_modulate_for, gelu_feed_forward,
                                         layer_norm_problem, ln_modulate, norm_eps, norm_weight, one_eps, rms_rope)

log = logging.getLogger("shardgen.qwen_fused")

COMPILED = False
"""Compiled blocks compile diffusers' own forwards: inductor fuses these passes itself."""


def _mod(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shift, scale, gate) of one modulation, each (batch, 1, dim), as diffusers' ``_modulate`` splits them."""
    return tuple(p.unsqueeze(1) for p in params.chunk(3, dim=-1))


def block_forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                  image_rotary_emb=None, joint_attention_kwargs=None, modulate_index=None):
    """``QwenImageTransformerBlock.forward`` with fused LayerNorm+modulation, gated residuals and GELU; in bf16 each
    gated residual in one pass with the norm that reads it: the MLP's, and the next block's first norms, which it
    hands over (``shardgen/speed/block_chain.py``)."""
    if modulate_index is not None or getattr(self, "zero_cond_t", False):
        return type(self).forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                                  image_rotary_emb, joint_attention_kwargs, modulate_index)
    call = (encoder_hidden_states_mask, temb, image_rotary_emb, joint_attention_kwargs)
    eps = self.img_norm1.eps
    pre = block_chain.take_over(self, (encoder_hidden_states, hidden_states), call)
    if pre is None:
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        (shift, scale, gate), (c_shift, c_scale, c_gate) = _mod(img_mod1), _mod(txt_mod1)
        pre = ((ln_modulate(hidden_states, shift, scale, eps), gate, img_mod2),
               (ln_modulate(encoder_hidden_states, c_shift, c_scale, eps), c_gate, txt_mod2))
    (normed, gate, img_mod2), (c_normed, c_gate, txt_mod2) = pre
    img_attn, txt_attn = self.attn(hidden_states=normed, encoder_hidden_states=c_normed,
                                   encoder_hidden_states_mask=encoder_hidden_states_mask,
                                   image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    nxt = _successor(self, hidden_states)
    hidden_states, handed = _stream_end(hidden_states, img_attn, gate, img_mod2, self.img_mlp, eps, temb,
                                        None if nxt is None else (nxt.img_mod, nxt.img_norm1.eps))
    encoder_hidden_states, c_handed = _stream_end(encoder_hidden_states, txt_attn, c_gate, txt_mod2, self.txt_mlp, eps,
                                                  temb, None if nxt is None else (nxt.txt_mod, nxt.img_norm1.eps))
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if nxt is not None:
        block_chain.hand_over(nxt, (encoder_hidden_states, hidden_states), call, (handed, c_handed))
    return encoder_hidden_states, hidden_states


def _stream_end(x: torch.Tensor, attn_out: torch.Tensor, gate: torch.Tensor, mod2: torch.Tensor,
                mlp_module: torch.nn.Module, eps: float, temb: torch.Tensor, next_mod: tuple | None):
    """One stream's second half: the attention's gated residual in one pass with the MLP's norm, the MLP, and its
    gated residual: (the stream, None); with ``next_mod`` (the next block's modulation layer of this stream and its
    norms' eps) the last residual in one pass with the next block's first norm: (the stream, (that norm, its gate,
    its second modulation)), what ``block_forward`` takes over."""
    shift, scale, gate2 = _mod(mod2)
    x, normed = gated_ln_modulate_for(ff_input_layers(mlp_module), x, gate, attn_out, shift, scale, eps)
    mlp = gelu_feed_forward(mlp_module, normed)
    if next_mod is None:
        return gated(x, gate2, mlp), None
    layer, next_eps = next_mod
    mod1, next_mod2 = layer(temb).chunk(2, dim=-1)
    shift, scale, next_gate = _mod(mod1)
    x, normed = gated_ln_modulate_for([], x, gate2, mlp, shift, scale, next_eps)
    return x, (normed, next_gate, next_mod2)


def _successor(block: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module | None:
    """The next block when it will take its first norms from this one (``block_chain``): bf16 (fp16 clips between the
    residual and the norm), eager, and a block of the modulation this forward computes (not the edit models')."""
    if torch.compiler.is_compiling() or x.dtype != torch.bfloat16:
        return None
    nxt = block_chain.successor(block, (block_forward,))
    return None if nxt is None or getattr(nxt, "zero_cond_t", False) else nxt


# --- q/k RMSNorm + RoPE ------------------------------------------------------------------------------------

def _cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's complex (tokens, head_dim/2) frequencies as FLUX-style interleaved (tokens, head_dim) cos and sin:
    the rotation of each consecutive channel pair (the complex number Qwen's RoPE multiplies)."""
    return (freqs.real.float().repeat_interleave(2, dim=-1).contiguous(),
            freqs.imag.float().repeat_interleave(2, dim=-1).contiguous())


def fused_qk_applies(attn, image_rotary_emb, query: torch.Tensor) -> bool:
    """Whether ``fused_qk`` can stand for the processor's norms and RoPE: CUDA, complex frequencies (the eager
    path), every q/k norm present with one epsilon."""
    if not query.is_cuda or image_rotary_emb is None:
        return False
    img_freqs, txt_freqs = image_rotary_emb
    norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    return (isinstance(img_freqs, torch.Tensor) and img_freqs.is_complex() and txt_freqs.is_complex()
            and all(n is not None for n in norms) and one_eps(attn))


_TABLES = WeakIdKeyDictionary()  # image freqs -> (their version, text freqs, the four joint tables)


def _joint_tables(img_freqs: torch.Tensor, txt_freqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(query cos, query sin) over [text, image] and (key cos, key sin) over [image, text]. Every block of a
    transformer call gets the same frequency tensors, so the tables are made once per call, not once per block."""
    hit = _TABLES.get(img_freqs)
    if hit is None or hit[0] != img_freqs._version or hit[1] is not txt_freqs:
        (img_cos, img_sin), (txt_cos, txt_sin) = _cos_sin(img_freqs), _cos_sin(txt_freqs)
        hit = _TABLES[img_freqs] = (img_freqs._version, txt_freqs,
                                    torch.cat([txt_cos, img_cos]), torch.cat([txt_sin, img_sin]),
                                    torch.cat([img_cos, txt_cos]), torch.cat([img_sin, txt_sin]))
    return hit[2:]


def fused_qk(attn, img_q, img_k, txt_q, txt_k, image_rotary_emb) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's q/k RMSNorm and RoPE in one op per tensor: queries ordered [text, image], keys [image,
    text] (prefix attention's order), each (batch, heads, tokens, head_dim): contiguous, or a view of (batch, tokens,
    heads, head_dim) memory with ``fused_kernels.SDPA_TOKENS_MAJOR`` (``fused_qk_applies`` first)."""
    q_cos, q_sin, k_cos, k_sin = _joint_tables(*image_rotary_emb)
    eps, tokens_major = norm_eps(attn.norm_q, img_q.dtype), fused_kernels.SDPA_TOKENS_MAJOR
    query = rms_rope([txt_q, img_q], [norm_weight(attn.norm_added_q, txt_q), norm_weight(attn.norm_q, img_q)],
                     q_cos, q_sin, eps, tokens_major)
    key = rms_rope([img_k, txt_k], [norm_weight(attn.norm_k, img_k), norm_weight(attn.norm_added_k, txt_k)],
                   k_cos, k_sin, eps, tokens_major)
    return query, key


# --- switching it on and off -------------------------------------------------------------------------------

def applicable(transformer: torch.nn.Module) -> str | None:
    """None when the fused block forwards can replace this transformer's, else why not."""
    if type(transformer).__name__ != "QwenImageTransformer2DModel":
        return f"{type(transformer).__name__} is not QwenImageTransformer2DModel"
    if is_tensor_parallel(transformer):
        return "it is sharded for tensor parallelism"
    return layer_norm_problem(transformer)


def enable(transformer: torch.nn.Module) -> dict[torch.nn.Module, Any]:
    """{block: fused forward (bound)}; empty when ``applicable`` says no. The attention processors are Qwen's
    speed hooks' (shardgen/families/qwen_image/speed.py), not touched here."""
    why = applicable(transformer)
    if why is not None:
        log.info("fused Qwen-Image blocks not used: %s", why)
        return {}
    block_chain.link([transformer.transformer_blocks])
    return {mod: types.MethodType(block_forward, mod) for mod in transformer.modules()
            if type(mod).__name__ == "QwenImageTransformerBlock"}


def disable(transformer: torch.nn.Module) -> None:
    """Unlink the blocks (the caller restores the forwards)."""
    block_chain.unlink([transformer.transformer_blocks])
