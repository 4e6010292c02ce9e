"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.2 I2V A14B, and the embedded tiny image-to-video model
(model=tiny_video_i2v). Each video starts from its row's input image (prompts.row_settings=[image]).

The text-to-video family's geometry and token rules (shardgen/families/wan.py). The transformer sees the noisy
latents, the image's latents and a first-frame mask concatenated on the channels (16 + 16 + 4 = 36 in); the pipeline
conditions a whole call on one image, so rows are batched by input image. The dummy is Wan-AI/Wan2.2-I2V-A14B-Diffusers:
the A14B text-to-video experts with 36 input channels, no CLIP image encoder, the second expert below
t = 0.9 * 1000, flow shift 5.0 (its sample_shift).
"""

from __future__ import annotations

import dataclasses

from shardgen.families.base import ComponentSpec, DummyModel, register
from shardgen.families.wan import WAN


def _i2v(components: dict[str, ComponentSpec]) -> dict[str, ComponentSpec]:
    out = dict(components)
    for name in ("transformer", "transformer_2"):
        out[name] = out[name]._replace(config=dict(out[name].config, in_channels=36))
    out["scheduler"] = out["scheduler"]._replace(config=dict(out["scheduler"].config, flow_shift=5.0))
    out["boundary_ratio"] = ComponentSpec("value", "float", dict(value=0.9))
    return out


WAN_I2V = register(dataclasses.replace(
    WAN, name="Wan image-to-video", pipeline="WanImageToVideoPipeline", input_image="required", image_per_call=True,
    dummies={"wan22_i2v_a14b": DummyModel("Wan2.2-I2V-A14B", _i2v(WAN.dummies["wan22_t2v_a14b"].components))}))
