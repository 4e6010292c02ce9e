"""What pins a model's weights beyond its source, for the run fingerprint: the embedded models' versions.

Apart from loader.py and tiny*.py (which import torch) so that a launch can compare its fingerprint with a run's,
and refuse, before torch is imported.
"""

from __future__ import annotations

from typing import Any

# Bump when the architecture or training strings change: old caches are then ignored.
TINY_VERSION = "v2"  # v2: the T5 tokenizer has a fixed vocabulary (v1 trained one differed per process)
TINY_VIDEO_VERSION = "v1"
TINY_QWEN_EDIT_VERSION = "v1"


def model_version(model_cfg: Any) -> str | None:
    """A version string for the fingerprint where the source alone does not pin the weights."""
    if model_cfg.source == "tiny":
        return f"tiny-{TINY_VERSION}"
    if model_cfg.source == "tiny_video":
        return f"tiny-video-{TINY_VIDEO_VERSION}"
    if model_cfg.source == "tiny_video_i2v":
        return f"tiny-video-i2v-{TINY_VIDEO_VERSION}"
    if model_cfg.source == "tiny_qwen_edit":
        return f"tiny-qwen-edit-{TINY_QWEN_EDIT_VERSION}"
    return model_cfg.revision
