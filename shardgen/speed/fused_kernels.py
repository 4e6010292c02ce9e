"""Fused kernels shared by the model families' fused blocks (shardgen/families/<family>/fused.py): the
memory-bound work around the matmuls done in fewer passes, and swapping diffusers' attention processors for fused
ones and back.

- ``rms_rope``: q/k RMSNorm + RoPE written straight into SDPA's (batch, heads, tokens, head_dim) layout, one Triton
  pass per tile on CUDA, eager diffusers' ops elsewhere (``rms_rope_reference``). ``rope_attention``: that and SDPA,
  or the routed 8-bit kernel's own passes from the projections where it has them.
- ``ln_modulate``, ``gated``: adaLN's LayerNorm + modulation in one pass, a gated residual in one pass;
  ``gated_ln_modulate_for``: a gated residual and the LayerNorm + modulation of its result in one pass.
- ``linear_gelu_tanh``, ``gelu_feed_forward``: the tanh-GELU computed in cuBLASLt's GEMM epilogue.
- ``processor_problem``, ``swap_processors``, ``restore_processors``, ``layer_norm_problem``: when the fused
  processors may stand in for diffusers' own, and the swap itself.

Nothing here knows a model: a family's fused blocks call these with its own modules. The custom ops keep their
registered names (``shardgen::flux_rms_rope`` ...), which compiled graphs and caches refer to.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardgen.speed.fp8 import Float8Linear, Fp8Rows, gelu_rows, is_tensor_parallel, quantize_rows
from shardgen.speed.sdpa_route import parts_attention

_ORIG_PROCESSOR = "_shardgen_orig_processor"

try:  # Triton ships with CUDA builds of torch; CPU builds have none (the torch path runs there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = tl = None


# --- RMSNorm + RoPE into the attention layout -----------------------------------------------------------

if triton is not None:

    @triton.jit
    def rms_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, b, s, h, seq_in, seq_offset, stride_xb, stride_xs, stride_xh,
                      eps, BLOCK_S: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, D: tl.constexpr,
                      ROPE: tl.constexpr):
        """Tokens ``s`` x heads ``h`` x D of one sample ``b`` of x (strided (batch, tokens, heads, D)) in float32,
        RMSNorm-ed and RoPE-d (``ROPE``; else as they are), and the tile's (tokens, 1, 1) mask of live tokens."""
        d = tl.arange(0, D)
        s3, h3, d3 = s[:, None, None], h[None, :, None], d[None, None, :]
        mask = s3 < seq_in
        src = x_ptr + b.to(tl.int64) * stride_xb + s3.to(tl.int64) * stride_xs + h3 * stride_xh + d3
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        if ROPE:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=2) / D + eps)
            w = tl.load(w_ptr + d).to(tl.float32)
            # eager rounds RMSNorm's output (weight applied) to the input dtype before RoPE
            y = (x * rstd[:, :, None] * w[None, None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
            y_even, y_odd = tl.split(tl.reshape(y, (BLOCK_S, HEADS_PER_PROGRAM, D // 2, 2)))
            pos = seq_offset + s
            cs_mask = (s < seq_in)[:, None]
            cs_off = pos[:, None] * D + d[None, :]
            c_even, c_odd = tl.split(tl.reshape(tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0),
                                                (BLOCK_S, D // 2, 2)))
            s_even, s_odd = tl.split(tl.reshape(tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0),
                                                (BLOCK_S, D // 2, 2)))
            # x * cos + stack([-x_odd, x_even]) * sin, pair by pair
            out_even = y_even * c_even[:, None, :] - y_odd * s_even[:, None, :]
            out_odd = y_odd * c_odd[:, None, :] + y_even * s_odd[:, None, :]
            x = tl.reshape(tl.join(out_even, out_odd), (BLOCK_S, HEADS_PER_PROGRAM, D))
        return x, mask

    @triton.jit
    def _rms_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, seq_in, seq_out, seq_offset, heads,
                         stride_xb, stride_xs, stride_xh, eps,
                         BLOCK_S: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, D: tl.constexpr,
                         TOKENS_MAJOR: tl.constexpr):
        # one program: BLOCK_S tokens x HEADS_PER_PROGRAM heads x D; each token's heads are contiguous
        # in the GEMM output, so the loads are wide; cos/sin are read once for all of its heads
        pid_s, pid_h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        h = pid_h * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        out, mask = rms_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, b, s, h, seq_in, seq_offset, stride_xb, stride_xs,
                                  stride_xh, eps, BLOCK_S, HEADS_PER_PROGRAM, D, True)
        s3, h3, d3 = s[:, None, None], h[None, :, None], tl.arange(0, D)[None, None, :]
        if TOKENS_MAJOR:  # (batch, tokens, heads, D) memory
            dst = out_ptr + ((b.to(tl.int64) * seq_out + seq_offset + s3) * heads + h3) * D + d3
        else:  # (batch, heads, tokens, D) memory
            dst = out_ptr + ((b.to(tl.int64) * heads + h3) * seq_out + (seq_offset + s3).to(tl.int64)) * D + d3
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_rope_reference(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                       eps: float, tokens_major: bool = False) -> torch.Tensor:
    """What eager diffusers computes: RMSNorm per part, the parts joined along the sequence, RoPE,
    then the (batch, heads, tokens, head_dim) layout (a contiguous tensor; ``tokens_major``: a view of a contiguous
    (batch, tokens, heads, head_dim) one, the layout diffusers hands SDPA)."""
    from diffusers.models.embeddings import apply_rotary_emb

    normed = [F.rms_norm(x, (x.shape[-1],), w, eps) for x, w in zip(xs, weights)]
    joint = torch.cat(normed, dim=1) if len(normed) > 1 else normed[0]
    out = apply_rotary_emb(joint, (cos, sin), sequence_dim=1)
    return out.contiguous().transpose(1, 2) if tokens_major else out.transpose(1, 2).contiguous()


def rms_rope_kernel_ok(xs: list[torch.Tensor], cos: torch.Tensor) -> bool:
    """Whether the Triton kernel (``rms_rope_tile``) takes these (batch, tokens, heads, head_dim) parts and cos."""
    x0 = xs[0]
    return (triton is not None and x0.is_cuda and x0.dtype in (torch.bfloat16, torch.float16)
            and x0.shape[-1] in (64, 128, 256) and cos.dtype == torch.float32 and cos.is_contiguous()
            and all(x.stride(-1) == 1 and x.dtype == x0.dtype for x in xs))


@torch.library.custom_op("shardgen::flux_rms_rope", mutates_args=())
def rms_rope(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             eps: float, tokens_major: bool = False) -> torch.Tensor:
    """RMSNorm each (batch, tokens_i, heads, head_dim) part with its weight, join the parts along the
    tokens, apply FLUX's RoPE (``cos``/``sin``: (tokens, head_dim) float32) and return the result as a
    contiguous (batch, heads, tokens, head_dim) tensor, or with ``tokens_major`` as that view of a contiguous
    (batch, tokens, heads, head_dim) one: eager diffusers' numerics, one pass on CUDA."""
    if not rms_rope_kernel_ok(xs, cos):
        return rms_rope_reference(xs, weights, cos, sin, eps, tokens_major)
    return rms_rope_triton(xs, weights, cos, sin, eps, tokens_major)


def rms_rope_triton(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                    eps: float, tokens_major: bool = False) -> torch.Tensor:
    """``rms_rope`` by the Triton kernel (no checks: ``rms_rope`` decides when it applies)."""
    b, _, heads, dim = xs[0].shape
    total = sum(x.shape[1] for x in xs)
    shape = (b, total, heads, dim) if tokens_major else (b, heads, total, dim)
    out = torch.empty(shape, device=xs[0].device, dtype=xs[0].dtype)
    per_program = math.gcd(heads, 8)  # a power of two that divides the head count
    offset, block = 0, 8
    for x, w in zip(xs, weights):
        seq = x.shape[1]
        grid = (triton.cdiv(seq, block), heads // per_program, b)
        _rms_rope_kernel[grid](x, w.contiguous(), cos, sin.contiguous(), out, seq, total, offset, heads,
                               x.stride(0), x.stride(1), x.stride(2), eps,
                               BLOCK_S=block, HEADS_PER_PROGRAM=per_program, D=dim, TOKENS_MAJOR=tokens_major,
                               num_warps=8)
        offset += seq
    return out.transpose(1, 2) if tokens_major else out


@rms_rope.register_fake
def _(xs, weights, cos, sin, eps, tokens_major=False):
    b, _, heads, dim = xs[0].shape
    total = sum(x.shape[1] for x in xs)
    if tokens_major:
        return xs[0].new_empty(b, total, heads, dim).transpose(1, 2)
    return xs[0].new_empty(b, heads, total, dim)


SDPA_TOKENS_MAJOR = True
"""``rope_attention`` (FLUX.1, FLUX.2) and Qwen-Image's ``fused_qk`` hand SDPA queries and keys in (batch, tokens,
heads, head_dim) memory (as diffusers does, and as their values already are) instead of (batch, heads, tokens,
head_dim). cuDNN's attention writes its output in the queries' layout, so the blocks' (batch, tokens, heads *
head_dim) view of it is free instead of a copy that took ~11 ms of a FLUX.1-dev fp8 call at batch 4 on an H100 (58
copies at ~1.2 TB/s), and the blocks' output is the same (tests/test_gpu.py::
test_tokens_major_queries_give_a_tokens_major_attention_output_and_the_same_blocks; the call with and without:
``benchmarks/probe_fp8_step.py --tokens-major``)."""


def rope_attention(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], wq: list[torch.Tensor],
                   wk: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """SDPA over the joint sequence of the projections' parts (each (batch, tokens_i, heads, head_dim), text first),
    q and k by ``rms_rope``: (batch, tokens, heads * head_dim). Where a routed 8-bit kernel takes the parts
    themselves (``sdpa_route.parts_attention``: fa3_fp8 normalises, rotates and quantises the queries in one pass,
    never writing them in bf16) it gets them."""
    direct = parts_attention(qs, ks, vs, cos)
    if direct is not None:
        return direct(qs, ks, vs, wq, wk, cos, sin, eps).flatten(2, 3)
    query = rms_rope(qs, wq, cos, sin, eps, SDPA_TOKENS_MAJOR)
    key = rms_rope(ks, wk, cos, sin, eps, SDPA_TOKENS_MAJOR)
    value = (torch.cat(vs, dim=1) if len(vs) > 1 else vs[0]).transpose(1, 2)
    out = F.scaled_dot_product_attention(query, key, value)
    return out.transpose(1, 2).flatten(2, 3).to(query.dtype)


def for_layer(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A slice of an attention output (its text or image tokens: a strided view) as ``layer`` takes it: as it is for
    fp8=true's ``Float8Linear`` (its quantising pass reads the rows where they are), else a contiguous copy."""
    return x if isinstance(layer, Float8Linear) else x.contiguous()


# --- LayerNorm + modulation, gated residuals (eagerly; FLUX.2 and Qwen-Image use them too) -------------------

def triton_ok(*xs: torch.Tensor) -> bool:
    """Whether the elementwise Triton kernels take these tensors: CUDA, bf16/fp16, unit stride in the last dim."""
    return (triton is not None and all(x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) for x in xs)
            and all(x.stride(-1) == 1 for x in xs))


if triton is not None:
    from shardgen.speed.fp8 import to_fp8

    @triton.jit
    def _ln_modulate_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, q_scale_ptr, rows_per_batch, dim, stride_x,
                            stride_mod, eps, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
        # one program per token row; the modulation row is its batch sample's. FP8: the row quantised to float8 on
        # its absolute maximum (fp8.quantize_rows' arithmetic) into OUT, its scale into Q_SCALE
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = d < dim
        x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0).to(tl.float32)
        _ln_modulate_row(x, x_ptr, row, row // rows_per_batch, d, mask, shift_ptr, scale_ptr, out_ptr, q_scale_ptr,
                         dim, stride_mod, eps, FP8)

    @triton.jit
    def _ln_modulate_row(x, dtype_ptr, row, b, d, mask, shift_ptr, scale_ptr, out_ptr, q_scale_ptr, dim, stride_mod,
                         eps, FP8: tl.constexpr):
        # the LayerNorm + modulation of one row X (float32 values of the activation dtype, DTYPE_PTR's), stored
        mean = tl.sum(x, axis=0) / dim
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / dim + eps)
        dtype = dtype_ptr.dtype.element_ty  # the activation dtype (OUT is float8 with FP8)
        # eager rounds the norm, 1 + scale and the product to the activation dtype before the next op
        y = (xc * rstd).to(dtype).to(tl.float32)
        scale = tl.load(scale_ptr + b * stride_mod + d, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + b * stride_mod + d, mask=mask, other=0.0).to(tl.float32)
        y = ((1.0 + scale).to(dtype).to(tl.float32) * y).to(dtype).to(tl.float32) + shift
        if FP8:
            y = tl.where(mask, y.to(dtype).to(tl.float32), 0.0)
            q_scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
            tl.store(q_scale_ptr + row, q_scale)
            tl.store(out_ptr + row * dim + d, to_fp8(y, 1.0 / q_scale, 448.0), mask=mask)
        else:
            tl.store(out_ptr + row * dim + d, y.to(dtype), mask=mask)

    @triton.jit
    def _gated_ln_modulate_kernel(x_ptr, g_ptr, y_ptr, h_ptr, shift_ptr, scale_ptr, out_ptr, q_scale_ptr,
                                  rows_per_batch, dim, stride_gb, stride_mod, eps, BLOCK_D: tl.constexpr,
                                  FP8: tl.constexpr):
        # one program per token row of contiguous x and y: the gated residual (``_gated_kernel``'s arithmetic) into
        # H, then the LayerNorm + modulation of the row just written, from registers (``_ln_modulate_kernel``'s)
        row = tl.program_id(0).to(tl.int64)
        b = row // rows_per_batch
        d = tl.arange(0, BLOCK_D)
        mask = d < dim
        x = tl.load(x_ptr + row * dim + d, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * dim + d, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * stride_gb + d, mask=mask, other=0.0).to(tl.float32)
        h = (x + g * y).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * dim + d, h, mask=mask)
        _ln_modulate_row(tl.where(mask, h.to(tl.float32), 0.0), h_ptr, row, b, d, mask, shift_ptr, scale_ptr,
                         out_ptr, q_scale_ptr, dim, stride_mod, eps, FP8)


LN_WARPS = 4
"""Warps of a LayerNorm + modulation program (one token row) for rows up to 4096 wide (FLUX.1, Qwen-Image). An H100
at 18432 rows of 3072 (benchmarks/probe_quantize_rows.py): to float8 72.5 us at 4 warps, 75.7 at 2, 82.8 at 8, 116.6
at 16; to bf16 85.6 at 4, 88.1 at 8. Wider rows (FLUX.2's 6144) keep 8, not swept at their width."""


def _ln_warps(block_d: int) -> int:
    return LN_WARPS if block_d <= 4096 else 8


def ln_modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """What eager diffusers computes: ``(1 + scale) * LayerNorm(x) + shift`` (no affine LayerNorm)."""
    return (1 + scale) * F.layer_norm(x, (x.shape[-1],), eps=eps) + shift


def _ln_kernel_ok(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``_ln_modulate_kernel`` takes these: contiguous (batch, tokens, dim) ``x``, (batch, 1, dim) modulation
    rows of one batch stride."""
    return (triton_ok(x, shift, scale) and x.dim() == 3 and shift.shape == scale.shape == (x.shape[0], 1, x.shape[2])
            and shift.stride(0) == scale.stride(0) and x.is_contiguous())


@torch.library.custom_op("shardgen::ln_modulate", mutates_args=())
def ln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + scale) * LayerNorm(x) + shift`` for ``x`` (batch, tokens, dim) and ``shift``/``scale`` (batch, 1,
    dim): one pass on CUDA, eager diffusers' ops elsewhere. An opaque op, so a compiler keeps the one pass."""
    if not _ln_kernel_ok(x, shift, scale):
        return ln_modulate_reference(x, shift, scale, eps)
    b, tokens, dim = x.shape
    out = torch.empty_like(x)
    _ln_modulate_kernel[(b * tokens,)](x, shift, scale, out, out, tokens, dim, x.stride(1), shift.stride(0), eps,
                                       BLOCK_D=triton.next_power_of_2(dim), FP8=False,
                                       num_warps=_ln_warps(triton.next_power_of_2(dim)))
    return out


@ln_modulate.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def ln_modulate_for(layers: list[torch.nn.Module], x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                    eps: float) -> torch.Tensor | Fp8Rows:
    """``ln_modulate`` for ``layers`` (every layer that reads the result) to take: when each is fp8=true's
    ``Float8Linear`` (and no compiler traces: inductor fuses the passes itself), the result's float8 rows
    (``fp8.Fp8Rows``: what those layers would quantise it to); eagerly on CUDA from the same pass, its bf16 form
    never written. Else ``ln_modulate``'s tensor."""
    if not _float8_readers(layers) or torch.compiler.is_compiling():
        return ln_modulate(x, shift, scale, eps)
    if not (_ln_kernel_ok(x, shift, scale) and x.dtype == torch.bfloat16):
        normed = ln_modulate(x, shift, scale, eps)
        return Fp8Rows(*quantize_rows(normed.reshape(-1, normed.shape[-1])), tuple(normed.shape[:-1]), normed.dtype)
    b, tokens, dim = x.shape
    data, q_scale = _float8_rows_like(x)
    if b * tokens:
        _ln_modulate_kernel[(b * tokens,)](x, shift, scale, data, q_scale, tokens, dim, x.stride(1), shift.stride(0),
                                           eps, BLOCK_D=triton.next_power_of_2(dim), FP8=True,
                                           num_warps=_ln_warps(triton.next_power_of_2(dim)))
    return Fp8Rows(data, q_scale, (b, tokens), x.dtype)


def _float8_readers(layers: list[torch.nn.Module]) -> bool:
    """Every layer reading a norm's output is fp8=true's ``Float8Linear`` (none: False): the norm may write its
    float8 rows instead of its bf16 output."""
    return bool(layers) and all(isinstance(m, Float8Linear) for m in layers)


def _float8_rows_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty float8 rows of (batch, tokens, dim) ``x`` flattened to (batch * tokens, dim), and their (rows, 1)
    float32 scales: what the norm kernels write with FP8."""
    rows = x.shape[0] * x.shape[1]
    return (torch.empty((rows, x.shape[2]), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((rows, 1), dtype=torch.float32, device=x.device))


def gated_ln_modulate_for(layers: list[torch.nn.Module], x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor,
                          shift: torch.Tensor, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                                     torch.Tensor | Fp8Rows]:
    """``h = gated(x, gate, y)`` and ``ln_modulate_for(layers, h, shift, scale, eps)``: (h, the modulated norm of h).
    Eagerly on CUDA (bf16, the two kernels' conditions) one pass per token row computes both: the LayerNorm reads
    the residual it has just written from registers, not from memory again (a residual stream's read, ~1/4 of the
    two passes' traffic), with the same arithmetic as the two kernels. Elsewhere the two calls."""
    if not (x.dtype == torch.bfloat16 and _gated_kernel_ok(x, gate, y) and _ln_kernel_ok(x, shift, scale)):
        h = gated(x, gate, y)
        return h, ln_modulate_for(layers, h, shift, scale, eps)
    fp8 = _float8_readers(layers)
    b, tokens, dim = x.shape
    h = torch.empty_like(x)
    out, q_scale = _float8_rows_like(x) if fp8 else (torch.empty_like(x),) * 2
    if b * tokens:
        block_d = triton.next_power_of_2(dim)
        _gated_ln_modulate_kernel[(b * tokens,)](x, gate, y, h, shift, scale, out, q_scale, tokens, dim,
                                                 gate.stride(0), shift.stride(0), eps, BLOCK_D=block_d, FP8=fp8,
                                                 num_warps=_ln_warps(block_d))
    return h, (Fp8Rows(out, q_scale, (b, tokens), x.dtype) if fp8 else out)


def ff_input_layers(ff: torch.nn.Module) -> list[torch.nn.Module]:
    """The layer that reads a diffusers ``FeedForward``'s input (its activation module's ``proj``), for
    ``ln_modulate_for``; none when it has another form."""
    proj = getattr(ff.net[0], "proj", None) if hasattr(ff, "net") else None
    return [proj] if proj is not None else []


if triton is not None:

    @triton.jit
    def _gated_kernel(x_ptr, g_ptr, y_ptr, out_ptr, rows, rows_per_batch, cols, stride_gb,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # BLOCK_R rows x BLOCK_C columns of contiguous (batch * tokens, cols) x and y; each row's gate is its batch
        # sample's (a strided row of the modulation output, read from cache). x + g * y in float32, as addcmul
        # computes it, rounded to the activation dtype once
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        mask = (r < rows) & (c < cols)
        x = tl.load(x_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + (r // rows_per_batch) * stride_gb + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * cols + c, (x + g * y).to(out_ptr.dtype.element_ty), mask=mask)


def _gated_kernel_ok(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``_gated_kernel`` takes these: eager (not traced), contiguous (batch, tokens, dim) ``x`` and ``y`` of
    one shape and dtype, a (batch, 1, dim) gate with unit stride along dim."""
    return (triton_ok(x, gate, y) and not torch.compiler.is_compiling() and x.dim() == 3 and x.shape == y.shape
            and x.dtype == y.dtype == gate.dtype and gate.shape == (x.shape[0], 1, x.shape[2])
            and x.is_contiguous() and y.is_contiguous())


def gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + gate * y``: one pass on CUDA, eager's two ops elsewhere (their exact bytes). Eagerly on CUDA a Triton
    kernel that reads each sample's gate row where it lies: torch's ``addcmul`` broadcasts the gate through its
    strided elementwise kernel, which ran at ~40% of an H200's bandwidth (15.3 ms of a FLUX.1-dev fp8 call at batch
    4: benchmarks/results/2026-12-06-h200-kv-passes-4fe03a2). Traced, ``addcmul``, which inductor fuses."""
    if not x.is_cuda:
        return x + gate * y
    if not _gated_kernel_ok(x, gate, y):
        return torch.addcmul(x, gate, y)
    return gated_triton(x, gate, y)


def gated_triton(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``gated`` by the Triton kernel (no checks: ``gated`` decides when it applies)."""
    b, tokens, dim = x.shape
    out = torch.empty_like(x)
    if x.numel():
        block_r, block_c = 4, min(1024, triton.next_power_of_2(dim))
        _gated_kernel[(triton.cdiv(b * tokens, block_r), triton.cdiv(dim, block_c))](
            x, gate, y, out, b * tokens, tokens, dim, gate.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out


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


def gelu_up(proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``gelu(proj(x), approximate="tanh")``, in the GEMM epilogue for a plain ``nn.Linear`` with a bias."""
    if type(proj) is torch.nn.Linear and proj.bias is not None:
        return linear_gelu_tanh(x, proj.weight, proj.bias)
    return F.gelu(proj(x), approximate="tanh")  # e.g. fp8=true's Float8Linear


# --- attention helpers ------------------------------------------------------------------------------


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


def gelu_feed_forward(ff: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' FeedForward (GELU(tanh) -> dropout -> Linear) with the GELU in the epilogue; with fp8=true's
    float8 layers, the GELU and the down-projection's input quantisation in one pass (``fp8.gelu_rows``)."""
    first = ff.net[0]
    if type(first).__name__ != "GELU" or getattr(first, "approximate", None) != "tanh":
        return ff(x)
    rest = list(ff.net[1:])
    if (isinstance(first.proj, Float8Linear) and len(rest) >= 2 and isinstance(rest[1], Float8Linear)
            and isinstance(rest[0], torch.nn.Dropout) and not ff.training):
        x = rest[1](gelu_rows(first.proj(x)))
        rest = rest[2:]
    else:
        x = gelu_up(first.proj, x)
    for layer in rest:
        x = layer(x)
    return x


# --- swapping attention processors ---------------------------------------------------------------------

def processor_problem(transformer: torch.nn.Module, stock: tuple[str, ...], fused: tuple[type, ...]) -> str | None:
    """Why the attention processors of ``transformer`` cannot be swapped for fused ones (None: they can): weights
    that are DTensors (tensor parallel: the sharded linears all-reduce in their own forward, which direct weight
    use would skip), a processor not among diffusers' ``stock`` ones (nor already one of ``fused``), an attention
    backend or parallel config, fused QKV projections."""
    if is_tensor_parallel(transformer):
        return "it is sharded for tensor parallelism"
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


def layer_norm_problem(transformer: torch.nn.Module) -> str | None:
    """Why ``ln_modulate`` cannot stand for the blocks' LayerNorms (None: it can): norms with weights, or a block's
    norms with several epsilons."""
    for block in transformer.modules():
        norms = [m for m in block.children() if isinstance(m, torch.nn.LayerNorm)]
        if any(n.elementwise_affine or n.eps != norms[0].eps for n in norms):
            return f"{type(block).__name__} has LayerNorms with weights or several epsilons"
    return None
