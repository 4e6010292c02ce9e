"""``sdpa_backend=fa3_fp8`` (opt-in, LOSSY): FlashAttention-3's float8 forward kernel (the ``fa3-fwd`` package: FA3's
Hopper kernels, forward only, built on torch's stable ABI), both products on float8 tensor cores with the
warp-specialised pipeline a Triton kernel does not express. On an H100 its kernel is 1.36x cuDNN's bf16 attention at
FLUX.1-dev's shape, but quantising Q, K and V here takes most of that back: a whole FLUX.1-dev fp8 run is 4% faster
with it (docs/lossy.md).

Its inputs are float8 e4m3 with one scale per (sample, head): here each of Q, K and V is quantised on its amax over
the head's tokens and channels (amax / 448), the keys first smoothed by their mean over the tokens (softmax does not
see it; it would spend the keys' range). FA3 rescales the scores and the output by those scales, keeps the
probabilities in e4m3 for ``P V`` and accumulates in float32. On random inputs the output is ~5% off exact attention
(relative RMS; ``reference``: the same arithmetic in torch ops).

While a pipeline call runs (``context``), torch's SDPA is replaced by a function that sends each call the kernel
takes (``takes``: CUDA, no mask, no dropout, not causal, no GQA, a head size FA3 has) to it, and every other call to
torch's own kernels. Under ``torch.compile`` it is the operator ``shardgen::fa3_fp8_attention`` (opaque to
inductor), so compiled blocks use it too.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from shardgen.speed.sdpa_route import kernel_context, plain_attention

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = tl = None

INSTALL = "pip install fa3-fwd (FlashAttention-3's forward kernels for Hopper, built for CUDA 13 and torch>=2.10)"
HEAD_DIMS = (64, 96, 128, 256)
FP8_MAX = 448.0  # float8 e4m3's largest finite value


@functools.cache
def _fa3_forward():
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
        _fa3_forward()
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


def quantise(x: torch.Tensor, smooth: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, N, D) -> float8 e4m3 (B, N, H, D) and its float32 descales (B, H): each head on amax / 448 over its
    tokens and channels; ``smooth`` subtracts the head's mean over the tokens first (the keys)."""
    b, h, n, d = x.shape
    mean = x.mean(dim=2, dtype=torch.float32).contiguous() if smooth else None  # (B, H, D), as the kernel reads it
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FA3's float8 attention of (batch, heads, tokens, head_dim) tensors, as SDPA (no mask, not causal): SDPA's
    (batch, heads, tokens, head_dim) view of FA3's (batch, tokens, heads, head_dim) output."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q8, qs = quantise(q)
    k8, ks = quantise(k, smooth=True)
    v8, vs = quantise(v)
    out = _fa3_forward()(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs, softmax_scale=scale)[0]
    return out.to(q.dtype).transpose(1, 2)


@torch.library.custom_op("shardgen::fa3_fp8_attention", mutates_args=())
def _operator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel as a torch operator, for compiled blocks (inductor does not trace into it); its body is
    ``attention``, looked up at each call (a CPU test replaces it)."""
    return attention(q, k, v, scale).transpose(1, 2).contiguous().transpose(1, 2)


@_operator.register_fake
def _(q, k, v, scale):
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2)  # FA3's layout: (batch, tokens, heads, dim) memory


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
