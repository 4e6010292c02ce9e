"""Qwen2.5-VL's processor for images alone: what Qwen-Image-Edit's text encoding calls (``processor(text=...,
images=...)``), without the video processor transformers' ``Qwen2VLProcessor`` takes.

transformers 5 makes every ``Qwen2VLProcessor`` hold a video processor, and its video processors need torchvision,
which shardgen does not depend on (no torchvision build for the CPU torch here); the edit pipelines never pass a
video. This subclass has the same text and image processing, token ids and saved files, minus the video part, so it
is built, saved and loaded (``from_pretrained`` on a real ``processor/`` folder too) without torchvision.
"""

from __future__ import annotations

from transformers import ProcessorMixin, Qwen2VLProcessor

__all__ = ["ImageOnlyQwen2VLProcessor", "ProcessorMixin"]  # diffusers finds the load method through ProcessorMixin


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer only (its sub-processors are read from the
    ``__init__`` signature: no video processor is built, checked, saved or loaded)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
