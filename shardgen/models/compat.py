"""What a diffusers pipeline needs to run here that diffusers itself leaves out."""

from __future__ import annotations

import sys
from typing import Any


def guard_ftfy(cls: Any) -> None:
    """diffusers 0.42's Wan image-to-video prompt cleaning calls ftfy (an optional dependency) without checking it is
    installed, where its text-to-video pipeline checks: without ftfy, ``cls``'s module uses the checked cleaning (the
    same text otherwise). A no-op for every other pipeline class."""
    from diffusers.utils import is_ftfy_available

    module = sys.modules.get(cls.__module__)
    if is_ftfy_available() or module is None or hasattr(module, "ftfy") or not hasattr(module, "basic_clean"):
        return
    from diffusers.pipelines.wan import pipeline_wan

    module.basic_clean = pipeline_wan.basic_clean
