"""Qwen-Image (``QwenImagePipeline``): a Qwen2.5-VL text encoder whose text is trimmed to the batch's longest
prompt (so the text token count varies per batch), true CFG.

This folder: the spec (here), the speed hooks (speed.py: text-length buckets, real RoPE, unmasked prefix attention,
CFG batching) and the fused blocks (fused.py), handed to the speed techniques by reference.
"""

from __future__ import annotations

from shardgen.families.base import ComponentSpec, DummyModel, ModelFamily, register


def speed_hooks(pipe, opts) -> dict:
    """Qwen-Image's own speed hooks (speed.py's ``prepare_speed``; imports torch, so loaded when first called)."""
    from shardgen.families.qwen_image.speed import prepare_speed

    return prepare_speed(pipe, opts)


def fused_blocks():
    """The fused Qwen-Image block forwards (fused.py)."""
    from shardgen.families.qwen_image import fused

    return fused

# --- Qwen-Image (Qwen/Qwen-Image) ------------------------------------------------------------------
_QWEN_IMAGE = {
    "transformer": ComponentSpec("diffusers", "QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))),
    "vae": ComponentSpec("diffusers", "AutoencoderKLQwenImage", dict(
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
        temperal_downsample=[False, True, True], dropout=0.0,
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916])),
    # Qwen2.5-VL-7B-Instruct.
    "text_encoder": ComponentSpec("transformers", "Qwen2_5_VLForConditionalGeneration", dict(
        text_config=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
            max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1e6,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, use_sliding_window=False,
            sliding_window=32768, max_window_layers=28, tie_word_embeddings=False,
            bos_token_id=151643, eos_token_id=151645),
        vision_config=dict(
            depth=32, hidden_size=1280, hidden_act="silu", intermediate_size=3420, num_heads=16,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2,
            window_size=112, out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=False), "Qwen2_5_VLConfig"),
    "tokenizer": ComponentSpec("tokenizer", "qwen", dict(model_max_length=131072)),
    "scheduler": ComponentSpec("diffusers", "FlowMatchEulerDiscreteScheduler", dict(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")),
}


QWEN_IMAGE = register(ModelFamily(
    name="Qwen-Image", pipeline="QwenImagePipeline", text_tokens=None,
    encode_outputs=("prompt_embeds", "prompt_embeds_mask"),
    dummies={"qwen_image": DummyModel("Qwen-Image", _QWEN_IMAGE)},
    speed_hooks=speed_hooks,
    fused_blocks={"QwenImageTransformer2DModel": fused_blocks},
    # H200, 1024x1024, 8 steps, true CFG, batch 4: the fused eager blocks 2.15 s/image, compiled 2.21
    compiled_speedup=0.97))
