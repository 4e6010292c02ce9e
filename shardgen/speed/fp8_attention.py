"""``sdpa_backend=fp8`` (opt-in, LOSSY): shardgen's own 8-bit attention, a Triton FlashAttention forward whose two
products both run on 8-bit tensor cores (Ada, Hopper and later: compute capability 8.9+), as SageAttention2 does:

- ``Q K^T`` in INT8: each query and each key row on its own scale (row amax / 127, rounded to nearest), products
  summed in int32. The keys are first smoothed by their mean over the tokens, which softmax does not see and which
  would otherwise spend the keys' range. (float8 e4m3 here would cost ~4x the error: 3 mantissa bits against 7.)
- ``P V`` in float8 e4m3: each tile's probabilities are written as ``exp2(s - max + log2(448))``, i.e. scaled so the
  largest is e4m3's largest, 448, exactly (small probabilities keep their precision); the values are quantised per
  channel (amax over the tokens / 448). The scale cancels in the softmax's sum, kept in float32 from the same terms.
- Accumulation in float32; the output is written straight into (batch, tokens, heads, head_dim) memory and returned
  as SDPA's (batch, heads, tokens, head_dim) view of it, so a processor's ``transpose(1, 2).flatten(2, 3)`` costs
  no copy.

On random inputs the output differs from exact attention by ~3.5% (relative RMS): ~1% from INT8 ``Q K^T``, the rest
from e4m3's 3-bit mantissa in ``P V`` (``reference``: the same arithmetic in torch ops).

While a pipeline call runs (``context``), torch's SDPA is replaced by a function that sends each call this kernel
takes (``takes``: CUDA, no mask, no dropout, not causal, head size 64 or 128, fp16/bf16, no GQA) to it, and every
other call to torch's own kernels. Compiled blocks call it too: under ``torch.compile`` it is the custom operator
``shardgen::fp8_attention`` (opaque to inductor), so a run that switches to compiled blocks keeps the same
attention; outside the context a compiled block's guard sees torch's SDPA again and uses its graph without it.
"""

from __future__ import annotations

import math
import sys

import torch

from shardgen.speed.sdpa_route import kernel_context, plain_attention

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = tl = None

HEAD_DIMS = (64, 128)
FP8_MAX = 448.0  # float8 e4m3's largest finite value
LOG2_E = 1.4426950408889634
# log2 of the probabilities' scale: the largest becomes 448 (exp2's rounding stays within half of e4m3's step there)
LOG2_P_SCALE = math.log2(FP8_MAX)
PAD = 128  # the quantised tensors' token count is padded to a multiple of the largest tile, so tiles load unmasked
# tile sizes per head size (benchmarks/probe_fp8_attention.py --tiles times the others). 128: the fastest of the
# grid at FLUX.1-dev's shape on an H100 (1.82 ms against 2.08 ms for 128x128 on 8 warps; docs/lossy.md); 64:
# FlashAttention's usual Hopper tile, not yet timed on a GPU
TILES = {64: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
         128: dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)}


def unavailable_reason(device: torch.device | str | None) -> str | None:
    """Why the float8 attention kernel cannot run here (None when it can)."""
    if device is None or torch.device(device).type != "cuda":
        return "float8 attention runs on CUDA GPUs only"
    if triton is None:
        return "Triton is not installed (it ships with torch's CUDA builds)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
        return "float8 tensor cores need compute capability 8.9+ (Ada, Hopper, Blackwell)"
    return None


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call) -> bool:
    """Whether this SDPA call (its keyword arguments ``call``) goes to the float8 kernel."""
    return plain_attention(q, k, v, HEAD_DIMS, **call)


if triton is not None:

    @triton.jit
    def _quantise_rows(X, Y, S, MEAN, sxb, sxh, sxn, heads, n, n_pad, scale_mul,
                       ROWS: tl.constexpr, D: tl.constexpr, SUB_MEAN: tl.constexpr, PER_CHANNEL: tl.constexpr):
        """One (batch, head) and ROWS tokens of X (strided (B, H, N, D)): INT8 rows into Y, contiguous
        (B*H, n_pad, D), their scales (amax / 127 times ``scale_mul``) into S (B*H, n_pad); or with PER_CHANNEL
        (the values) float8 into Y as (B*H, D, n_pad), transposed (the second product's K-major operand), on the
        per-channel scales S (B*H, D) holds. Rows past ``n`` are written as zeros (the padding)."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        rows = pid * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, D)
        live = rows < n
        x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxn + d[None, :], mask=live[:, None], other=0.0)
        x = x.to(tl.float32)
        if SUB_MEAN:
            x = x - tl.load(MEAN + bh * D + d)[None, :]
            x = tl.where(live[:, None], x, 0.0)
        if PER_CHANNEL:
            s = tl.load(S + bh * D + d)
            y = (x / s[None, :]).to(tl.float8e4nv)
            tl.store(Y + bh * D * n_pad + d[None, :] * n_pad + rows[:, None], y, mask=rows[:, None] < n_pad)
        else:  # the queries and keys: INT8, rounded to nearest
            s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-20) / 127.0
            y = x / s[:, None]
            y = (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8)
            keep = rows < n_pad
            tl.store(Y + bh * n_pad * D + rows[:, None] * D + d[None, :], y, mask=keep[:, None])
            tl.store(S + bh * n_pad + rows, s * scale_mul, mask=keep)

    @triton.jit
    def _tile(acc, l_i, m_i, q, qs, K, KS, Vt, start, n_k, n_pad, offs_n, d,
              D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, LOG2_P: tl.constexpr):
        """One tile of keys and values into the running softmax (m_i, l_i) and output (acc)."""
        cols = start + offs_n
        k = tl.load(K + cols[:, None] * D + d[None, :])
        ks = tl.load(KS + cols)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * ks[None, :]
        if MASK:
            s = tl.where(cols[None, :] < n_k, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qs)
        p = tl.math.exp2(s * qs[:, None] - (m_new - LOG2_P)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vt + d[None, :] * n_pad + cols[:, None])
        acc = tl.dot(p.to(tl.float8e4nv), v, acc * alpha[:, None])
        return acc, l_i, m_new

    @triton.jit
    def _attention(Q, QS, K, KS, Vt, VS, O, n_q, n_k, nq_pad, nk_pad, heads, sob, son, soh,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_P: tl.constexpr):
        """Queries pid*BLOCK_M.. of one (batch, head) against all its keys; output rows into O (strided)."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        d = tl.arange(0, D)
        q = tl.load(Q + bh * nq_pad * D + offs_m[:, None] * D + d[None, :])
        qs = tl.load(QS + bh * nq_pad + offs_m)
        K += bh * nk_pad * D
        KS += bh * nk_pad
        Vt += bh * D * nk_pad
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        full = (n_k // BLOCK_N) * BLOCK_N
        for start in range(0, full, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, qs, K, KS, Vt, start, n_k, nk_pad, offs_n, d,
                                  D, BLOCK_N, False, LOG2_P)
        if full < n_k:
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, qs, K, KS, Vt, full, n_k, nk_pad, offs_n, d,
                                  D, BLOCK_N, True, LOG2_P)
        vs = tl.load(VS + bh * D + d)
        out = acc * (vs[None, :] / l_i[:, None])
        tl.store(O + b * sob + offs_m[:, None] * son + h * soh + d[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_m < n_q)[:, None])


def _padded(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


def quantise(x: torch.Tensor, scale_mul: float = 1.0, smooth: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, N, D) -> INT8 rows (B*H, N padded to 128, D) and their float32 scales (B*H, N padded), each row on
    its own scale times ``scale_mul``; ``smooth`` subtracts the mean over the tokens first (the keys)."""
    b, h, n, d = x.shape
    n_pad = _padded(n)
    y = torch.empty(b * h, n_pad, d, device=x.device, dtype=torch.int8)
    s = torch.empty(b * h, n_pad, device=x.device, dtype=torch.float32)
    mean = x.mean(dim=2, dtype=torch.float32).reshape(b * h, d) if smooth else s
    _quantise_rows[(n_pad // 64, b * h)](x, y, s, mean, x.stride(0), x.stride(1), x.stride(2), h, n, n_pad,
                                         scale_mul, ROWS=64, D=d, SUB_MEAN=smooth, PER_CHANNEL=False, num_warps=4)
    return y, s


def quantise_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, N, D) -> float8 (B*H, D, N padded to 128), transposed, and per-channel scales (B*H, D)."""
    b, h, n, d = v.shape
    n_pad = _padded(n)
    amax = torch.linalg.vector_norm(v, float("inf"), dim=2, dtype=torch.float32)  # one read, no |v| copy
    s = (amax.clamp_min(1e-20) / FP8_MAX).reshape(b * h, d).contiguous()
    y = torch.empty(b * h, d, n_pad, device=v.device, dtype=torch.float8_e4m3fn)
    _quantise_rows[(n_pad // 64, b * h)](v, y, s, s, v.stride(0), v.stride(1), v.stride(2), h, n, n_pad, 1.0,
                                         ROWS=64, D=d, SUB_MEAN=False, PER_CHANNEL=True, num_warps=4)
    return y, s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              tiles: dict | None = None) -> torch.Tensor:
    """8-bit attention of (batch, heads, tokens, head_dim) tensors, as SDPA (no mask, not causal). The result is
    SDPA's (batch, heads, tokens, head_dim) view of (batch, tokens, heads, head_dim) memory. ``tiles`` overrides
    the tile sizes (``TILES``) for a measurement."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q8, qs = quantise(q, scale_mul=scale * LOG2_E)
    k8, ks = quantise(k, smooth=True)
    v8, vs = quantise_values(v)
    out = torch.empty(b, n_q, h, d, device=q.device, dtype=q.dtype)
    t = dict(tiles or TILES[d])
    block_m = t.pop("BLOCK_M")
    grid = (triton.cdiv(n_q, block_m), b * h)
    _attention[grid](q8, qs, k8, ks, v8, vs, out, n_q, n_k, q8.shape[1], k8.shape[1], h,
                     out.stride(0), out.stride(1), out.stride(2), D=d, BLOCK_M=block_m,
                     LOG2_P=LOG2_P_SCALE, **t)
    return out.transpose(1, 2)


@torch.library.custom_op("shardgen::fp8_attention", mutates_args=())
def _operator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel as a torch operator, for compiled blocks (inductor does not trace into it); on the CPU the
    reference arithmetic (``reference``: what tests compile)."""
    return attention(q, k, v, scale) if q.is_cuda else reference(q, k, v, scale).transpose(1, 2).contiguous() \
        .transpose(1, 2)


@_operator.register_fake
def _(q, k, v, scale):
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2)  # the kernel's layout: (batch, tokens, heads, dim) memory


def context():
    """Within it, torch SDPA calls the float8 kernel where it takes the call (``takes``), torch's kernels
    elsewhere."""
    return kernel_context(sys.modules[__name__])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The kernel's arithmetic in torch ops (float32, slow, whole score matrices): the same INT8 rows, smoothed keys,
    scaled e4m3 probabilities and per-channel e4m3 values. What the kernel is tested against, and on CPU what the
    method costs against exact attention."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def int8_rows(x):
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-20) / 127.0
        return torch.round(x / s).clamp(-127, 127) * s

    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf - kf.mean(dim=2, keepdim=True)
    s = (int8_rows(qf) @ int8_rows(kf).transpose(-1, -2)) * (scale * LOG2_E)
    p = torch.exp2(s - s.amax(-1, keepdim=True) + LOG2_P_SCALE)
    vs = vf.abs().amax(dim=2, keepdim=True).clamp_min(1e-20) / FP8_MAX
    v8 = (vf / vs).to(torch.float8_e4m3fn).float() * vs
    out = (p.to(torch.float8_e4m3fn).float() @ v8) / p.sum(-1, keepdim=True)
    return out.to(q.dtype)
