"""Wan text-to-video (``WanPipeline``): Wan 2.1 T2V 1.3B and 14B, Wan 2.2 T2V A14B, and the embedded tiny video
model (model=tiny_video) of the same pipeline.

The VAE compresses 8x in space and 4x in time (``num_frames = 4k + 1`` gives k + 1 latent frames); the
transformer patches latents 2x2, so a token covers 16 pixels a side. The UMT5 text only feeds cross-attention,
so context parallelism splits the video tokens alone. The dummy component configs are those of the diffusers
repositories (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan-AI/Wan2.1-T2V-14B-Diffusers, Wan-AI/Wan2.2-T2V-A14B-Diffusers:
``transformer*/config.json``, google/umt5-xxl's encoder, the Wan 2.1 VAE that A14B shares, the UniPC flow
scheduler); the three models share one pipeline class, so they are told apart by model config name.
"""

from __future__ import annotations

from shardgen.families.base import ComponentSpec, DummyModel, ModelFamily, TinyModel, register

TINY_VERSION = "v1"  # the tiny video models' cache names and fingerprints; bump when their build changes


def tiny_transformer_config() -> dict:
    """The tiny text-to-video model's transformer config (tiny.py)."""
    from shardgen.families.wan.tiny import TRANSFORMER_CONFIG

    return TRANSFORMER_CONFIG


def tiny_path(cache_dir=None):
    """The tiny text-to-video model's directory, built on first use (tiny.py)."""
    from shardgen.families.wan.tiny import tiny_video_model_path

    return tiny_video_model_path(cache_dir)


TINY_VIDEO = TinyModel(source="tiny_video", version=f"tiny-video-{TINY_VERSION}",
                       transformer_class="WanTransformer3DModel", transformer_config=tiny_transformer_config,
                       path=tiny_path)

_UMT5_XXL = ComponentSpec("transformers", "UMT5EncoderModel", dict(
    vocab_size=256384, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True, tie_word_embeddings=False,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0), "UMT5Config")
_WAN21_VAE = ComponentSpec("diffusers", "AutoencoderKLWan", dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]))


def _transformer(heads: int, ffn: int, layers: int) -> ComponentSpec:
    return ComponentSpec("diffusers", "WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024))


def _scheduler(flow_shift: float) -> ComponentSpec:
    return ComponentSpec("diffusers", "UniPCMultistepScheduler", dict(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=flow_shift))


def _wan(transformer: ComponentSpec, flow_shift: float, **extra: ComponentSpec) -> dict[str, ComponentSpec]:
    return dict(transformer=transformer, text_encoder=_UMT5_XXL, vae=_WAN21_VAE, scheduler=_scheduler(flow_shift),
                tokenizer=ComponentSpec("tokenizer", "t5", dict(model_max_length=512)), **extra)


_WAN_14B = _transformer(heads=40, ffn=13824, layers=40)
# model config name -> components; flow_shift 3.0 at 480p and 5.0 at 720p (the diffusers Wan docs),
# 12.0 for Wan 2.2 A14B (its sample_shift); A14B's second expert takes over below t = 0.875 * 1000
WAN = register(ModelFamily(
    name="Wan", pipeline="WanPipeline", text_tokens="", frame_stride=4, tiny_models=(TINY_VIDEO,),
    dummies={
        "wan21_t2v_1_3b": DummyModel("Wan2.1-T2V-1.3B", _wan(_transformer(heads=12, ffn=8960, layers=30), flow_shift=3.0)),
        "wan21_t2v_14b": DummyModel("Wan2.1-T2V-14B", _wan(_WAN_14B, flow_shift=5.0)),
        "wan22_t2v_a14b": DummyModel("Wan2.2-T2V-A14B", _wan(
            _WAN_14B, flow_shift=12.0, transformer_2=_WAN_14B,
            boundary_ratio=ComponentSpec("value", "float", dict(value=0.875)))),
    }))
