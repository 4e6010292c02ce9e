"""``first_block_cache`` (opt-in, lossy): diffusers' First-Block-Cache (``FirstBlockCacheConfig(threshold)``):
when the first block's residual changed by less than ``threshold`` (relative) since the previous step, the
remaining blocks are skipped and their cached residual reused. The decision is taken for the whole batch, so a
sample's pixels then depend on which prompts share its batch. Its hooks come off before the other techniques
change the blocks (``release``) and go back on after them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardgen.pick import pick
from shardgen.speed.techniques import AccelError, AccelOptions
from shardgen.speed.techniques import Step, Technique, register_technique


@dataclass(frozen=True)
class FirstBlockCacheOptions:
    """The option this technique reads."""

    first_block_cache: float = 0.0
    """The relative-change threshold; 0 = off."""


def _cache_enabled(transformer) -> bool:
    return bool(getattr(transformer, "is_cache_enabled", False))


def enable_first_block_cache(transformer, threshold: float) -> None:
    """diffusers' First-Block-Cache on ``transformer`` at ``threshold``."""
    from diffusers.hooks import FirstBlockCacheConfig

    if not hasattr(transformer, "enable_cache"):
        raise AccelError(f"first_block_cache: {type(transformer).__name__} has no diffusers cache support; set 0")
    transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))


def disable_cache(transformer) -> None:
    """Remove diffusers' cache hooks, if any."""
    if _cache_enabled(transformer):
        transformer.disable_cache()


def validate(opts: AccelOptions, device=None) -> None:
    """AccelError for a threshold outside [0, 1)."""
    threshold = pick(FirstBlockCacheOptions, opts).first_block_cache
    if not 0.0 <= threshold < 1.0:
        raise AccelError(f"first_block_cache={threshold}: use 0 (off) or a threshold in (0, 1), e.g. 0.05-0.2")


def release(step: Step) -> dict:
    """The cache hooks off (compilation goes underneath them)."""
    disable_cache(step.transformer)
    return {}


def apply(step: Step) -> dict:
    """The cache hooks on again when asked."""
    threshold = pick(FirstBlockCacheOptions, step.opts).first_block_cache
    if threshold <= 0:
        return {}
    enable_first_block_cache(step.transformer, threshold)
    return {"first_block_cache": threshold}


register_technique(Technique(
    "first_block_cache", 30, apply, release=release, validate=validate,
    wanted=lambda opts: bool(opts.first_block_cache),
    lossy=lambda opts: {"first_block_cache": opts.first_block_cache} if opts.first_block_cache > 0 else {}))
