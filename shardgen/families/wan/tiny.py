"""The embedded video model: a tiny Wan 2.1 text-to-video pipeline built offline (``model=tiny_video``).

Like ``model=tiny`` (shardgen/families/flux/tiny.py): its fixed-vocabulary T5 tokenizer, random weights
from a fixed seed, saved with ``save_pretrained`` into ``$SHARDGEN_CACHE`` and always loaded back
with ``from_pretrained``. Every component is the real Wan class (``WanTransformer3DModel`` with its
``_cp_plan``, ``UMT5EncoderModel``, ``AutoencoderKLWan``, the UniPC flow scheduler Wan ships with),
only narrow, so the whole video path (frames, mp4 shards, context parallel) runs on a CPU in seconds.

The VAE keeps Wan's geometry: 8x spatial and 4x temporal compression (``num_frames = 4k + 1``) and a
(1, 2, 2) transformer patch, so 9 frames of 64x64 are 3 latent frames of 8x8 = 48 video tokens.
The transformer has 4 heads, so Ulysses up to degree 4 divides them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardgen.families.wan import TINY_VERSION as TINY_VIDEO_VERSION  # the cache's name; bumped there
from shardgen.models.tiny import cached_build, t5_style_tokenizer

TEXT_DIM = 32
TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=64)
VAE_CONFIG = dict(base_dim=4, decoder_base_dim=2, z_dim=16, dim_mult=[1, 1, 2, 2], num_res_blocks=1,
                  temperal_downsample=[False, True, True])


def tiny_video_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny Wan pipeline, building it once if it is missing."""
    return cached_build(f"tiny-wan-{TINY_VIDEO_VERSION}", build_tiny_video_pipeline, cache_dir)


def build_tiny_video_pipeline(seed: int = 0):
    """Build the tiny Wan text-to-video pipeline in memory (random weights from ``seed``)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_style_tokenizer()
    with torch.random.fork_rng(devices=[]):  # a fixed seed without disturbing the caller's RNG
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=TEXT_DIM, d_ff=37, d_kv=8, num_layers=2, num_heads=4))
        transformer = WanTransformer3DModel(**TRANSFORMER_CONFIG)
        vae = AutoencoderKLWan(**VAE_CONFIG)
    # Wan's own scheduler config (Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler)


# image-to-video: the noisy latents, the input image's latents (the first frame, then zeros) and the 4-channel
# first-frame mask are concatenated on the channels (16 + 16 + 4), as in Wan 2.2 I2V (no CLIP image encoder)
I2V_TRANSFORMER_CONFIG = TRANSFORMER_CONFIG | dict(in_channels=36)


def tiny_video_i2v_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny Wan image-to-video pipeline, building it once if it is missing."""
    return cached_build(f"tiny-wan-i2v-{TINY_VIDEO_VERSION}", build_tiny_video_i2v_pipeline, cache_dir)


def build_tiny_video_i2v_pipeline(seed: int = 0):
    """Build the tiny Wan image-to-video pipeline in memory (``WanImageToVideoPipeline``: the text-to-video model's
    components, its transformer taking the input image's latents too; random weights from ``seed``)."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    t2v = build_tiny_video_pipeline(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        transformer = WanTransformer3DModel(**I2V_TRANSFORMER_CONFIG)
    return WanImageToVideoPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
                                   scheduler=t2v.scheduler, transformer=transformer)
