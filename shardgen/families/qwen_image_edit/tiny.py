"""The embedded edit model: a tiny Qwen-Image-Edit pipeline built offline (``model=tiny_qwen_edit``).

Like ``model=tiny`` (shardgen/families/flux/tiny.py): random weights from a fixed seed, saved with ``save_pretrained`` into
``$SHARDGEN_CACHE`` and always loaded back with ``from_pretrained``. Every component is the real class, only narrow:
``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage`` (8x downscale and 2x2 patches: Qwen-Image's 16 pixels a
token), a ``Qwen2_5_VLForConditionalGeneration`` text encoder with its vision tower, the Qwen2-VL processor (its
image-only form, shardgen/models/qwen_vl.py) and the dummy Qwen tokenizer (shardgen/models/dummy.py, its special
tokens at the first ids: the embedding stays small; the config's vision token ids are the tokenizer's).

The pipeline resizes every input image to about 1024x1024 whatever the sample's size, so each sample's VAE encodes a
megapixel image and the transformer sees its 4096 tokens: about a second a sample on a CPU in float64, most of it the
VAE's attention over the 128x128 latent. The processor keeps the vision tower's view small (``max_pixels``: 16 image
tokens in the text).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardgen.families.qwen_image_edit import TINY_VERSION as TINY_QWEN_EDIT_VERSION  # the cache's name; bumped there
from shardgen.models.tiny import cached_build

TEXT_DIM = 32
TRANSFORMER_CONFIG = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=TEXT_DIM, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
# no residual blocks in the encoder and 2 channels: its cost is the megapixel input, not the width
VAE_CONFIG = dict(base_dim=2, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=0, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)
# Qwen2.5-VL's image processing (shardgen/families/qwen_image_edit/) at most 128x128 pixels: 16 tokens
IMAGE_PROCESSOR_CONFIG = dict(min_pixels=3136, max_pixels=128 * 128, patch_size=14, temporal_patch_size=2,
                              merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
                              image_std=[0.26862954, 0.26130258, 0.27577711])


def tiny_qwen_edit_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny Qwen-Image-Edit pipeline, building it once if it is missing."""
    return cached_build(f"tiny-qwen-edit-{TINY_QWEN_EDIT_VERSION}", build_tiny_qwen_edit_pipeline, cache_dir)


def _text_encoder(tokenizer):
    """A one-layer Qwen2.5-VL whose vision tower (one block, full attention) feeds its text width; the vision token
    ids are ``tokenizer``'s."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                   tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                    "<|vision_end|>"])))
    eos = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=37, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=eos[0],
                         eos_token_id=eos[1], tie_word_embeddings=True),
        vision_config=dict(depth=1, hidden_size=TEXT_DIM, intermediate_size=37, num_heads=2,
                           out_hidden_size=TEXT_DIM, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=[0]),
        tie_word_embeddings=True, **ids)
    return Qwen2_5_VLForConditionalGeneration(config)


def _scaled_init(module: torch.nn.Module, gain: float) -> torch.nn.Module:
    """``module``'s convolutions and linear layers drawn again from normal(0, gain / sqrt(fan_in)). torch's default
    init shrinks the signal at each layer of these narrow nets: with it the input image and the prompt moved no
    pixel (under 1e-5) and the seed a few levels. With these gains (measured, 64x64, 2 steps) another image moves
    the pixels ~23 levels on average, another prompt ~2, another seed ~46."""
    import math

    for layer in module.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)):
            torch.nn.init.normal_(layer.weight, 0.0, gain / math.sqrt(layer.weight[0].numel()))
    return module


def build_tiny_qwen_edit_pipeline(seed: int = 0):
    """Build the tiny Qwen-Image-Edit pipeline in memory (random weights from ``seed``)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2VLImageProcessorPil

    from shardgen.models.dummy import train_chat_tokenizer
    from shardgen.models.qwen_vl import ImageOnlyQwen2VLProcessor

    tokenizer = train_chat_tokenizer("qwen", 1024, real_ids=False)
    # the image processor without torchvision's backend: the same pixels on every machine
    processor = ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR_CONFIG),
                                          tokenizer=tokenizer)
    with torch.random.fork_rng(devices=[]):  # a fixed seed without disturbing the caller's RNG
        torch.manual_seed(seed)
        text_encoder = _text_encoder(tokenizer)
        transformer = _scaled_init(QwenImageTransformer2DModel(**TRANSFORMER_CONFIG), 1.5)
        vae = _scaled_init(AutoencoderKLQwenImage(**VAE_CONFIG), 2.0)
    # Qwen-Image's scheduler config (shardgen/families/qwen_image/)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    pipe = QwenImageEditPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                 processor=processor, transformer=transformer)
    # saved as the real model names it (transformers' class); shardgen loads it with its own (the family's
    # own_components), as it loads the real model's
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    return pipe
