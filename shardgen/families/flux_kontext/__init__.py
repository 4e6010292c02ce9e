"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1-Kontext-dev edits its row's input image as the prompt says
(prompts.row_settings=[image]; a row without one is made from text alone); and the embedded tiny model in that mode
(model=tiny_kontext).

FLUX.1's architecture (the dummy is FLUX.1-dev's: Kontext-dev has the same components and sizes); the input image's
latent tokens join the sample's in the transformer's joint attention. Its own resizing (to a preferred resolution,
``_auto_resize``) is left off: shardgen fits the image to the sample's size itself.
"""

from __future__ import annotations

import dataclasses

from shardgen.families.base import register
from shardgen.families.flux import FLUX

FLUX_KONTEXT = register(dataclasses.replace(
    FLUX, name="FLUX.1 Kontext", pipeline="FluxKontextPipeline", input_image="optional", image_in_sequence=True,
    dummies={"flux_kontext_dev": FLUX.dummies["flux_dev"]}))
