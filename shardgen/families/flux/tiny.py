"""The embedded default model (``model=tiny``): a tiny FLUX.1 pipeline built offline.

A CLIP tokenizer trained on a few strings, a T5 one with a fixed vocabulary (the same on every machine), random
weights from a fixed seed (shardgen/models/tiny.py builds and caches it). It generates noise-like images in
milliseconds on a CPU.

The VAE has four blocks (downscale 8, like FLUX.1's), so image sizes and token counts follow the real model's
geometry: 1024x1024 -> 128x128 latents -> 4096 image tokens.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from shardgen.families.flux import TINY_VERSION  # the cache's name; bumped there
from shardgen.models.tiny import cached_build, train_tokenizers

TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8), guidance_embeds=True,
)


def tiny_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny pipeline, building it once if it is missing."""
    return cached_build(f"tiny-flux-{TINY_VERSION}", build_tiny_pipeline, cache_dir)


def build_tiny_pipeline(seed: int = 0):
    """Build the tiny FLUX pipeline in memory (random weights from ``seed``)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with tempfile.TemporaryDirectory() as tmp:
        clip_tok, t5_tok = train_tokenizers(Path(tmp))
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=clip_tok.vocab_size + 2, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, projection_dim=32, max_position_embeddings=77))
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4))
        transformer = FluxTransformer2DModel(**TRANSFORMER_CONFIG)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4,
            use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=0.3611)
    finally:
        torch.random.set_rng_state(gen_state)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer, vae=vae)


def save_tiny_lora(path: str | os.PathLike, seed: int = 1, rank: int = 4,
                   targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0"), **config: object) -> Path:
    """Save a LoRA for the tiny transformer to the .safetensors file ``path`` (diffusers' format, made with peft:
    random A and B from ``seed``, so it visibly changes the images). ``config`` overrides TRANSFORMER_CONFIG: an
    adapter for another model's shapes. Returns ``path``."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        transformer = FluxTransformer2DModel(**(TRANSFORMER_CONFIG | config))
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets),
                                           init_lora_weights=False))
    finally:
        torch.random.set_rng_state(gen_state)
    layers = get_peft_model_state_dict(transformer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # diffusers' own layout (FluxPipeline.save_lora_weights): the component's name, then peft's keys
    save_file({f"transformer.{k}": v.contiguous() for k, v in layers.items()}, str(path))
    return path
