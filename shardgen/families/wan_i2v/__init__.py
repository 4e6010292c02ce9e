"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V 14B, Wan 2.2 I2V A14B, and the embedded tiny
image-to-video model (model=tiny_video_i2v). Each video starts from its row's input image
(prompts.row_settings=[image]).

The text-to-video family's geometry and token rules (shardgen/families/wan/). The transformer sees the noisy
latents, the image's latents and a first-frame mask concatenated on the channels (16 + 16 + 4 = 36 in); the pipeline
conditions a whole call on one image, so rows are batched by input image. The Wan 2.2 dummy is
Wan-AI/Wan2.2-I2V-A14B-Diffusers: the A14B text-to-video experts with 36 input channels, no CLIP image encoder, the
second expert below t = 0.9 * 1000, flow shift 5.0 (its sample_shift).
"""

from __future__ import annotations

import dataclasses

from shardgen.families.base import ComponentSpec, DummyModel, TinyModel, register
from shardgen.families.wan import TINY_VERSION, WAN


def tiny_transformer_config() -> dict:
    """The tiny image-to-video model's transformer config (shardgen/families/wan/tiny.py)."""
    from shardgen.families.wan.tiny import I2V_TRANSFORMER_CONFIG

    return I2V_TRANSFORMER_CONFIG


def tiny_path(cache_dir=None):
    """The tiny image-to-video model's directory, built on first use (shardgen/families/wan/tiny.py)."""
    from shardgen.families.wan.tiny import tiny_video_i2v_model_path

    return tiny_video_i2v_model_path(cache_dir)


TINY_VIDEO_I2V = TinyModel(source="tiny_video_i2v", version=f"tiny-video-i2v-{TINY_VERSION}",
                           transformer_class="WanTransformer3DModel", transformer_config=tiny_transformer_config,
                           path=tiny_path)


def _i2v(components: dict[str, ComponentSpec]) -> dict[str, ComponentSpec]:
    out = dict(components)
    for name in ("transformer", "transformer_2"):
        out[name] = out[name]._replace(config=dict(out[name].config, in_channels=36))
    out["scheduler"] = out["scheduler"]._replace(config=dict(out["scheduler"].config, flow_shift=5.0))
    out["boundary_ratio"] = ComponentSpec("value", "float", dict(value=0.9))
    return out


# Wan 2.1 I2V 14B (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers): the image also enters through a CLIP ViT-H/14 vision tower
# (its penultimate hidden states, 1280 wide, added to the cross-attention's keys and values: image_dim,
# added_kv_proj_dim), the images prepared by its CLIP image processor; flow shift 3.0 at 480p
_CLIP_VIT_H = ComponentSpec("transformers", "CLIPVisionModel", dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, image_size=224,
    patch_size=14, projection_dim=1024, hidden_act="gelu", layer_norm_eps=1e-5), "CLIPVisionConfig")
_CLIP_PROCESSOR = ComponentSpec("processor", "CLIPImageProcessor", dict(
    crop_size=dict(height=224, width=224), size=dict(shortest_edge=224), do_center_crop=True, do_normalize=True,
    do_resize=True, image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    resample=3))


def _wan21_i2v(components: dict[str, ComponentSpec]) -> dict[str, ComponentSpec]:
    out = dict(components)
    out["transformer"] = out["transformer"]._replace(config=dict(
        out["transformer"].config, in_channels=36, image_dim=1280, added_kv_proj_dim=5120))
    out["scheduler"] = out["scheduler"]._replace(config=dict(out["scheduler"].config, flow_shift=3.0))
    return out | {"image_encoder": _CLIP_VIT_H, "image_processor": _CLIP_PROCESSOR}


WAN_I2V = register(dataclasses.replace(
    WAN, name="Wan image-to-video", pipeline="WanImageToVideoPipeline", input_image="required", image_per_call=True,
    tiny_models=(TINY_VIDEO_I2V,),
    dummies={"wan22_i2v_a14b": DummyModel("Wan2.2-I2V-A14B", _i2v(WAN.dummies["wan22_t2v_a14b"].components)),
             "wan21_i2v_14b": DummyModel("Wan2.1-I2V-14B-480P", _wan21_i2v(WAN.dummies["wan21_t2v_14b"].components))}))
