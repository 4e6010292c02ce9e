"""``sdpa_backend=fa3_fp8`` (opt-in, LOSSY): FlashAttention-3's float8 forward kernel (the ``fa3-fwd`` package: FA3's
Hopper kernels, forward only, built on torch's stable ABI), both products on float8 tensor cores with the
warp-specialised pipeline a Triton kernel does not express. On an H100 its kernel is 1.36x cuDNN's bf16 attention at
FLUX.1-dev's shape, but quantising Q, K and V takes much of that back: with the queries' own pass (below) a
FLUX.1-dev fp8 run's steady rate is ~8% faster with it (2.42 s/image on an H200, docs/lossy.md).

Its inputs are float8 e4m3 with one scale per (sample, head): here each of Q, K and V is quantised on its amax over
the head's tokens and channels (amax / 448), the keys first smoothed by their mean over the tokens (softmax does not
see it; it would spend the keys' range). FA3 rescales the scores and the output by those scales, keeps the
probabilities in e4m3 for ``P V`` and accumulates in float32. On random inputs the output is ~5% off exact attention
(relative RMS; ``reference``: the same arithmetic in torch ops). A fused attention processor (FLUX.1, FLUX.2) hands
its projections over instead (``sdpa_route.parts_attention`` -> ``rms_rope_attention``): the queries are then
RMSNorm-ed, RoPE-d and quantised in one pass on a static scale (``query_scale``), never written in bf16; the keys in
two passes (their mean, then float8 on a static scale: ``key_scale``), the values in two (their largest magnitude,
then float8).

While a pipeline call runs (``context``), torch's SDPA is replaced by a function that sends each call the kernel
takes (``takes``: CUDA, no mask, no dropout, not causal, no GQA, a head size FA3 has) to it, and every other call to
torch's own kernels. Under ``torch.compile`` it is the operator ``shardgen::fa3_fp8_attention`` (opaque to
inductor), so compiled blocks use it too.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import weakref

import torch

from shardgen.speed.fused_kernels import rms_rope, rms_rope_kernel_ok, rms_rope_reference
from shardgen.speed.sdpa_route import kernel_context, plain_attention, tokens_major_operator

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = tl = None

INSTALL = "pip install fa3-fwd (FlashAttention-3's forward kernels for Hopper, built for CUDA 13 and torch>=2.10)"
HEAD_DIMS = (64, 96, 128, 256)
FP8_MAX = 448.0  # float8 e4m3's largest finite value


@functools.cache
def fa3_forward():
    """FA3's forward function (``fa3_fwd_interface._flash_attn_forward``: bf16/fp16 or float8 inputs), imported
    when first asked for; ImportError where fa3-fwd is not installed."""
    import fa3_fwd_interface  # an optional package: imported when first asked for

    return fa3_fwd_interface._flash_attn_forward


def unavailable_reason(device: torch.device | str | None) -> str | None:
    """Why FA3's float8 kernel cannot run here (None when it can): it is built for Hopper (compute capability 9.0)
    only."""
    if device is None or torch.device(device).type != "cuda":
        return "FlashAttention-3 runs on CUDA GPUs only"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if (major, minor) != (9, 0):
        return f"FlashAttention-3 is built for Hopper GPUs (compute capability 9.0); this GPU is {major}.{minor}"
    try:
        fa3_forward()
    except Exception as e:  # not installed, or built for another CUDA
        return f"fa3-fwd does not import ({type(e).__name__}: {str(e)[:120]})"
    return None


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call) -> bool:
    """Whether this SDPA call (its keyword arguments ``call``) goes to FA3's float8 kernel."""
    return plain_attention(q, k, v, HEAD_DIMS, **call)


if triton is not None:

    @triton.jit
    def _quantise_heads(X, Y, S, MEAN, sxb, sxh, sxn, heads, n,
                        ROWS: tl.constexpr, D: tl.constexpr, SUB_MEAN: tl.constexpr):
        """ROWS tokens of one (batch, head) of X (strided (B, H, N, D)) into float8 Y, (B, N, H, D) contiguous (FA3's
        layout), on the head's scale S[(b, h)]; with SUB_MEAN less the head's mean MEAN (B*H, D) first."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        rows = pid * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, D)
        live = (rows < n)[:, None]
        x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + d[None, :], mask=live, other=0.0).to(tl.float32)
        if SUB_MEAN:
            x = x - tl.load(MEAN + bh * D + d)[None, :]
        y = (x / tl.load(S + bh)).to(tl.float8e4nv)
        tl.store(Y + ((b * n + rows[:, None]) * heads + h) * D + d[None, :], y, mask=live)


def _heads_kernel_ok(x: torch.Tensor) -> bool:
    """Whether ``quantise`` takes (B, H, N, D) ``x`` through the Triton statistics and float8 passes of the
    projections' path (``_part_statistics``, ``_write_parts``): CUDA, bf16/fp16, unit stride in D, D a power of two
    FA3 has; any token and head strides (a processor's tokens-major memory is read where it is)."""
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and x.shape[-1] in HEAD_DIMS and not x.shape[-1] & (x.shape[-1] - 1) and x.numel() > 0)


def quantise(x: torch.Tensor, smooth: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, N, D) -> float8 e4m3 (B, N, H, D) and its float32 descales (B, H): each head on amax / 448 over its
    tokens and channels; ``smooth`` subtracts the head's mean over the tokens first (the keys: over each
    ``key_mean_every``-th token). On CUDA the unsmoothed (queries, values) take two Triton passes, the heads' maxima
    then the float8 values, where torch's maximum over a head's strided tokens ran at a fifth of the card's reads
    (Qwen-Image's processors hand SDPA bf16 q, k and v: 16 of a call's 317 ms on an H200); the keys take torch's
    statistics and one Triton pass."""
    b, h, n, d = x.shape
    if not smooth and _heads_kernel_ok(x):  # the values' two passes: each head's maximum, then the float8 values
        tokens_major, unread = x.transpose(1, 2), x.new_empty(1, dtype=torch.float32)  # no RoPE table is read
        scale = _totals(_part_statistics([tokens_major], None, unread, unread, 0.0))
        return _write_parts([tokens_major], None, unread, unread, 0.0, None, scale), scale
    mean = x[:, :, ::key_mean_every(n)].mean(dim=2, dtype=torch.float32).contiguous() if smooth else None  # (B, H, D)
    if smooth:  # the smoothed head's amax, exactly, from each channel's extremes (no smoothed copy is made)
        lo, hi = torch.aminmax(x, dim=2)
        amax = torch.maximum(hi.float() - mean, mean - lo.float()).amax(dim=-1)
    else:
        amax = torch.linalg.vector_norm(x, float("inf"), dim=(2, 3), dtype=torch.float32)
    scale = (amax.clamp_min(1e-20) / FP8_MAX).contiguous()
    if triton is None or not x.is_cuda or x.stride(-1) != 1 or d & (d - 1):  # torch ops: CPU, or no Triton tile
        # (a Triton block's width is a power of two: head size 96 takes this route)
        y = ((x.float() - (mean[:, :, None] if smooth else 0)) / scale[:, :, None, None]).to(torch.float8_e4m3fn)
        return y.transpose(1, 2).contiguous(), scale
    y = torch.empty(b, n, h, d, device=x.device, dtype=torch.float8_e4m3fn)
    rows = 64
    _quantise_heads[(triton.cdiv(n, rows), b * h)](x, y, scale, mean if smooth else scale, x.stride(0), x.stride(1),
                                                   x.stride(2), h, n, ROWS=rows, D=d, SUB_MEAN=smooth, num_warps=4)
    return y, scale


# --- the queries straight from the projections: RMSNorm + RoPE and the quantisation in one pass ----------------------

QUERY_BOUND_MARGIN = 1.01
"""The queries' static scale (``query_scale``) covers their bound times this: bf16's rounding of the norm's output
(2**-8 relative) and RoPE's float32 rotation can go past the exact bound."""

STATS_TOKENS = 32
"""Tokens one statistics program reads (``_part_stats``). Its partial sums, (batch, tokens / this, heads, D) float32,
are ~6% of the keys' bytes at 32; 128 left an H100 a fifth occupied at FLUX.1-dev's shape (432 programs for 4 x
4,608 tokens): each program's chunks are read one after another, so the pass ran at ~1 TB/s."""
STATS_CHUNK = 4
"""Tokens of a statistics program's chunk (``STATS_TOKENS`` / this chunks, accumulated element by element)."""
STATS_WARPS = 8
"""Warps of a statistics program. An H100's sweep at FLUX.1-dev's shape (benchmarks/probe_fa3_parts.py, 2 x 113 MB
of keys and values): 32 tokens, chunks of 4, 8 warps 81 / 46 us; 4 warps 82 / 60; 128 tokens, 4 warps 105 / 125."""

KEY_MEAN_TOKENS = 512
"""The keys' mean (what smoothing subtracts) is taken over each ``key_mean_every``-th token of each part, at least
this many tokens in all: an estimate within ~1/sqrt(512) of the keys' spread of their mean, which is all smoothing
needs (softmax does not see the subtracted vector, whatever it is, and ``key_scale`` covers the keys less any vector
within the norm's bound). At FLUX.1-dev's 4,608 tokens the statistics pass reads a ninth of the keys instead of all
of them (their RMSNorm and RoPE are that pass's work)."""

PARTS_TOKENS = 8
"""Tokens one float8 program writes (``_part_fp8``, with up to 8 heads of each). Its three passes a layer (queries,
keys, values) moved ~2.45 TB/s in a FLUX.1-dev fp8 call on an H100; ``benchmarks/probe_fa3_parts.py`` times the
other launch configurations."""
PARTS_WARPS = 8
"""Warps of a float8 program (``_part_fp8``); swept beside ``PARTS_TOKENS`` by ``benchmarks/probe_fa3_parts.py``."""

if triton is not None:
    from shardgen.speed.fused_kernels import rms_rope_tile

    @triton.jit
    def _part_fp8(x_ptr, w_ptr, cos_ptr, sin_ptr, mean_ptr, scale_ptr, y_ptr, seq_in, seq_total, seq_offset, heads,
                  stride_xb, stride_xs, stride_xh, eps, BLOCK_S: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
                  D: tl.constexpr, ROPE: tl.constexpr, SUB_MEAN: tl.constexpr):
        """BLOCK_S tokens x HEADS_PER_PROGRAM heads of a part (RMSNorm-ed and RoPE-d as ``rms_rope`` writes them,
        rounded to the activation dtype, with ROPE; else as they are) into float8 Y, (batch, tokens, heads, D)
        contiguous (FA3's layout) at the part's offset in the joint sequence: ``(value - MEAN[b, h]) / SCALE[b, h]``
        (MEAN with SUB_MEAN only)."""
        pid_s, pid_h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        h = pid_h * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        y, mask = rms_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, b, s, h, seq_in, seq_offset, stride_xb, stride_xs,
                                stride_xh, eps, BLOCK_S, HEADS_PER_PROGRAM, D, ROPE)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        s3, h3, d3 = s[:, None, None], h[None, :, None], tl.arange(0, D)[None, None, :]
        bh = b.to(tl.int64) * heads + h3
        if SUB_MEAN:
            y = y - tl.load(mean_ptr + bh * D + d3)
        y = (y / tl.load(scale_ptr + bh)).to(tl.float8e4nv)
        tl.store(y_ptr + ((b.to(tl.int64) * seq_total + seq_offset + s3) * heads + h3) * D + d3, y, mask=mask)

    @triton.jit
    def _part_stats(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, seq_in, seq_offset, block_offset, blocks, heads,
                    stride_xb, stride_xs, stride_xh, eps, every, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                    HEADS_PER_PROGRAM: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr):
        """CHUNKS x CHUNK tokens x HEADS_PER_PROGRAM heads of a part (the values ``_part_fp8`` quantises), each
        ``every``-th token of it. With ROPE (the keys) each channel's sum over those tokens into OUT (batch, blocks,
        heads, D); else (the values, every=1) each head's largest magnitude into OUT (batch, blocks, heads). The
        chunks accumulate element by element and are reduced over the tokens once, at the end (a reduction across
        the tile's warps per chunk costs ten times the reads); one accumulator, as more spill registers and slow the
        pass below its reads."""
        pid_s, pid_h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        h = pid_h * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        acc = tl.zeros((CHUNK, HEADS_PER_PROGRAM, D), dtype=tl.float32)
        for c in range(CHUNKS):
            s = ((pid_s * CHUNKS + c) * CHUNK + tl.arange(0, CHUNK)) * every
            y, mask = rms_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, b, s, h, seq_in, seq_offset, stride_xb,
                                    stride_xs, stride_xh, eps, CHUNK, HEADS_PER_PROGRAM, D, ROPE)
            y = tl.where(mask, y.to(x_ptr.dtype.element_ty).to(tl.float32), 0.0)
            if ROPE:
                acc += y
            else:
                acc = tl.maximum(acc, tl.abs(y))
        row = (b.to(tl.int64) * blocks + block_offset + pid_s) * heads + h
        if ROPE:
            tl.store(out_ptr + row[:, None] * D + tl.arange(0, D)[None, :], tl.sum(acc, axis=0))
        else:
            tl.store(out_ptr + row, tl.max(tl.max(acc, axis=2), axis=0))

    @triton.jit
    def _stats_total(part_ptr, out_ptr, heads, blocks, divisor, SPAN: tl.constexpr, CHUNK: tl.constexpr,
                     D: tl.constexpr, SUM: tl.constexpr, QMAX: tl.constexpr):
        """One (batch, head) of ``_part_stats``' partials (batch, blocks, heads[, D]) in one program: with SUM the
        channels' sums over the blocks / ``divisor`` into OUT (batch, heads, D) (the keys' mean); else the largest
        magnitude over the blocks as a float8 descale, max(it, 1e-20) / QMAX, into OUT (batch, heads); both divisions
        rounded as torch's (``div_rn``: Triton's ``/`` may be an approximate division). The loop runs to SPAN, the
        power of two at or above ``blocks``: a compile-time bound, which Triton's interpreter (the CPU tests) needs,
        shared by every token count up to it (a sequence whose text length varies batch to batch compiles once)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // heads, bh % heads
        i = tl.arange(0, CHUNK)
        if SUM:
            d = tl.arange(0, D)
            acc = tl.zeros((CHUNK, D), dtype=tl.float32)
            for start in range(0, SPAN, CHUNK):
                rows = start + i
                acc += tl.load(part_ptr + ((b * blocks + rows[:, None]) * heads + h) * D + d[None, :],
                               mask=(rows < blocks)[:, None], other=0.0)
            tl.store(out_ptr + bh * D + d, tl.math.div_rn(tl.sum(acc, axis=0), divisor))
        else:
            acc = tl.zeros((CHUNK,), dtype=tl.float32)
            for start in range(0, SPAN, CHUNK):
                rows = start + i
                acc = tl.maximum(acc, tl.load(part_ptr + (b * blocks + rows) * heads + h, mask=rows < blocks,
                                              other=0.0))
            tl.store(out_ptr + bh, tl.math.div_rn(tl.maximum(tl.max(acc, axis=0), 1e-20), QMAX))


def _totals(partials: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """``_part_statistics``' partials over their blocks in one launch (``_stats_total``), where torch's reduction,
    division and clamp took two to three kernels a layer: the keys' (batch, blocks, heads, D) channel sums as their
    mean (batch, heads, D) over ``divisor`` tokens; the values' (batch, blocks, heads) largest magnitudes as their
    float8 descales (batch, heads)."""
    b, blocks, heads = partials.shape[:3]
    sums = partials.dim() == 4
    out = partials.new_empty(b, heads, *partials.shape[3:])
    chunk = 16 if sums else 128
    _stats_total[(b * heads,)](partials, out, heads, blocks, float(divisor),
                               SPAN=max(chunk, triton.next_power_of_2(blocks)), CHUNK=chunk,
                               D=partials.shape[3] if sums else 1, SUM=sums, QMAX=FP8_MAX, num_warps=4)
    return out


def parts_kernel_ok(xs: list[torch.Tensor], cos: torch.Tensor) -> bool:
    """Whether the Triton passes take these parts (queries, keys or values): CUDA, bf16/fp16 (batch, tokens, heads, D)
    parts of one batch, head count, dtype and head size (a power of two FA3 has), unit stride in the last dim; float32
    contiguous (tokens, D) cos/sin over their joint length."""
    x0 = xs[0]
    return (rms_rope_kernel_ok(xs, cos) and all(x.dim() == 4 and x.shape[0] == x0.shape[0]
                                                 and x.shape[2:] == x0.shape[2:] for x in xs)
            and cos.shape == (sum(x.shape[1] for x in xs), x0.shape[-1]))


def _norm_bound(weights: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The largest magnitude an RMSNorm-ed, RoPE-d element can reach (float32, 0-d), times ``QUERY_BOUND_MARGIN``:
    after RMSNorm no element of a token's head exceeds sqrt(dim) times the norm's largest weight, and RoPE rotates
    pairs of elements, keeping each pair's length."""
    bound = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    return bound * (math.sqrt(dim) * QUERY_BOUND_MARGIN)


_STATIC_SCALES: dict[tuple, tuple[tuple[weakref.ref, ...], torch.Tensor]] = {}
"""``_static_descales``' results: key -> (weak references to the norm weights it was made from, the descales)."""


def _static_descales(weights: list[torch.Tensor], batch: int, heads: int, dim: int, factor: float) -> torch.Tensor:
    """``factor`` x the norm's bound (``_norm_bound``) / 448 as float32 (batch, heads) descales, made once per set of
    norm weights (and their version, dtype and device: an in-place change or a move makes them again) and batch
    shape, then reused: they depend on the weights alone, and working them out took ~20 tiny kernels a layer, every
    call (~1,300 in a FLUX.1-dev call, each a launch in its CUDA graph). The entry is keyed by the weights' identity
    and checked against weak references to them (a freed weight's id may be reused); it is dropped when a weight is
    freed. Not kept while a CUDA graph is being captured: the capture's tensors are only filled when it replays."""
    try:
        key = (tuple((id(w), w._version, w.dtype, w.device) for w in weights), batch, heads, dim, factor)
    except RuntimeError:  # an inference-mode tensor has no version counter: nothing tells a change, so no reuse
        key = None
    hit = _STATIC_SCALES.get(key)
    if hit is not None and all(ref() is w for ref, w in zip(hit[0], weights)):
        return hit[1]
    descales = (factor * _norm_bound(weights, dim) / FP8_MAX).expand(batch, heads).contiguous()
    if key is not None and not (descales.is_cuda and torch.cuda.is_current_stream_capturing()):
        def drop(_ref, key=key):
            _STATIC_SCALES.pop(key, None)

        _STATIC_SCALES[key] = (tuple(weakref.ref(w, drop) for w in weights), descales)
    return descales


def query_scale(weights: list[torch.Tensor], batch: int, heads: int, dim: int) -> torch.Tensor:
    """The queries' float32 (batch, heads) descales, one static value: the norm's bound (``_norm_bound``) over 448.
    So a fixed scale keeps every query in e4m3's range without a pass to find its maximum (float8 keeps its relative
    precision over the range, so a scale above the largest value costs no precision but at the subnormals). Made
    once per norm weights and batch shape (``_static_descales``); the caller must not write into it."""
    return _static_descales(weights, batch, heads, dim, 1.0)


def key_scale(weights: list[torch.Tensor], batch: int, heads: int, dim: int) -> torch.Tensor:
    """The smoothed keys' float32 (batch, heads) descales, one static value: a key less the keys' mean (itself within
    the norm's bound) is within twice the bound. On random keys, and on keys whose projections share a mean up to 50
    times their spread, attention with this scale is as far from exact as with each head's own largest magnitude
    (within 5% of that error: tests/test_fa3_fp8.py), while the keys' statistics pass gathers their sums alone. Made
    once per norm weights and batch shape, as ``query_scale``."""
    return _static_descales(weights, batch, heads, dim, 2.0)


def quantise_queries(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint sequence of the query parts (each (batch, tokens_i, heads, D), as the projections give them), each
    RMSNorm-ed with its weight and RoPE-d as ``fused_kernels.rms_rope`` does, in float8 (batch, tokens, heads, D) on
    ``query_scale``'s static scale, and its (batch, heads) descales. On CUDA one Triton pass over the parts (the bf16
    queries are never written); elsewhere ``rms_rope`` then the same division in torch ops."""
    b, _, heads, d = xs[0].shape
    scale = query_scale(weights, b, heads, d)
    if not parts_kernel_ok(xs, cos):
        joint = rms_rope(xs, weights, cos, sin, eps)
        return (joint.float() / scale[:, :, None, None]).to(torch.float8_e4m3fn).transpose(1, 2).contiguous(), scale
    return _write_parts(xs, weights, cos, sin, eps, None, scale), scale


def quantise_keys(xs: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint sequence of the key parts (each (batch, tokens_i, heads, D), as the projections give them), each
    RMSNorm-ed with its weight and RoPE-d as ``fused_kernels.rms_rope`` does, less each head's mean over the tokens
    (softmax does not see it; it would spend the keys' range), in float8 (batch, tokens, heads, D) on ``key_scale``'s
    static scale, and the (batch, heads) descales; the mean is over each ``key_mean_every``-th token of each part
    (``KEY_MEAN_TOKENS``). On CUDA two Triton passes over the parts (those tokens' channel sums, then the float8
    values: ``rms_rope``'s bf16 output is never written); elsewhere ``rms_rope`` then torch ops."""
    b, _, heads, d = xs[0].shape
    scale = key_scale(weights, b, heads, d)
    lengths = [x.shape[1] for x in xs]
    every = key_mean_every(sum(lengths))
    if not parts_kernel_ok(xs, cos):
        joint = rms_rope(xs, weights, cos, sin, eps).float()
        index = key_mean_tokens(lengths, every).to(joint.device)
        smoothed = joint - joint.index_select(2, index).mean(dim=2, keepdim=True)
        return (smoothed / scale[:, :, None, None]).to(torch.float8_e4m3fn).transpose(1, 2).contiguous(), scale
    sums = _part_statistics(xs, weights, cos, sin, eps, every)  # (batch, blocks, heads, D)
    read = sum(-(-n // every) for n in lengths)
    return _write_parts(xs, weights, cos, sin, eps, _totals(sums, read), scale), scale


def key_mean_every(tokens: int) -> int:
    """Each how many tokens of a part the keys' mean reads: 1 up to ``KEY_MEAN_TOKENS`` x 2 tokens, then so that
    at least ``KEY_MEAN_TOKENS`` are read."""
    return max(1, tokens // KEY_MEAN_TOKENS)


def key_mean_tokens(lengths: list[int], every: int) -> torch.Tensor:
    """The joint sequence's positions the keys' mean reads: each ``every``-th token of each part (lengths
    ``lengths``, in order), from the part's first."""
    starts = itertools.accumulate(lengths, initial=0)
    return torch.cat([torch.arange(start, start + n, every) for start, n in zip(starts, lengths)])


def quantise_values(xs: list[torch.Tensor], cos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantise`` of the joint sequence of the value parts (each (batch, tokens_i, heads, D)): float8 (batch,
    tokens, heads, D) on each head's largest magnitude over 448, and the (batch, heads) descales. On CUDA two Triton
    passes over the parts (each head's largest magnitude, then the float8 values: no concatenation is written);
    elsewhere ``torch.cat`` then ``quantise``. ``cos``: the joint sequence's RoPE table, for ``parts_kernel_ok``."""
    if not parts_kernel_ok(xs, cos):
        return quantise((torch.cat(xs, dim=1) if len(xs) > 1 else xs[0]).transpose(1, 2))
    scale = _totals(_part_statistics(xs, None, cos, cos, 0.0))  # (batch, heads): amax / 448
    return _write_parts(xs, None, cos, cos, 0.0, None, scale), scale


def _part_statistics(xs: list[torch.Tensor], weights: list[torch.Tensor] | None, cos: torch.Tensor,
                     sin: torch.Tensor, eps: float, every: int = 1) -> torch.Tensor:
    """``_part_stats`` over the parts, a launch each: with ``weights`` (keys, RMSNorm + RoPE) the channels' sums over
    each ``every``-th token of a part, (batch, blocks, heads, D); without (values) the heads' largest magnitudes,
    (batch, blocks, heads). A block is ``STATS_TOKENS`` of the tokens read, or fewer when only some are read, so a
    sampled pass still launches about as many programs as a full one (each shorter): fewer would leave the GPU part
    idle."""
    b, _, heads, d = xs[0].shape
    rope = weights is not None
    chunks = max(1, (STATS_TOKENS // STATS_CHUNK) // every)
    blocks = [triton.cdiv(triton.cdiv(x.shape[1], every), STATS_CHUNK * chunks) for x in xs]
    out = torch.empty(b, sum(blocks), heads, *((d,) if rope else ()), device=xs[0].device, dtype=torch.float32)
    per_program, block_offset, offset = math.gcd(heads, 8), 0, 0
    for i, x in enumerate(xs):
        w = weights[i].contiguous() if rope else x  # unread without RoPE
        _part_stats[(blocks[i], heads // per_program, b)](
            x, w, cos, sin.contiguous(), out, x.shape[1], offset, block_offset, sum(blocks), heads, x.stride(0),
            x.stride(1), x.stride(2), eps, every, CHUNK=STATS_CHUNK, CHUNKS=chunks, HEADS_PER_PROGRAM=per_program,
            D=d, ROPE=rope, num_warps=STATS_WARPS)
        block_offset, offset = block_offset + blocks[i], offset + x.shape[1]
    return out


def _write_parts(xs: list[torch.Tensor], weights: list[torch.Tensor] | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, mean: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    """The float8 pass of ``quantise_queries``, ``quantise_keys`` and ``quantise_values`` (``_part_fp8``, a launch per
    part): the joint (batch, tokens, heads, D) float8 tensor, each part less ``mean`` (batch, heads, D) if given, over
    ``scale``."""
    b, _, heads, d = xs[0].shape
    total = sum(x.shape[1] for x in xs)
    y = torch.empty(b, total, heads, d, device=xs[0].device, dtype=torch.float8_e4m3fn)
    per_program, block, offset = math.gcd(heads, 8), PARTS_TOKENS, 0
    for i, x in enumerate(xs):
        w = weights[i].contiguous() if weights is not None else x  # unread without RoPE
        _part_fp8[(triton.cdiv(x.shape[1], block), heads // per_program, b)](
            x, w, cos, sin.contiguous(), scale if mean is None else mean, scale, y, x.shape[1], total, offset, heads,
            x.stride(0), x.stride(1), x.stride(2), eps, BLOCK_S=block, HEADS_PER_PROGRAM=per_program, D=d,
            ROPE=weights is not None, SUB_MEAN=mean is not None, num_warps=PARTS_WARPS)
        offset += x.shape[1]
    return y


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FA3's float8 attention of (batch, heads, tokens, head_dim) tensors, as SDPA (no mask, not causal): SDPA's
    (batch, heads, tokens, head_dim) view of FA3's (batch, tokens, heads, head_dim) output."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q8, qs = quantise(q)
    k8, ks = quantise(k, smooth=True)
    v8, vs = quantise(v)
    out = fa3_forward()(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs, softmax_scale=scale)[0]
    return out.to(q.dtype).transpose(1, 2)


_operator = tokens_major_operator("fa3_fp8_attention", __name__)  # compiled blocks call this

def takes_parts(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], cos: torch.Tensor) -> bool:
    """Whether ``rms_rope_attention`` takes these projections (a fused processor's parts; else it calls ``rms_rope``
    and SDPA): the Triton passes take the query parts, and the keys and values are of the same batch, heads and head
    size (so the passes take them too), one joint length for the two."""
    return (parts_kernel_ok(qs, cos) and all(x.dim() == 4 and x.shape[0] == qs[0].shape[0]
                                             and x.shape[2:] == qs[0].shape[2:] for x in (*ks, *vs))
            and sum(x.shape[1] for x in ks) == sum(x.shape[1] for x in vs) == cos.shape[0])


def rms_rope_attention(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor],
                       wq: list[torch.Tensor], wk: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, eps: float,
                       scale: float | None = None) -> torch.Tensor:
    """FA3's float8 attention over the joint sequence of the projections' parts (each (batch, tokens_i, heads, D)),
    q and k RMSNorm-ed (weights ``wq``/``wk``) and RoPE-d as ``fused_kernels.rms_rope`` does: (batch, tokens, heads,
    D). The queries go straight from their projections to float8 on a static scale (``quantise_queries``: one pass,
    where ``attention`` writes them in bf16, reads them for their maximum and again to quantise); the keys and values
    in two passes each (``quantise_keys``: their mean, then float8 on a static scale; ``quantise_values``: their
    largest magnitude, then float8), neither the normed keys nor the joined values written in bf16. Under
    ``torch.compile`` the operator ``shardgen::fa3_fp8_rms_rope_attention``."""
    scale = 1.0 / math.sqrt(qs[0].shape[-1]) if scale is None else scale
    if torch.compiler.is_compiling():
        return _parts_operator(qs, ks, vs, wq, wk, cos, sin, eps, scale)
    q8, q_descale = quantise_queries(qs, wq, cos, sin, eps)
    k8, k_descale = quantise_keys(ks, wk, cos, sin, eps)
    v8, v_descale = quantise_values(vs, cos)
    out = fa3_forward()(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                         softmax_scale=scale)[0]
    return out.to(qs[0].dtype)


@torch.library.custom_op("shardgen::fa3_fp8_rms_rope_attention", mutates_args=())
def _parts_operator(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], wq: list[torch.Tensor],
                    wk: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, eps: float,
                    scale: float) -> torch.Tensor:
    """``rms_rope_attention`` as a torch operator, for compiled blocks."""
    return rms_rope_attention(qs, ks, vs, wq, wk, cos, sin, eps, scale)


@_parts_operator.register_fake
def _(qs, ks, vs, wq, wk, cos, sin, eps, scale):
    b, _, h, d = qs[0].shape
    return qs[0].new_empty(b, sum(x.shape[1] for x in qs), h, d)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The self-check's (batch, heads, tokens, D) inputs as two projection parts each, RMSNorm weights and a RoPE of
    random angles."""
    g = torch.Generator(device=q.device).manual_seed(1)
    n, d = q.shape[2], q.shape[3]
    cut = n // 3
    parts = [[x.transpose(1, 2)[:, :cut], x.transpose(1, 2)[:, cut:]] for x in (q, k, v)]
    weights = [[(torch.rand(d, device=q.device, generator=g) + 0.5).to(q.dtype) for _ in range(2)] for _ in range(2)]
    ang = torch.rand(n, d // 2, device=q.device, generator=g) * 6
    return parts, weights, ang.cos().repeat_interleave(2, -1).contiguous(), ang.sin().repeat_interleave(2, -1)


def check_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``rms_rope_attention`` on the self-check's inputs (``sdpa_route.self_check``), in SDPA's layout."""
    (qs, ks, vs), (wq, wk), cos, sin = _check_inputs(q, k, v)
    return rms_rope_attention(qs, ks, vs, wq, wk, cos, sin, 1e-6).transpose(1, 2)


def check_parts_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What ``check_parts`` approximates: exact float32 attention of the RMSNorm-ed, RoPE-d inputs."""
    (qs, ks, vs), (wq, wk), cos, sin = _check_inputs(q, k, v)
    query = rms_rope_reference([x.float() for x in qs], [w.float() for w in wq], cos, sin, 1e-6)
    key = rms_rope_reference([x.float() for x in ks], [w.float() for w in wk], cos, sin, 1e-6)
    return torch.nn.functional.scaled_dot_product_attention(query, key, v.float())


def context():
    """Within it, torch SDPA calls FA3's float8 kernel where it takes the call (``takes``), torch's kernels
    elsewhere."""
    return kernel_context(sys.modules[__name__])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The method's arithmetic in torch ops (float32, whole score matrices): the same per-head e4m3 inputs and
    smoothed keys, the probabilities rounded to e4m3 for ``P V``. What the kernel is checked against, and on CPU
    what the method costs against exact attention."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def e4m3(x: torch.Tensor, smooth: bool = False) -> torch.Tensor:
        y, s = quantise(x, smooth)
        return y.float().transpose(1, 2) * s[:, :, None, None]

    s = (e4m3(q) @ e4m3(k, smooth=True).transpose(-1, -2)) * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = (p.to(torch.float8_e4m3fn).float() @ e4m3(v)) / p.sum(-1, keepdim=True)
    return out.to(q.dtype)
