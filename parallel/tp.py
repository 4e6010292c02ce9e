"""Tensor parallel: the transformer's weights split over the ``tp`` ranks of a replica.

Each rank reads only its slice of every planned weight: the transformer is loaded with
``from_pretrained(..., subfolder="transformer", parallel_config=TensorParallelConfig(mesh=<tp mesh>))``,
which streams each shard off the safetensors files into a DTensor. The other components (text
encoders, VAE) are loaded whole and moved one by one to the rank's device; the pipeline itself is
never moved (``pipeline.to`` on a sharded transformer is refused by diffusers, and would be wrong).

With LoRA adapters (``model.loras``) each rank loads the whole transformer, fuses the adapters into it and then
shards it in memory: the shards are slices of the adapted weights.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from parallel.compat import parallel_patches
from parallel.dims import ParallelDims
from parallel.transformer import load_transformer
from shardgen.models import lora
from shardgen.models.loader import load_pipeline, torch_dtype

if TYPE_CHECKING:
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.tp")


def tp_config(dims: ParallelDims):
    """The diffusers config for the replica's ``tp`` sub-mesh (its size is the degree)."""
    from diffusers import TensorParallelConfig

    return TensorParallelConfig(mesh=dims.mesh("tp"))


def place_components(pipe, device: torch.device, skip: tuple[str, ...] = ("transformer",)) -> None:
    """Move every module of ``pipe`` except ``skip`` to ``device``, one by one."""
    for name, component in pipe.components.items():
        if name not in skip and isinstance(component, torch.nn.Module):
            component.to(device)


def apply(cfg: GenerateConfig, world: World, dims: ParallelDims):
    """This rank's pipeline: its transformer shard plus whole copies of the other components on its device."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.model.weights == "dummy" or cfg.model.get("loras"):
        # dummy: random weights built on the device; LoRA: the adapters fused into the whole weights first. diffusers
        # then shards them in memory (rank 0's values are broadcast), so every rank runs the adapted model
        pipe = lora.apply(load_pipeline(cfg.model, dtype, world.device), cfg)
        with parallel_patches(world.device, tensor_parallel=True):
            pipe.transformer.enable_parallelism(config=tp_config(dims))
    else:
        # each rank streams only its slice of every planned weight off the safetensors files
        with parallel_patches(world.device, tensor_parallel=True):
            transformer = load_transformer(cfg.model, dtype, " for tensor parallelism", parallel_config=tp_config(dims))
        pipe = load_pipeline(cfg.model, dtype, None, transformer=transformer)
        place_components(pipe, world.device)
    if dims.attention_backend:
        pipe.transformer.set_attention_backend(dims.attention_backend)
    log.info("tensor parallel: transformer sharded %d ways over ranks %s", dims.tp, dims.mesh("tp").mesh.tolist())
    return pipe
