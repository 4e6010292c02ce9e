"""The transformer's repeated blocks: what regional compilation, fp8 and the per-model speed hooks work on."""

from __future__ import annotations

from types import ModuleType

import torch

from shardgen.speed.handdown import declared_fused_blocks, declared_repeated_blocks


def plain_forward(module: torch.nn.Module) -> bool:
    """True when ``module.forward`` is its class's own method (diffusers leaves the bound method as an instance
    attribute after removing its hooks; that counts as plain): no hook or replacement wraps it."""
    f = module.__dict__.get("forward")
    return f is None or (getattr(f, "__self__", None) is module and getattr(f, "__func__", None) is type(module).forward)


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks whose class the transformer lists in ``_repeated_blocks`` (FLUX.1: 19 double-stream + 38
    single-stream blocks) or its family declares for it (Stable Diffusion 3's ``JointTransformerBlock``), in module
    order."""
    names = tuple(getattr(transformer, "_repeated_blocks", None) or declared_repeated_blocks(type(transformer).__name__))
    return [m for m in transformer.modules() if type(m).__name__ in names]


def fused_blocks(transformer: torch.nn.Module) -> ModuleType | None:
    """The module of fused block forwards the transformer's family declares (FLUX.1: shardgen/families/flux/fused.py,
    FLUX.2: shardgen/families/flux2/fused.py), or None."""
    return declared_fused_blocks(type(transformer).__name__)
