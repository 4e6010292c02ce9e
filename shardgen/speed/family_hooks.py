"""The model family's own speed hooks (``ModelFamily.speed_hooks``, e.g. Qwen-Image's text-length buckets, real
RoPE and CFG batching in shardgen/families/qwen_image/speed.py), applied after the generic techniques; the family
hands them down (shardgen/speed/handdown.py)."""

from __future__ import annotations

from shardgen.speed.handdown import family_of
from shardgen.speed.techniques import Step, Technique, register_technique


def family_speed_hooks(pipe):
    """The speed hooks of the pipeline's family (``ModelFamily.speed_hooks``), or None."""
    family = family_of(pipe)
    return None if family is None else family.speed_hooks


def apply(step: Step) -> dict:
    """Run the family's hooks with the asked options; what they did."""
    hook = family_speed_hooks(step.pipe)
    return {} if hook is None else dict(hook(step.pipe, step.opts))


register_technique(Technique("family_hooks", 50, apply))
