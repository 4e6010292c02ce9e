"""torch SDPA routed, while a pipeline call runs, to an 8-bit attention kernel for the calls it takes (``sage``,
``fp8``): diffusers' processors and the families' fused blocks call ``F.scaled_dot_product_attention`` by name, so
they reach the kernel without knowing; every other call goes to torch's own kernels. And the kernels' self-check:
each is compared with exact attention on the rank's own GPU before any sample (``self_check``)."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import torch


@contextlib.contextmanager
def routed_sdpa(takes: Callable[..., bool], kernel: Callable[..., torch.Tensor],
                operator: Callable[..., torch.Tensor]):
    """Within it, an SDPA call ``takes(q, k, v, attn_mask=, dropout_p=, is_causal=, enable_gqa=)`` accepts goes to
    ``kernel(q, k, v, scale)`` in eager code, and while dynamo traces to ``operator(q, k, v, scale)``, the kernel as
    a custom torch operator with the scale resolved (inductor calls it rather than tracing the kernel's Python, so
    compiled blocks use the same attention); torch's SDPA is back in place after it."""
    original = torch.nn.functional.scaled_dot_product_attention

    @functools.wraps(original)
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if takes(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                 enable_gqa=kw.get("enable_gqa", False)):
            if torch.compiler.is_compiling():
                return operator(query, key, value, 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale))
            return kernel(query, key, value, scale)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: tuple[int, ...], attn_mask=None,
                    dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> bool:
    """Whether an SDPA call is what the float8 kernels compute: CUDA, no mask, no dropout, not causal, no GQA, 4-D
    fp16/bf16 tensors of one head size in ``head_dims`` with contiguous rows, queries, keys and values of one batch
    and head count, keys and values of one length."""
    return (attn_mask is None and dropout_p == 0.0 and not is_causal and not enable_gqa and q.is_cuda
            and q.dim() == k.dim() == v.dim() == 4 and q.shape[-1] in head_dims and v.shape[-1] == q.shape[-1]
            and k.shape[-1] == q.shape[-1] and q.dtype in (torch.float16, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype and q.shape[:2] == k.shape[:2] == v.shape[:2]
            and k.shape[2] == v.shape[2] and all(t.stride(-1) == 1 for t in (q, k, v)))


def tokens_major_operator(name: str, module: str):
    """The torch operator ``shardgen::NAME(q, k, v, scale)`` for compiled blocks (inductor does not trace into it):
    ``sys.modules[module].attention`` (looked up at each call: a CPU test replaces it), its output in a kernel's
    (batch, tokens, heads, dim) memory seen as SDPA's (batch, heads, tokens, dim)."""
    import sys

    @torch.library.custom_op(f"shardgen::{name}", mutates_args=())
    def operator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return sys.modules[module].attention(q, k, v, scale).transpose(1, 2).contiguous().transpose(1, 2)

    @operator.register_fake
    def _(q, k, v, scale):
        b, h, n, d = q.shape
        return q.new_empty(b, n, h, d).transpose(1, 2)

    return operator


_ROUTED: list = []
"""The modules of the 8-bit kernels routed now (``kernel_context``), the innermost last."""


@contextlib.contextmanager
def kernel_context(module):
    """``routed_sdpa`` for an 8-bit kernel's module: its ``takes``, ``attention`` and ``_operator``, each looked up
    at each call (a test may replace any of them); and the module is the one ``parts_attention`` asks."""
    _ROUTED.append(module)
    try:
        with routed_sdpa(lambda *a, **kw: module.takes(*a, **kw),
                         lambda q, k, v, scale: module.attention(q, k, v, scale),
                         lambda q, k, v, scale: module._operator(q, k, v, scale)):
            yield
    finally:
        _ROUTED.remove(module)


def parts_attention(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor],
                    cos: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The routed kernel's attention straight from a fused processor's projections (``rms_rope_attention(qs, ks, vs,
    wq, wk, cos, sin, eps)``: RMSNorm + RoPE in the kernel's own input pass; fa3_fp8 has one) when it takes these,
    else None: the processor then calls ``rms_rope`` and SDPA."""
    if not _ROUTED:
        return None
    module = _ROUTED[-1]
    take = getattr(module, "takes_parts", None)
    return module.rms_rope_attention if take is not None and take(qs, ks, vs, cos) else None


SELF_CHECK_BOUND = 0.08  # relative RMS against exact attention on random inputs: fp8's method costs ~0.035
_CHECKED: dict[tuple, float] = {}


def self_check(name: str, kernel: Callable[..., torch.Tensor], device: torch.device | str,
               head_dims: tuple[int, ...], exact: Callable[..., torch.Tensor] | None = None) -> float:
    """``kernel(q, k, v)``'s largest relative error against torch's exact attention over ``head_dims`` (those of the
    run's model: each is a kernel of its own to compile), on random inputs with a part-filled tile, on ``device``
    (NaN counts as infinite). The sdpa technique refuses the kernel past ``SELF_CHECK_BOUND``: a GPU or Triton
    version that miscompiles it stops the run before any sample, not after. Cached per kernel ``name``, device and
    head size. ``exact(q, k, v)``: what the kernel approximates, when not plain attention of its inputs."""
    worst = 0.0
    for dim in head_dims:
        key = (name, str(torch.device(device)), dim)
        if key not in _CHECKED:
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, 2, 300, dim, device=device, generator=g, dtype=torch.bfloat16)
                       for _ in range(3))
            want = (exact(q, k, v) if exact is not None
                    else torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()))
            err = ((kernel(q, k, v).float() - want).norm() / want.norm()).item()
            _CHECKED[key] = err if err == err else float("inf")  # NaN: as bad as it gets
        worst = max(worst, _CHECKED[key])
    return worst
