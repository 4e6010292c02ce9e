"""Fully sharded (FSDP2) inference: the transformer's weights sharded over the ``fsdp`` ranks of a replica.

Each repeated block of the transformer (its class's ``_repeated_blocks``) is wrapped with
``torch.distributed.fsdp.fully_shard`` over the replica's ``fsdp`` sub-mesh, then the transformer itself
(the embedders, norms and projections outside the blocks). A rank keeps 1/degree of every weight; at
forward each block's weights are all-gathered just before it runs and freed after it, so a rank holds its
shards plus one block's full weights at a time. Every rank of a replica computes the same batch on whole
weights, so its images are one process's. For models whose transformer does not fit one GPU, beside
device_map's sequential placement (which keeps every GPU but one idle at a time).

The transformer is built on the CPU and only its shards move to the rank's device; the text encoders
and the VAE are whole on every rank.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from parallel.registry import Strategy, fail, register
from parallel.tp import place_components
from shardgen.models import lora
from shardgen.models.loader import load_pipeline, torch_dtype

if TYPE_CHECKING:
    from parallel.dims import ParallelDims
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.fsdp")
MESH_DIM = "fsdp"


@register
class FullyShard(Strategy):
    """The transformer sharded over ``strategy.degree`` ranks per replica, gathered block by block."""

    name = "fsdp"
    splits_transformer = True

    def replica_dims(self, dims: ParallelDims) -> tuple[tuple[str, int], ...]:
        return ((MESH_DIM, dims.degree),)

    def check_degrees(self, dims: ParallelDims) -> None:
        if (dims.tp, dims.ulysses, dims.ring) != (1, 1, 1):
            fail(f"strategy=fsdp ignores tp_degree/ulysses_degree/ring_degree ({dims.tp}/{dims.ulysses}/{dims.ring}); "
                 "set them to 1 and the ranks per replica with strategy.degree")
        if dims.degree < 2:
            fail(f"strategy=fsdp needs strategy.degree >= 2 (got {dims.degree}); e.g. strategy=fsdp strategy.degree=2, "
                 "or strategy=dp")

    def check_model(self, dims: ParallelDims, cfg: GenerateConfig, info_fn) -> None:
        if cfg.fp8:  # the block linears FSDP gathers are its own parameters, in the run's dtype
            fail("fp8=true cannot run under strategy=fsdp: FSDP gathers each block's weights in the run's dtype at "
                 "its forward, so no layer would compute in float8 (while the samples said fp8). Use strategy=tp "
                 "(each rank quantises its own shard) or strategy=dp (float8 halves the transformer's weights), or "
                 "fp8=false")

    def weights_bytes(self, transformer: int, others: int, dtype_bytes: int, dims: ParallelDims) -> int:
        return (transformer // dims.degree + others) * dtype_bytes

    def apply(self, cfg: GenerateConfig, world: World, dims: ParallelDims):
        return apply(cfg, world, dims)


def shard_transformer(transformer: torch.nn.Module, mesh) -> int:
    """``fully_shard`` each repeated block, then the root; returns the number of blocks sharded."""
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(transformer, "_repeated_blocks", None) or getattr(transformer, "_no_split_modules", None) or ())
    blocks = [m for m in transformer.modules() if type(m).__name__ in names]
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True)
    return len(blocks)


def local_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters this rank holds (a sharded parameter counts its local shard only)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def apply(cfg: GenerateConfig, world: World, dims: ParallelDims):
    """This rank's pipeline: its shard of the transformer (the run's LoRA adapters fused in before sharding) plus
    whole copies of the other components."""
    pipe = lora.apply(load_pipeline(cfg.model, torch_dtype(cfg.dtype), torch.device("cpu")), cfg)
    mesh = dims.mesh(MESH_DIM)
    blocks = shard_transformer(pipe.transformer, mesh)  # moves the shards to the mesh's device
    place_components(pipe, world.device)
    if dims.attention_backend:
        pipe.transformer.set_attention_backend(dims.attention_backend)
    log.info("fsdp: transformer sharded %d ways over ranks %s (%d blocks, then the root); %.1f MiB of it here",
             dims.degree, mesh.mesh.tolist(), blocks, local_bytes(pipe.transformer) / 2**20)
    return pipe
