"""The model family's own speed hooks (``ModelFamily.speed_hooks``, e.g. Qwen-Image's text-length buckets, real
RoPE and CFG batching in shardgen/speed/qwen.py), applied after the generic techniques."""

from __future__ import annotations

import importlib

from shardgen.families import family_of
from shardgen.speed.techniques import Step, Technique, register_technique


def family_speed_hooks(pipe):
    """The speed hooks the pipeline's family names (``ModelFamily.speed_hooks``), or None."""
    family = family_of(pipe)
    if family is None or not family.speed_hooks:
        return None
    module, _, name = family.speed_hooks.partition(":")
    return getattr(importlib.import_module(module), name)


def apply(step: Step) -> dict:
    """Run the family's hooks with the asked options; what they did."""
    hook = family_speed_hooks(step.pipe)
    return {} if hook is None else dict(hook(step.pipe, step.opts))


register_technique(Technique("family_hooks", 50, apply))
