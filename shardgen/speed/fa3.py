"""FlashAttention-3's bf16/fp16 forward kernel (the ``fa3-fwd`` package): lossless attention, one of the kernels
``sdpa_backend=auto`` times where the package is installed, or asked for by name (``sdpa_backend=fa3``).

On an H100 it is 7% faster than cuDNN's fused attention at FLUX.1-dev's and FLUX.2-dev's shapes and 15% at
Qwen-Image's (benchmarks/results/2026-12-05-h100-fa3-fp8-0a6746f): the warp-specialised Hopper pipeline that its
float8 sibling (``fa3_fp8.py``) runs, on the inputs as they are. Exact up to bf16 rounding, like any of torch's
fused kernels. FA3 reads (batch, tokens, heads, dim) with any batch, token and head strides: SDPA's (batch, heads,
tokens, dim) tensors go in as transposed views (no copy), and the caller gets SDPA's view of FA3's output.

While a pipeline call runs (``context``), torch's SDPA is replaced by a function that sends each call the kernel
takes (``takes``: CUDA, no mask, no dropout, not causal, no GQA, a head size FA3 has) to it, and every other call to
torch's kernels. Under ``torch.compile`` it is the operator ``shardgen::fa3_attention``.
"""

from __future__ import annotations

import math
import sys

import torch

from shardgen.speed.fa3_fp8 import HEAD_DIMS, INSTALL, fa3_forward, unavailable_reason  # noqa: F401 (re-exported)
from shardgen.speed.sdpa_route import kernel_context, plain_attention, tokens_major_operator


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call) -> bool:
    """Whether this SDPA call (its keyword arguments ``call``) goes to FA3's kernel."""
    return plain_attention(q, k, v, HEAD_DIMS, **call)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FA3's attention of (batch, heads, tokens, head_dim) tensors, as SDPA (no mask, not causal): SDPA's view of
    FA3's (batch, tokens, heads, head_dim) output."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = fa3_forward()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)[0]
    return out.transpose(1, 2)


_operator = tokens_major_operator("fa3_attention", __name__)  # compiled blocks call this

def context():
    """Within it, torch SDPA calls FA3's kernel where it takes the call (``takes``), torch's kernels elsewhere."""
    return kernel_context(sys.modules[__name__])
