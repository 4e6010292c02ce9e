"""A block's end and the next block's start in one pass: the chain of a transformer's repeated blocks.

Each FLUX.1, FLUX.2 and Qwen-Image block ends with a gated residual (``x + gate * y``) and the next block starts with
the adaLN LayerNorm + modulation of it. As two passes, the norm reads back the residual stream the residual has just
written. Eagerly on CUDA a family's fused blocks compute both in one pass (``fused_kernels.gated_ln_modulate_for``) for
their successor and hand the norm over, keyed by the very tensors the block returns: diffusers' loop passes them on as
they are, and anything between two blocks that makes new ones (a ControlNet's residual, a hook) leaves the successor
computing its norm itself. A hand-over is removed when the successor is called, used or not, so nothing outlives that
call.

``link`` records each block's successor when a family's fused forwards are enabled (``unlink`` when disabled);
``successor`` says whether it will take a hand-over; ``hand_over`` and ``take_over`` pass it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Callable, Iterable

import torch

_NEXT = "_shardgen_next_block"
_HANDOVER = "_shardgen_handover"


@dataclass
class Handover:
    """What a block computed for its successor's call."""

    keys: tuple
    """The tensors the block returned (compared by identity with the successor's inputs)."""
    call: tuple
    """The arguments the successor must be called with too (compared by identity: the conditioning, RoPE, ...)."""
    normed: Any
    """The successor's first norms, in whatever form its forward takes them."""


def link(chains: Iterable[Iterable[torch.nn.Module]]) -> None:
    """Record each block's successor, per chain (the blocks of one list, in the order the forward runs them)."""
    for chain in chains:
        for block, nxt in pairwise(chain):  # a weak link: a module attribute would register nxt as a submodule
            block.__dict__[_NEXT] = weakref.ref(nxt)


def unlink(chains: Iterable[Iterable[torch.nn.Module]]) -> None:
    """Remove what ``link`` and ``hand_over`` left on the blocks."""
    for chain in chains:
        for block in chain:
            block.__dict__.pop(_NEXT, None)
            block.__dict__.pop(_HANDOVER, None)


def successor(block: torch.nn.Module, takers: tuple[Callable, ...]) -> torch.nn.Module | None:
    """The block linked after ``block`` when its forward is one of ``takers`` bound to it (a forward a hook wraps, or
    a compiled one, takes nothing: it would leave a hand-over unread), else None. Call it eagerly only: it reads the
    module's dict, which a compiled graph must not."""
    ref = block.__dict__.get(_NEXT)
    nxt = ref() if ref is not None else None
    if nxt is None:
        return None
    forward = nxt.__dict__.get("forward")
    if getattr(forward, "__self__", None) is not nxt or getattr(forward, "__func__", None) not in takers:
        return None
    return nxt


def hand_over(nxt: torch.nn.Module, keys: tuple, call: tuple, normed: Any) -> None:
    """Leave ``normed`` for ``nxt``'s call with inputs ``keys`` and arguments ``call``."""
    nxt.__dict__[_HANDOVER] = Handover(keys, call, normed)


def take_over(block: torch.nn.Module, inputs: tuple, call: tuple) -> Any:
    """What the block before left for this call of ``block`` (``hand_over``) when it was made from these very
    ``inputs`` and ``call`` arguments, else None; removed either way."""
    if torch.compiler.is_compiling():  # before touching the module's dict: compiled blocks never hand over
        return None
    handover = block.__dict__.pop(_HANDOVER, None)
    if handover is None or len(handover.keys + handover.call) != len(inputs + call):
        return None
    return handover.normed if all(a is b for a, b in zip(handover.keys + handover.call, inputs + call)) else None
