"""The model family's own speed hooks (``ModelFamily.speed_hooks``, e.g. Qwen-Image's text-length buckets, real
RoPE and CFG batching in shardgen/families/qwen_image/speed.py) and its exact encoding hooks (``encode_hooks``, e.g.
FLUX.2's encoder cut in shardgen/families/flux2/speed.py), applied after the generic techniques; the family hands
them down (shardgen/speed/handdown.py)."""

from __future__ import annotations

from shardgen.speed.handdown import family_of
from shardgen.speed.techniques import Step, Technique, register_technique


def family_speed_hooks(pipe):
    """The speed hooks of the pipeline's family (``ModelFamily.speed_hooks``), or None."""
    family = family_of(pipe)
    return None if family is None else family.speed_hooks


def apply(step: Step) -> dict:
    """Run the family's hooks with the asked options (its exact encoding hooks first: on whatever the options); what
    they did."""
    family = family_of(step.pipe)
    if family is None:
        return {}
    done = {} if family.encode_hooks is None else dict(family.encode_hooks(step.pipe))
    return done if family.speed_hooks is None else {**done, **family.speed_hooks(step.pipe, step.opts)}


register_technique(Technique("family_hooks", 50, apply))
