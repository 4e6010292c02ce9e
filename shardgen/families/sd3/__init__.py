"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): Stable Diffusion 3.5 Large.

Three text encoders: CLIP-L and OpenCLIP bigG (77 tokens each, their pooled outputs concatenated to 2048) and
T5-XXL (``model.max_sequence_length`` tokens); the joint attention sees CLIP's 77 tokens (padded to T5's width)
followed by the T5 tokens, so context parallelism splits 77 + max_sequence_length text tokens. The VAE
downscales 8x into 16 channels and the MMDiT patches 2x2: 16 pixels a side per image token. Classifier-free
guidance is the pipeline's own (``guidance_scale``: cond and uncond batched in one transformer call).
"""

from __future__ import annotations

from shardgen.families.base import ComponentSpec, DummyModel, ModelFamily, register
from shardgen.families.flux import T5_XXL, vae16


def _clip(hidden: int, ffn: int, layers: int, heads: int, act: str) -> ComponentSpec:
    return ComponentSpec("transformers", "CLIPTextModelWithProjection", dict(
        vocab_size=49408, hidden_size=hidden, intermediate_size=ffn, projection_dim=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1), "CLIPTextConfig")


# --- Stable Diffusion 3.5 Large (stabilityai/stable-diffusion-3.5-large) ----------------------------------------
_SD35_LARGE = {
    "transformer": ComponentSpec("diffusers", "SD3Transformer2DModel", dict(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
        pos_embed_max_size=192, dual_attention_layers=(), qk_norm="rms_norm")),
    "vae": vae16(scaling_factor=1.5305, shift_factor=0.0609),
    "text_encoder": _clip(768, 3072, 12, 12, "quick_gelu"),   # openai/clip-vit-large-patch14
    "text_encoder_2": _clip(1280, 5120, 32, 20, "gelu"),      # laion CLIP-ViT-bigG-14
    "text_encoder_3": T5_XXL,
    "tokenizer": ComponentSpec("tokenizer", "clip", dict(model_max_length=77)),
    "tokenizer_2": ComponentSpec("tokenizer", "clip", dict(model_max_length=77)),
    "tokenizer_3": ComponentSpec("tokenizer", "t5", dict(model_max_length=512)),
    "scheduler": ComponentSpec("diffusers", "FlowMatchEulerDiscreteScheduler", dict(
        num_train_timesteps=1000, shift=3.0)),
}

SD3 = register(ModelFamily(
    name="Stable Diffusion 3", pipeline="StableDiffusion3Pipeline", text_tokens="max_sequence_length",
    text_prefix_tokens=77,
    # encode_prompt computes the unconditional embeddings too (guidance_scale > 1 by default)
    encode_outputs=("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                    "negative_pooled_prompt_embeds"),
    dummies={"sd35_large": DummyModel("Stable Diffusion 3.5 Large", _SD35_LARGE)}, hidden_default=2432,
    # diffusers' SD3 transformer lists no _repeated_blocks; its 38 joint blocks are one class
    repeated_blocks={"SD3Transformer2DModel": ("JointTransformerBlock",)}))
