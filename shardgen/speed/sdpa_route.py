"""torch SDPA routed, while a pipeline call runs, to an 8-bit attention kernel for the calls it takes (``sage``,
``fp8``): diffusers' processors and the families' fused blocks call ``F.scaled_dot_product_attention`` by name, so
they reach the kernel without knowing; every other call goes to torch's own kernels."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch


@contextlib.contextmanager
def routed_sdpa(takes: Callable[..., bool], kernel: Callable[..., torch.Tensor]):
    """Within it, an SDPA call ``takes(q, k, v, attn_mask=, dropout_p=, is_causal=, enable_gqa=)`` accepts goes to
    ``kernel(q, k, v, scale)``; torch's SDPA is back in place after it."""
    original = torch.nn.functional.scaled_dot_product_attention

    @functools.wraps(original)
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if takes(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                 enable_gqa=kw.get("enable_gqa", False)):
            return kernel(query, key, value, scale)
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
