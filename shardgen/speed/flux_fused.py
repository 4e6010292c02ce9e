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
rounding where eager rounds), each gated residual in one ``addcmul``, and the single block's second ``proj_out``
GEMM accumulating into the first's output. Off CUDA every op is eager diffusers' own.

``enable(transformer)`` swaps the attention processors and returns the block forwards that
``shardgen.speed.accel.compile_blocks`` compiles instead of the blocks' own; ``disable`` restores them. Only
plain ``FluxTransformer2DModel`` blocks with diffusers' own ``FluxAttnProcessor``, the native attention
backend and no context/tensor-parallel config are touched; anything else keeps the stock forward.
"""

from __future__ import annotations

import logging
import math
import types
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("shardgen.flux_fused")

_ORIG_PROCESSOR = "_shardgen_orig_processor"
COMPILED = True
"""Compiled blocks compile these forwards too (inductor leaves the three patterns above slow)."""
EAGER_DEVICES = ("cuda",)
"""Where the eager-only fusions run (elsewhere the stock ops keep eager diffusers' exact bytes)."""

try:  # Triton ships with CUDA builds of torch; CPU builds have none (the torch path runs there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = tl = None


# --- RMSNorm + RoPE into the attention layout -----------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, seq_in, seq_out, seq_offset, heads,
                         stride_xb, stride_xs, stride_xh, eps,
                         BLOCK_S: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, D: tl.constexpr):
        # one program: BLOCK_S tokens x HEADS_PER_PROGRAM heads x D; each token's heads are contiguous
        # in the GEMM output, so the loads are wide; cos/sin are read once for all of its heads
        pid_s, pid_h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        h = pid_h * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        d = tl.arange(0, D)
        s3, h3, d3 = s[:, None, None], h[None, :, None], d[None, None, :]
        mask = s3 < seq_in
        src = x_ptr + b.to(tl.int64) * stride_xb + s3.to(tl.int64) * stride_xs + h3 * stride_xh + d3
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=2) / D + eps)
        w = tl.load(w_ptr + d).to(tl.float32)
        # eager rounds RMSNorm's output (weight applied) to the input dtype before RoPE
        y = (x * rstd[:, :, None] * w[None, None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
        y_even, y_odd = tl.split(tl.reshape(y, (BLOCK_S, HEADS_PER_PROGRAM, D // 2, 2)))
        pos = seq_offset + s
        cs_mask = (s < seq_in)[:, None]
        cs_off = pos[:, None] * D + d[None, :]
        c_even, c_odd = tl.split(tl.reshape(tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0), (BLOCK_S, D // 2, 2)))
        s_even, s_odd = tl.split(tl.reshape(tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0), (BLOCK_S, D // 2, 2)))
        # x * cos + stack([-x_odd, x_even]) * sin, pair by pair
        out_even = y_even * c_even[:, None, :] - y_odd * s_even[:, None, :]
        out_odd = y_odd * c_odd[:, None, :] + y_even * s_odd[:, None, :]
        out = tl.reshape(tl.join(out_even, out_odd), (BLOCK_S, HEADS_PER_PROGRAM, D))
        dst = out_ptr + ((b.to(tl.int64) * heads + h3) * seq_out + (seq_offset + s3).to(tl.int64)) * D + d3
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_rope_reference(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """What eager diffusers computes: RMSNorm per part, the parts joined along the sequence, RoPE,
    then the (batch, heads, tokens, head_dim) layout (a contiguous tensor)."""
    from diffusers.models.embeddings import apply_rotary_emb

    normed = [F.rms_norm(x, (x.shape[-1],), w, eps) for x, w in zip(xs, weights)]
    joint = torch.cat(normed, dim=1) if len(normed) > 1 else normed[0]
    return apply_rotary_emb(joint, (cos, sin), sequence_dim=1).transpose(1, 2).contiguous()


def _kernel_ok(xs: list[torch.Tensor], cos: torch.Tensor) -> bool:
    x0 = xs[0]
    return (triton is not None and x0.is_cuda and x0.dtype in (torch.bfloat16, torch.float16)
            and x0.shape[-1] in (64, 128, 256) and cos.dtype == torch.float32 and cos.is_contiguous()
            and all(x.stride(-1) == 1 and x.dtype == x0.dtype for x in xs))


@torch.library.custom_op("shardgen::flux_rms_rope", mutates_args=())
def rms_rope(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             eps: float) -> torch.Tensor:
    """RMSNorm each (batch, tokens_i, heads, head_dim) part with its weight, join the parts along the
    tokens, apply FLUX's RoPE (``cos``/``sin``: (tokens, head_dim) float32) and return the result as a
    contiguous (batch, heads, tokens, head_dim) tensor: eager diffusers' numerics, one pass on CUDA."""
    if not _kernel_ok(xs, cos):
        return rms_rope_reference(xs, weights, cos, sin, eps)
    return rms_rope_triton(xs, weights, cos, sin, eps)


def rms_rope_triton(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """``rms_rope`` by the Triton kernel (no checks: ``rms_rope`` decides when it applies)."""
    b, _, heads, dim = xs[0].shape
    total = sum(x.shape[1] for x in xs)
    out = torch.empty(b, heads, total, dim, device=xs[0].device, dtype=xs[0].dtype)
    per_program = math.gcd(heads, 8)  # a power of two that divides the head count
    offset, block = 0, 8
    for x, w in zip(xs, weights):
        seq = x.shape[1]
        grid = (triton.cdiv(seq, block), heads // per_program, b)
        _rms_rope_kernel[grid](x, w.contiguous(), cos, sin.contiguous(), out, seq, total, offset, heads,
                               x.stride(0), x.stride(1), x.stride(2), eps,
                               BLOCK_S=block, HEADS_PER_PROGRAM=per_program, D=dim, num_warps=8)
        offset += seq
    return out


@rms_rope.register_fake
def _(xs, weights, cos, sin, eps):
    b, _, heads, dim = xs[0].shape
    return xs[0].new_empty(b, heads, sum(x.shape[1] for x in xs), dim)


# --- LayerNorm + modulation, gated residuals (eagerly; FLUX.2 and Qwen-Image use them too) -------------------

def triton_ok(*xs: torch.Tensor) -> bool:
    """Whether the elementwise Triton kernels take these tensors: CUDA, bf16/fp16, unit stride in the last dim."""
    return (triton is not None and all(x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) for x in xs)
            and all(x.stride(-1) == 1 for x in xs))


if triton is not None:

    @triton.jit
    def _ln_modulate_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, rows_per_batch, dim, stride_x, stride_mod, eps,
                            BLOCK_D: tl.constexpr):
        # one program per token row; the modulation row is its batch sample's
        row = tl.program_id(0).to(tl.int64)
        b = row // rows_per_batch
        d = tl.arange(0, BLOCK_D)
        mask = d < dim
        x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / dim
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / dim + eps)
        dtype = out_ptr.dtype.element_ty
        # eager rounds the norm, 1 + scale and the product to the activation dtype before the next op
        y = (xc * rstd).to(dtype).to(tl.float32)
        scale = tl.load(scale_ptr + b * stride_mod + d, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + b * stride_mod + d, mask=mask, other=0.0).to(tl.float32)
        y = ((1.0 + scale).to(dtype).to(tl.float32) * y).to(dtype).to(tl.float32) + shift
        tl.store(out_ptr + row * dim + d, y.to(dtype), mask=mask)


def ln_modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """What eager diffusers computes: ``(1 + scale) * LayerNorm(x) + shift`` (no affine LayerNorm)."""
    return (1 + scale) * F.layer_norm(x, (x.shape[-1],), eps=eps) + shift


@torch.library.custom_op("shardgen::ln_modulate", mutates_args=())
def ln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + scale) * LayerNorm(x) + shift`` for ``x`` (batch, tokens, dim) and ``shift``/``scale`` (batch, 1,
    dim): one pass on CUDA, eager diffusers' ops elsewhere. An opaque op, so a compiler keeps the one pass."""
    if not (triton_ok(x, shift, scale) and x.dim() == 3 and shift.shape == scale.shape == (x.shape[0], 1, x.shape[2])
            and shift.stride(0) == scale.stride(0) and x.is_contiguous()):
        return ln_modulate_reference(x, shift, scale, eps)
    b, tokens, dim = x.shape
    out = torch.empty_like(x)
    _ln_modulate_kernel[(b * tokens,)](x, shift, scale, out, tokens, dim, x.stride(1), shift.stride(0), eps,
                                       BLOCK_D=triton.next_power_of_2(dim), num_warps=8)
    return out


@ln_modulate.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y``: one pass (``addcmul``) on CUDA, eager's two ops elsewhere (their exact bytes)."""
    if x.is_cuda:
        return torch.addcmul(x, gate, y)
    return x + gate * y


# --- linear + tanh-GELU in the GEMM epilogue -----------------------------------------------------------

@torch.library.custom_op("shardgen::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x @ weight.T + bias, approximate="tanh")``; on CUDA in one cuBLASLt call (the GELU
    applied to the fp32 accumulator). An opaque op, so inductor cannot split it again."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    else:
        out = F.gelu(F.linear(x2, weight, bias), approximate="tanh")
    return out.reshape(*x.shape[:-1], weight.shape[0])


@linear_gelu_tanh.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _gelu_up(proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(proj) is torch.nn.Linear and proj.bias is not None:
        return linear_gelu_tanh(x, proj.weight, proj.bias)
    return F.gelu(proj(x), approximate="tanh")  # e.g. fp8=true's Float8Linear


# --- the attention processor ------------------------------------------------------------------------

def norm_eps(norm: torch.nn.Module, dtype: torch.dtype) -> float:
    """The epsilon an RMSNorm module uses (torch's default, the dtype's eps, when it has none)."""
    eps = getattr(norm, "eps", None)
    return float(eps) if eps is not None else float(torch.finfo(dtype).eps)


def norm_weight(norm: torch.nn.Module, like: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's weight, or ones when it has none (``elementwise_affine=False``)."""
    w = getattr(norm, "weight", None)
    return w if w is not None else torch.ones(like.shape[-1], device=like.device, dtype=like.dtype)


def one_eps(attn) -> bool:
    """True when all q/k norms of ``attn`` share one epsilon (``rms_rope`` takes one per tensor)."""
    norms = [getattr(attn, n, None) for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    return len({getattr(n, "eps", None) for n in norms if n is not None}) == 1


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
        eps = norm_eps(attn.norm_q, q.dtype)
        query = rms_rope(qs, wq, cos, sin, eps)
        key = rms_rope(ks, wk, cos, sin, eps)
        value = (torch.cat(vs, dim=1) if joint else v).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, key, value)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text = encoder_hidden_states.shape[1]
        encoder_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(encoder_out.contiguous())


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
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    if split and _eager_fusable(hidden_states, self.norm) and type(self.proj_out) is torch.nn.Linear:
        hidden_states = _single_block_eager(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = _gelu_up(self.proj_mlp, norm_hidden_states)
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
    text, image = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    if torch.compiler.is_compiling():
        # the first single block gets the double blocks' contiguous outputs, the others these views (batch
        # stride text + image tokens): dynamo's stride guards made that two graphs of this block, each compiled
        # from scratch on a fresh cache. Contiguous halves keep one graph; inductor can write them from the
        # residual's kernel. Eagerly the views stay (a copy there would cost a pass over the activations each).
        text, image = text.contiguous(), image.contiguous()
    return text, image


def _single_block_eager(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs):
    """The single block's body eagerly on CUDA: LayerNorm + modulation in one pass, ``proj_out``'s second GEMM
    accumulating into the first's output (no sum pass), the gated residual in one ``addcmul``."""
    normed, (gate,) = _ada_norm(self.norm, hidden_states, temb, 3)
    mlp_hidden_states = _gelu_up(self.proj_mlp, normed)
    attn_output = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    dim, w = attn_output.shape[-1], self.proj_out.weight
    proj = F.linear(attn_output, w[:, :dim], self.proj_out.bias)
    proj.view(-1, proj.shape[-1]).addmm_(mlp_hidden_states.reshape(-1, mlp_hidden_states.shape[-1]), w[:, dim:].t())
    hidden_states = gated(hidden_states, gate[:, None], proj)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states


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


def _ada_norm(norm: torch.nn.Module, x: torch.Tensor, temb: torch.Tensor, chunks: int):
    """diffusers' ``AdaLayerNormZero`` (``chunks=6``) or ``AdaLayerNormZeroSingle`` (3) with its LayerNorm and
    modulation in one pass: (the modulated ``x``, the other modulation tensors)."""
    mods = norm.linear(norm.silu(temb)).chunk(chunks, dim=1)
    return ln_modulate(x, mods[0][:, None], mods[1][:, None], norm.norm.eps), mods[2:]


def _compiled_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A single block's arguments as the compiled blocks pass them (contiguous halves, above), for a background
    compilation that captured them from the eager blocks' views (``background.DeferredForward``)."""
    def contiguous(v):
        return v.contiguous() if isinstance(v, torch.Tensor) else v
    return tuple(contiguous(a) for a in args), {k: contiguous(v) for k, v in kwargs.items()}


single_block_forward.compiled_args = _compiled_args
single_block_forward_cat.compiled_args = _compiled_args


def gelu_feed_forward(ff: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' FeedForward (GELU(tanh) -> dropout -> Linear) with the GELU in the epilogue."""
    first = ff.net[0]
    if type(first).__name__ == "GELU" and getattr(first, "approximate", None) == "tanh":
        x = _gelu_up(first.proj, x)
        for layer in ff.net[1:]:
            x = layer(x)
        return x
    return ff(x)


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
    ``addcmul`` (compiled, inductor fuses the same passes: ``double_block_forward``'s torch ops)."""
    normed, (gate_msa, shift_mlp, scale_mlp, gate_mlp) = _ada_norm(self.norm1, hidden_states, temb, 6)
    c_normed, (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp) = _ada_norm(self.norm1_context,
                                                                             encoder_hidden_states, temb, 6)
    attention_outputs = self.attn(hidden_states=normed, encoder_hidden_states=c_normed,
                                  image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    attn_output, context_attn_output = attention_outputs[:2]
    hidden_states = gated(hidden_states, gate_msa[:, None], attn_output)
    ff = gelu_feed_forward(self.ff, ln_modulate(hidden_states, shift_mlp[:, None], scale_mlp[:, None],
                                                self.norm2.eps))
    hidden_states = gated(hidden_states, gate_mlp[:, None], ff)
    if len(attention_outputs) == 3:
        hidden_states = hidden_states + attention_outputs[2]
    encoder_hidden_states = gated(encoder_hidden_states, c_gate_msa[:, None], context_attn_output)
    ff = gelu_feed_forward(self.ff_context, ln_modulate(encoder_hidden_states, c_shift_mlp[:, None],
                                                        c_scale_mlp[:, None], self.norm2_context.eps))
    encoder_hidden_states = gated(encoder_hidden_states, c_gate_mlp[:, None], ff)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


_FORWARDS = {"FluxSingleTransformerBlock": single_block_forward, "FluxTransformerBlock": double_block_forward}


# --- switching it on and off ---------------------------------------------------------------------------

def processor_problem(transformer: torch.nn.Module, stock: tuple[str, ...], fused: tuple[type, ...]) -> str | None:
    """Why the attention processors of ``transformer`` cannot be swapped for fused ones (None: they can): weights
    that are DTensors (tensor parallel: the sharded linears all-reduce in their own forward, which direct weight
    use would skip), a processor not among diffusers' ``stock`` ones (nor already one of ``fused``), an attention
    backend or parallel config, fused QKV projections."""
    if any(type(p).__name__ == "DTensor" for p in transformer.parameters()):
        return "its weights are DTensors (tensor parallel)"
    for name, mod in transformer.named_modules():
        proc = getattr(mod, "processor", None)
        if proc is None or isinstance(proc, fused):
            continue
        if type(proc).__name__ not in stock:
            return f"{name} uses {type(proc).__name__}"
        if proc._attention_backend is not None or proc._parallel_config is not None:
            return f"{name} has an attention backend or a parallel config (context/tensor parallel)"
        if getattr(mod, "fused_projections", False):
            return f"{name} has fused QKV projections"
    return None


def swap_processors(transformer: torch.nn.Module, fused: dict[str, type]) -> None:
    """Each stock processor named in ``fused`` (class name -> fused class) replaced by its fused one, which keeps
    it to fall back on; ``restore_processors`` puts them back."""
    for mod in transformer.modules():
        proc = getattr(mod, "processor", None)
        if proc is not None and type(proc).__name__ in fused:
            mod.__dict__[_ORIG_PROCESSOR] = proc
            mod.processor = fused[type(proc).__name__](proc)


def restore_processors(transformer: torch.nn.Module) -> None:
    """diffusers' own processors back where ``swap_processors`` replaced them."""
    for mod in transformer.modules():
        if _ORIG_PROCESSOR in mod.__dict__:
            mod.processor = mod.__dict__.pop(_ORIG_PROCESSOR)


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
    return forwards


def disable(transformer: torch.nn.Module) -> None:
    """Put diffusers' own processors back (the compiler restores the forwards)."""
    restore_processors(transformer)
