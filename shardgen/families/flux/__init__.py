"""FLUX.1 (``FluxPipeline``): FLUX.1-dev, and the embedded tiny model (model=tiny) of the same pipeline.

This folder: the spec (here), the fused blocks (fused.py), the tiny model's builder (tiny.py).

CLIP-L and T5-XXL text encoders; the T5 text is padded to ``model.max_sequence_length`` tokens, which join the
image tokens in the transformer's joint attention (so context parallelism splits them too).
"""

from __future__ import annotations

from shardgen.families.base import ComponentSpec, DummyModel, ModelFamily, TinyModel, register

TINY_VERSION = "v2"  # the tiny model's cache name and fingerprint; bump when its build changes (v2: a fixed T5 vocabulary)


def fused_blocks():
    """The fused FLUX.1 block forwards (fused.py; imports torch, so loaded when first asked)."""
    from shardgen.families.flux import fused

    return fused


def tiny_transformer_config() -> dict:
    """The tiny model's transformer config (tiny.py)."""
    from shardgen.families.flux.tiny import TRANSFORMER_CONFIG

    return TRANSFORMER_CONFIG


def tiny_path(cache_dir=None):
    """The tiny model's directory, built on first use (tiny.py)."""
    from shardgen.families.flux.tiny import tiny_model_path

    return tiny_model_path(cache_dir)


TINY = TinyModel(source="tiny", version=f"tiny-{TINY_VERSION}", transformer_class="FluxTransformer2DModel",
                 transformer_config=tiny_transformer_config, path=tiny_path)

# google/t5-v1_1-xxl encoder (FLUX.1's text_encoder_2, SD3's text_encoder_3).
T5_XXL = ComponentSpec("transformers", "T5EncoderModel", dict(
    vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
    layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    is_encoder_decoder=True, use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
    "T5Config")

# --- FLUX.1-dev (black-forest-labs/FLUX.1-dev) ---------------------------------------------------
def vae16(scaling_factor: float, shift_factor: float) -> ComponentSpec:
    """The 16-channel AutoencoderKL that FLUX.1 and Stable Diffusion 3.x share; only its latent scaling differs."""
    return ComponentSpec("diffusers", "AutoencoderKL", dict(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, act_fn="silu", norm_num_groups=32,
        sample_size=1024, scaling_factor=scaling_factor, shift_factor=shift_factor, force_upcast=True,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True))


_FLUX1_DEV = {
    "transformer": ComponentSpec("diffusers", "FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
        guidance_embeds=True, axes_dims_rope=(16, 56, 56))),
    "vae": vae16(scaling_factor=0.3611, shift_factor=0.1159),
    # openai/clip-vit-large-patch14 text tower, as FLUX.1-dev's text_encoder/config.json has it.
    "text_encoder": ComponentSpec("transformers", "CLIPTextModel", dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1), "CLIPTextConfig"),
    "text_encoder_2": T5_XXL,
    "tokenizer": ComponentSpec("tokenizer", "clip", dict(model_max_length=77)),
    "tokenizer_2": ComponentSpec("tokenizer", "t5", dict(model_max_length=512)),
    "scheduler": ComponentSpec("diffusers", "FlowMatchEulerDiscreteScheduler", dict(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)),
}

FLUX = register(ModelFamily(
    name="FLUX.1", pipeline="FluxPipeline", text_tokens="max_sequence_length",
    encode_outputs=("prompt_embeds", "pooled_prompt_embeds", None),
    dummies={"flux_dev": DummyModel("FLUX.1-dev", _FLUX1_DEV)},
    fused_blocks={"FluxTransformer2DModel": fused_blocks},
    tiny_models=(TINY,),
    cuda_graphs=True,  # the fused eager call replays bit-equal (tests/test_gpu.py)
    # fp8=true on an H100, 24 prompts: 2.17 s/sample with fa3_fp8, 2.30 without, 2 dB less PSNR on dummy weights
    # (benchmarks/results/2026-12-07-h100-96-prompts-e87ddcc)
    eight_bit_attention="fa3_fp8",
    # against its default eager path (fused blocks, calls replayed from CUDA graphs), not the stock blocks the generic
    # prior was measured on (H200, FLUX.1-dev, 1024x1024, 28 steps, batch 4: 3.64 s/sample eager with graphs over
    # two batches, 3.68-3.72 without, 3.59 compiled; 3.66 / 3.59; docs/performance.md): a first
    # job compiles only where the work left pays for the compile time
    compiled_speedup=1.02,
    # fp8=true sdpa_backend=fa3_fp8 (H100, 28 steps, 24 prompts): 2.24 s/sample eager, 2.47 compiled
    # (benchmarks/results/2026-12-06-h100-compiled-matrix-60436d0); a long fp8 run stays eager
    compiled_speedup_fp8=0.91))
