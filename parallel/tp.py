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
from parallel.dims import ParallelDims, divisors
from parallel.registry import Strategy, fail, register
from parallel.transformer import load_transformer
from shardgen.config.launchers import launcher_of
from shardgen.models import lora
from shardgen.models.loader import load_pipeline, torch_dtype

if TYPE_CHECKING:
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.tp")


MESH_DIM = "tp"


@register
class TensorParallel(Strategy):
    """The transformer's weights split over the ``tp`` ranks of a replica (diffusers' ``_tp_plan``)."""

    name = "tp"
    splits_transformer = True
    loras_fused_whole = True

    def replica_dims(self, dims: ParallelDims) -> tuple[tuple[str, int], ...]:
        return ((MESH_DIM, dims.tp),)

    def check_degrees(self, dims: ParallelDims) -> None:
        self.refuse_combined(dims, "set ulysses_degree=1 ring_degree=1 (or use a cp_* strategy)")
        if dims.tp < 2:
            fail(f"strategy=tp needs tp_degree >= 2 (got {dims.tp}); e.g. strategy=tp tp_degree=2, or strategy=dp")

    def check_devices(self, dims: ParallelDims, facts, cfg: GenerateConfig) -> None:
        super().check_devices(dims, facts, cfg)
        several_nodes = dims.world_size > facts.local_ranks
        if facts.type == "cuda" and several_nodes and facts.local_ranks != facts.count:
            # diffusers puts rank r's shard on GPU r % (GPUs per node): right only with one rank per GPU on every node
            fail(f"strategy=tp over several nodes needs one rank per GPU on every node (diffusers places rank r on GPU "
                 f"r % {facts.count}), but there are {facts.local_ranks} ranks per node; launch {facts.count} per node")
        if facts.type == "cpu" and not launcher_of(cfg).described_nodes and torch.cuda.is_available():
            # diffusers places each rank's shard on the accelerator, not on our device
            fail("strategy=tp with device=cpu on a machine with a visible CUDA GPU: diffusers would put the shards "
                 "on the GPU; use device=cuda, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to try tp on CPU")

    def check_model(self, dims: ParallelDims, cfg: GenerateConfig, info_fn) -> None:
        info = info_fn(cfg.model)
        if info.plan("tp") is None:
            fail(f"strategy=tp: {info.cls_name} has no _tp_plan in this diffusers, so it cannot be tensor-parallel; "
                 "use strategy=device_map to spread it over GPUs, or a cp_* strategy")
        if info.heads and info.heads % dims.tp:
            fail(f"tp_degree={dims.tp} does not divide the {info.heads} attention heads of {info.cls_name} "
                 f"(from {info.source}); use a tp_degree among {divisors(info.heads)}")

    def weights_bytes(self, transformer: int, others: int, dtype_bytes: int, dims: ParallelDims) -> int:
        return (transformer // max(1, dims.tp) + others) * dtype_bytes

    def apply(self, cfg: GenerateConfig, world: World, dims: ParallelDims):
        return apply(cfg, world, dims)


def tp_config(dims: ParallelDims):
    """The diffusers config for the replica's ``tp`` sub-mesh (its size is the degree)."""
    from diffusers import TensorParallelConfig

    return TensorParallelConfig(mesh=dims.mesh(MESH_DIM))


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
    log.info("tensor parallel: transformer sharded %d ways over ranks %s", dims.tp, dims.mesh(MESH_DIM).mesh.tolist())
    return pipe
