"""Context parallel (Ulysses, Ring, unified): every rank of a replica holds the whole pipeline and
the transformer splits each sequence (image and text tokens) over the replica's ``ring x ulysses`` ranks.

Ulysses exchanges heads with an all-to-all (heads must divide by its degree unless
``ulysses_anything``); Ring passes K/V around and merges partial results with their log-sum-exp, so
it needs an attention backend that returns it. Applied with ``transformer.enable_parallelism`` and
``ContextParallelConfig(ring_degree, ulysses_degree, ulysses_anything, ring_anything, mesh=...)``.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

from parallel.compat import parallel_patches
from parallel.dims import ParallelDims
from shardgen.models import lora
from shardgen.models.loader import load_pipeline, torch_dtype

if TYPE_CHECKING:
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.cp")


def cp_config(dims: ParallelDims):
    """The diffusers config over the replica's ring x ulysses sub-mesh."""
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ring_degree=dims.ring, ulysses_degree=dims.ulysses, mesh=dims.mesh("cp"),
                                 ulysses_anything=dims.ulysses_anything, ring_anything=dims.ring_anything)


def enable(transformer: Any, dims: ParallelDims, device: torch.device) -> None:
    """Set the attention backend, then make ``transformer`` context-parallel over the replica."""
    transformer.set_attention_backend(dims.attention_backend)
    # diffusers 0.42's CP gather calls a torch collective that torch 2.13 deprecates: once per rank, not ours to fix
    warnings.filterwarnings("ignore", message=r".*all_gather_tensor.*deprecated", category=FutureWarning)
    with parallel_patches(device):
        transformer.enable_parallelism(config=cp_config(dims))


def apply(cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
    """The whole pipeline on this rank's device, with the run's LoRA adapters, its transformer context-parallel."""
    pipe = lora.apply(load_pipeline(cfg.model, torch_dtype(cfg.dtype), world.device), cfg)
    enable(pipe.transformer, dims, world.device)
    extra = " (anything)" if dims.ulysses_anything or dims.ring_anything else ""
    log.info("context parallel: ulysses %d x ring %d%s, attention backend %s", dims.ulysses, dims.ring, extra,
             dims.attention_backend)
    return pipe
