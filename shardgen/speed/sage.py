"""``sdpa_backend=sage`` (opt-in, LOSSY): 8-bit attention. SageAttention's Triton kernel (the ``sageattention``
package, 1.0.x: pure Python and Triton, no CUDA build) computes ``Q K^T`` in INT8 (per-block scales, the keys
smoothed by their mean, which softmax does not see) and ``P V`` in fp16 with fp32 accumulation.

While a pipeline call runs (``context``), torch's SDPA is replaced by a function that sends each call SageAttention
takes (CUDA, no mask, no dropout, not causal, head size 64/96/128, fp16/bf16) to it, and every other call to torch's
own kernels; so diffusers' processors and the fused blocks alike use it without knowing. Under ``torch.compile``
(compile=true, or compile=auto once it switched) the kernel is the operator ``shardgen::sage_attention``, which
inductor calls rather than traces: compiled blocks use the 8-bit kernel too, and a run's samples, recorded as
made with it, are.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

log = logging.getLogger("shardgen.accel")

INSTALL = "pip install 'sageattention>=1.0.6,<2' (Triton kernels; needs a CUDA GPU of compute capability 8.0+)"
HEAD_DIMS = (64, 96, 128)


@functools.cache
def _sageattn():
    from sageattention import sageattn  # an optional package: imported when first asked for

    return sageattn


def unavailable_reason(device: torch.device | str | None) -> str | None:
    """Why SageAttention cannot run here (None when it can)."""
    if device is None or torch.device(device).type != "cuda":
        return "SageAttention runs on CUDA GPUs only"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if torch.cuda.get_device_capability(torch.device(device)) < (8, 0):
        return "SageAttention needs compute capability 8.0 or more"
    try:
        _sageattn()
    except Exception as e:  # not installed, or no Triton
        return f"sageattention does not import ({type(e).__name__}: {str(e)[:120]})"
    return None


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
          is_causal: bool = False, enable_gqa: bool = False) -> bool:
    """Whether this SDPA call goes to SageAttention."""
    return (attn_mask is None and dropout_p == 0.0 and not is_causal and not enable_gqa and q.is_cuda
            and q.dim() == 4 and q.shape[-1] in HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype and q.shape[1] == k.shape[1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
    """SageAttention of (batch, heads, tokens, head_dim) tensors, as SDPA's layout. The keys are smoothed here, out
    of place (the package would subtract their mean from the caller's tensor in place)."""
    k = k - k.mean(dim=2, keepdim=True)
    contiguous = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
    return _sageattn()(*contiguous, tensor_layout="HND", is_causal=False, sm_scale=scale, smooth_k=False)


@torch.library.custom_op("shardgen::sage_attention", mutates_args=())
def _operator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SageAttention as a torch operator, for compiled blocks (inductor does not trace into the package's Python);
    its body is ``attention``, looked up at each call (a CPU test replaces it)."""
    return attention(q, k, v, scale).contiguous()


@_operator.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)  # the package's output: q's shape, contiguous


def context():
    """Within it, torch SDPA calls SageAttention where it takes the call (``takes``), torch's kernels elsewhere."""
    from shardgen.speed.sdpa_route import kernel_context

    return kernel_context(sys.modules[__name__])
