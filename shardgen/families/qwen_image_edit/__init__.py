"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen/Qwen-Image-Edit edits each row's input image as the prompt says
(prompts.row_settings=[image]); and the embedded tiny model of that pipeline (model=tiny_qwen_edit).

Qwen-Image's components and sizes (shardgen/families/qwen_image/) plus the Qwen2.5-VL processor: the input image
enters twice. Its VAE latents join the sample's in the transformer's image stream (``img_shapes`` has two entries a
sample), and the vision tower sees it through the processor, its tokens (~1369 at 1024x1024) part of the text the
transformer attends to. The pipeline needs an image (``__call__`` reads its size first), and resizes it to about
1024x1024 pixels at its aspect ratio whatever the sample's size (``calculate_dimensions``): ``input_image_area``.
A list of images, one a sample, batches (the images of a call share its size), so rows are not batched by image.
The speed hooks are Qwen-Image's (shardgen/families/qwen_image/speed.py): they see a longer text and a longer image
stream. This folder: the spec (here) and the tiny model's builder (tiny.py).
"""

from __future__ import annotations

import dataclasses

from shardgen.families.base import ComponentSpec, DummyModel, TinyModel, register
from shardgen.families.qwen_image import QWEN_IMAGE

TINY_VERSION = "v1"  # the tiny model's cache name and fingerprint; bump when its build changes


def image_only_processor() -> type:
    """Qwen2.5-VL's processor without its video part (shardgen/models/qwen_vl.py: no torchvision needed)."""
    from shardgen.models.qwen_vl import ImageOnlyQwen2VLProcessor

    return ImageOnlyQwen2VLProcessor


def tiny_transformer_config() -> dict:
    """The tiny edit model's transformer config (tiny.py)."""
    from shardgen.families.qwen_image_edit.tiny import TRANSFORMER_CONFIG

    return TRANSFORMER_CONFIG


def tiny_path(cache_dir=None):
    """The tiny edit model's directory, built on first use (tiny.py)."""
    from shardgen.families.qwen_image_edit.tiny import tiny_qwen_edit_model_path

    return tiny_qwen_edit_model_path(cache_dir)


TINY_QWEN_EDIT = TinyModel(source="tiny_qwen_edit", version=f"tiny-qwen-edit-{TINY_VERSION}",
                           transformer_class="QwenImageTransformer2DModel",
                           transformer_config=tiny_transformer_config, path=tiny_path)

# Qwen2.5-VL-7B-Instruct's processor (Qwen/Qwen-Image-Edit processor/): 14-pixel patches merged 2x2, between
# 56x56 and 12845056 pixels; the tokenizer is the pipeline's own. Its image-only form (shardgen/models/qwen_vl.py):
# transformers' own needs torchvision for a video processor the pipeline never uses
QWEN_VL_IMAGE_PROCESSOR = dict(
    cls="Qwen2VLImageProcessor", min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
    merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
QWEN_VL_PROCESSOR = ComponentSpec("processor", image_only_processor, dict(
    image_processor=QWEN_VL_IMAGE_PROCESSOR, tokenizer="tokenizer"))

# Qwen/Qwen-Image-Edit: Qwen-Image's transformer, VAE, text encoder, tokenizer and scheduler configs
_QWEN_IMAGE_EDIT = dict(QWEN_IMAGE.dummies["qwen_image"].components, processor=QWEN_VL_PROCESSOR)

QWEN_IMAGE_EDIT = register(dataclasses.replace(
    QWEN_IMAGE, name="Qwen-Image-Edit", pipeline="QwenImageEditPipeline", input_image="required",
    image_in_sequence=True, input_image_area=1024 * 1024, cuts_text=False,
    own_components={"processor": image_only_processor},
    tiny_models=(TINY_QWEN_EDIT,),
    # encode_prompt needs the input image too, which strategy=device_map's encoding does not pass
    encode_outputs=None,
    dummies={"qwen_image_edit": DummyModel("Qwen-Image-Edit", _QWEN_IMAGE_EDIT)},
    # measured for Qwen-Image text-to-image, not for the edit model
    compiled_speedup=None))
