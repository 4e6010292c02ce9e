"""Attention where each sample's valid keys are a prefix of its key sequence: unmasked calls, no mask.

SDPA with a key-padding mask is off every fast path: on an H200, cuDNN ran Qwen-Image's joint attention (batch
4, 24 heads, 4096 image + 128 text tokens) at 2.1-2.4 ms per call with diffusers' (B, 1, 1, S) boolean mask,
against 1.3-1.4 ms for the same shapes unmasked; flash refuses masks, the memory-efficient kernel took 6.8 ms
(benchmarks/probe_attention.py; docs/performance.md). When the keys are ordered so that each sample's valid
ones come first, the masked attention is, exactly, one unmasked call per run of consecutive samples with the
same number of valid keys, each on a view of the keys cut to that number: 1.7-1.8 ms when every length
differs, 1.3-1.4 ms when they are all equal (the unconditional branch of true CFG, whose negative prompt is the
same for the whole batch; full text buckets). Only the summation order inside the kernel changes.

``prefix_attention`` is a custom op so that ``torch.compile`` treats it as one opaque call: the lengths
differ from batch to batch and must not become part of the compiled graph (no recompilation for them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(start, stop, length) of each run of consecutive equal lengths."""
    out: list[tuple[int, int, int]] = []
    for i, n in enumerate(lengths):
        if out and out[-1][2] == n:
            out[-1] = (out[-1][0], i + 1, n)
        else:
            out.append((i, i + 1, n))
    return out


@torch.library.custom_op("shardgen::prefix_attention", mutates_args=())
def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
                     offset: int) -> torch.Tensor:
    """softmax(q kᵀ/√d) v where sample i sees only its first ``valid[i] + offset`` keys and values.

    ``query`` (B, Sq, H, D), ``key``/``value`` (B, Sk, H, D) (diffusers' layout); ``valid`` a CPU integer tensor
    of B lengths (a host value: reading it costs no device synchronisation); the result (B, Sq, H, D),
    contiguous. The SDPA kernel is the one the surrounding ``sdpa_kernel`` context picks."""
    lengths = [int(n) + offset for n in valid.tolist()]
    parts = runs(lengths)
    out = None
    for start, stop, n in parts:
        o = F.scaled_dot_product_attention(query[start:stop].transpose(1, 2), key[start:stop, :n].transpose(1, 2),
                                           value[start:stop, :n].transpose(1, 2)).transpose(1, 2)
        if len(parts) == 1 and o.is_contiguous():
            return o  # one run (equal lengths): the kernel's own output, no copy
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        out[start:stop].copy_(o)
    if out is None:  # an empty batch
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    return out


@prefix_attention.register_fake
def _(query, key, value, valid, offset):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def prefix_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    """The number of leading ones of each row of a (B, S) key mask, as a CPU int64 tensor; None when some row
    is not a prefix of ones (padding in the middle: the masked path must run). Copies the mask to the host
    (a device synchronisation): callers cache the answer per mask."""
    m = mask.detach().to("cpu", torch.bool)
    lengths = m.sum(1)
    prefix = torch.arange(m.shape[1])[None, :] < lengths[:, None]
    return lengths.to(torch.int64) if bool((m == prefix).all()) else None
