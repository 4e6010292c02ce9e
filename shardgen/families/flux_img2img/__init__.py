"""FLUX.1 image-to-image (``FluxImg2ImgPipeline``): FLUX.1-dev's weights, each sample denoised from its row's input
image (prompts.row_settings=[image]) noised to ``strength``; and the embedded tiny model in that mode
(model=tiny_img2img).

The same components and token rules as FLUX.1 text-to-image (shardgen/families/flux/): the pipeline class differs,
not the model, so the dummy architecture is FLUX.1-dev's.
"""

from __future__ import annotations

import dataclasses

from shardgen.families.base import register
from shardgen.families.flux import FLUX

FLUX_IMG2IMG = register(dataclasses.replace(
    FLUX, name="FLUX.1 img2img", pipeline="FluxImg2ImgPipeline", input_image="required", strength=True,
    dummies={"flux_dev_img2img": FLUX.dummies["flux_dev"]}))
