"""FlashAttention-4 behind torch SDPA's flash kernel, where the ``flash-attn-4`` package is installed.

torch (2.11 and later) can route SDPA's flash kernel to FA4 (``torch.nn.attention.activate_flash_attention_impl``):
its adapter imports a module, calls that module's ``_flash_attn_fwd`` and expects ``(out, lse)`` back, while
flash-attn-4's own returns more values. This module is the adapter's source: it passes FA4's first two through.
Once activated (``sdpa_backend=fa4``), every flash-kernel SDPA call of the process (diffusers' processors, the
fused blocks, compiled regions alike) runs FA4. ``sdpa_backend=auto`` never takes it: on an H200 it is faster
than cuDNN only at Wan's long videos and SD3.5's 64-wide heads, slower at the FLUX and Qwen-Image shapes, and
its import and just-in-time kernels cost a short job more than it gains (docs/performance.md).
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

log = logging.getLogger("shardgen.accel")

IMPL = "shardgen-FA4"
FA4_MODULE = "flash_attn.cute.interface"
INSTALL = "pip install flash-attn-4 (with torch>=2.11 and an SM90/SM100 GPU: H100, H200, B200)"


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why FA4 cannot run here (None when it can): no CUDA device of compute capability 9 or 10, a torch without
    the flash-attention hook, or the package missing."""
    if device is None or torch.device(device).type != "cuda":
        return "FA4 runs on CUDA GPUs only"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    if major not in (9, 10):
        return f"FA4 needs compute capability 9.x or 10.x; this GPU is {major}.x"
    try:
        from torch.nn.attention import _fa4, activate_flash_attention_impl  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} cannot route SDPA to FA4 (torch>=2.11 can)"
    try:
        _interface()
    except Exception as e:  # not installed, or its compiler libraries are missing
        return f"flash-attn-4 does not import ({type(e).__name__}: {str(e)[:120]})"
    return None


@functools.cache
def _interface():
    return importlib.import_module(FA4_MODULE)


def _flash_attn_fwd(q, k, v, **kwargs):
    """FA4's forward, returning the (out, lse) pair torch's adapter unpacks. A dense call FA4 does not take (a
    head size it has no kernel for) runs torch's memory-efficient kernel instead, as SDPA itself falls back
    from one kernel to the next: torch routes every flash-eligible call here once FA4 is active."""
    try:
        result = _interface()._flash_attn_fwd(q, k, v, **kwargs)
    except Exception as e:
        if not _efficient_can_take(kwargs):
            raise
        _warn_fallback(tuple(q.shape), e)
        return _efficient_fwd(q, k, v, **kwargs)
    return result[0], result[1]


def _efficient_can_take(kwargs) -> bool:
    return all(kwargs.get(key) is None for key in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table",
                                                   "window_size_left", "window_size_right"))


_FALLBACK_SHAPES: set[tuple] = set()


def _warn_fallback(shape: tuple, error: Exception) -> None:
    if shape in _FALLBACK_SHAPES:  # once per shape: it is called on every attention call
        return
    _FALLBACK_SHAPES.add(shape)
    log.warning("attention: FlashAttention-4 does not take %s (%s: %s); torch's memory-efficient kernel runs it",
                shape, type(error).__name__, str(error)[:160])


def _efficient_fwd(q, k, v, softmax_scale=None, causal=False, out=None, **_):
    """(out, lse) for (batch, tokens, heads, dim) inputs from torch's memory-efficient kernel."""
    o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, scale=softmax_scale)
    o = o.transpose(1, 2)
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse[..., :q.shape[1]]


def _flash_attn_bwd(*args, **kwargs):
    """FA4's backward, unchanged (torch's adapter checks that it exists; inference never calls it)."""
    return _interface()._flash_attn_bwd(*args, **kwargs)


def active() -> bool:
    """True when this process's SDPA flash kernel is FA4 (through this module)."""
    try:
        from torch.nn.attention import current_flash_attention_impl
    except ImportError:
        return False
    return current_flash_attention_impl() == IMPL


def activate() -> None:
    """Route the process's SDPA flash kernel to FA4 (a dispatcher registration: process-wide until ``restore``)."""
    if active():
        return
    from torch.nn.attention import _fa4, activate_flash_attention_impl, register_flash_attention_impl

    register_flash_attention_impl(IMPL, register_fn=functools.partial(_fa4.register_flash_attention_fa4,
                                                                      module_path=__name__))
    activate_flash_attention_impl(IMPL)
    log.info("attention: SDPA's flash kernel is FlashAttention-4 in this process")


def restore() -> None:
    """Give SDPA its own flash kernel back (no-op when FA4 is not active)."""
    if active():
        from torch.nn.attention import restore_flash_attention_impl

        restore_flash_attention_impl()
