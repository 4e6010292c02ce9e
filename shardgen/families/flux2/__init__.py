"""FLUX.2 (``Flux2Pipeline``): FLUX.2-dev, a Mistral-Small-3 text encoder and a 32-channel VAE.

The text is padded to ``model.max_sequence_length`` tokens, which join the image tokens in joint attention. A row's
input image (prompts.row_settings=[image]) is a reference image: its latent tokens join them too.
"""

from __future__ import annotations

from shardgen.families.base import ComponentSpec, DummyModel, ModelFamily, register


def encode_hooks(pipe) -> dict:
    """FLUX.2's encoding hook (speed.py: the text encoder run only as deep as the pipeline reads it)."""
    from shardgen.families.flux2.speed import install_encoder_cut

    return {"flux2_encoder_cut": install_encoder_cut(pipe)}


def fused_blocks():
    """The fused FLUX.2 block forwards (fused.py; imports torch, so loaded when first asked)."""
    from shardgen.families.flux2 import fused

    return fused

# --- FLUX.2-dev (black-forest-labs/FLUX.2-dev) ---------------------------------------------------
_FLUX2_DEV = {
    "transformer": ComponentSpec("diffusers", "Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=128, out_channels=None, num_layers=8, num_single_layers=48,
        attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)),
    "vae": ComponentSpec("diffusers", "AutoencoderKLFlux2", dict(
        in_channels=3, out_channels=3, latent_channels=32,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, act_fn="silu", norm_num_groups=32,
        sample_size=1024, use_quant_conv=True, use_post_quant_conv=True,
        mid_block_add_attention=True, batch_norm_eps=1e-4, batch_norm_momentum=0.1, patch_size=(2, 2))),
    # Mistral-Small-3.1/3.2-24B (Mistral3ForConditionalGeneration: Pixtral vision tower + Mistral text model).
    # The pipeline stacks hidden states 10, 20, 30 -> joint_attention_dim = 3 * 5120.
    "text_encoder": ComponentSpec("transformers", "Mistral3ForConditionalGeneration", dict(
        text_config=dict(
            vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=11),
        vision_config=dict(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
            num_attention_heads=16, head_dim=64, num_channels=3, image_size=1540, patch_size=14,
            hidden_act="silu", rope_theta=10000.0),
        image_token_index=10, projector_hidden_act="gelu", vision_feature_layer=-1,
        multimodal_projector_bias=False, spatial_merge_size=2, tie_word_embeddings=False), "Mistral3Config"),
    "tokenizer": ComponentSpec("tokenizer", "mistral", dict(model_max_length=512)),
    "scheduler": ComponentSpec("diffusers", "FlowMatchEulerDiscreteScheduler", dict(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")),
}

# reference images (prompts.row_settings=[image]): ``image`` conditions the whole call, so rows are batched by image
FLUX2 = register(ModelFamily(
    name="FLUX.2", pipeline="Flux2Pipeline", text_tokens="max_sequence_length",
    encode_outputs=("prompt_embeds", None), input_image="optional", image_per_call=True,
    image_in_sequence=True,
    dummies={"flux2_dev": DummyModel("FLUX.2-dev", _FLUX2_DEV)},
    fused_blocks={"Flux2Transformer2DModel": fused_blocks},
    encode_hooks=encode_hooks,
    cuda_graphs=True,  # the fused eager call replays bit-equal (tests/test_gpu.py)
    # fp8=true on an H200, 8 steps, 24 prompts: 2.10 s/sample with fa3_fp8, 2.17 without, 0.1 dB less PSNR on dummy
    # weights (benchmarks/results/2026-12-07-h200-all-models-bd150c4)
    eight_bit_attention="fa3_fp8",
    # H200, 1024x1024, batch 4: the fused eager blocks 324 ms a step, compiled 321 (benchmarks/probe_flux2.py)
    compiled_speedup=1.01,
    # fp8=true (H200, one step at batch 4): eager 280.0 ms an image, compiled 284.9
    # (benchmarks/results/2026-12-05-h200-fp8-step-cfb2240), before the eager blocks' joined float8 rows
    compiled_speedup_fp8=0.98))
