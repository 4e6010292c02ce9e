"""Data parallel: every replica is one rank holding a full pipeline on its own device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parallel.registry import Strategy, fail, register
from shardgen.models import lora
from shardgen.models.loader import load_pipeline, torch_dtype

if TYPE_CHECKING:
    from parallel.dims import ParallelDims
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig


@register
class DataParallel(Strategy):
    """A replica is one rank with the whole pipeline; the replicas split the prompts."""

    name = "dp"
    one_gpu_per_replica = True

    def check_degrees(self, dims: ParallelDims) -> None:
        if (dims.tp, dims.ulysses, dims.ring) != (1, 1, 1):
            fail(f"strategy=dp ignores tp_degree/ulysses_degree/ring_degree ({dims.tp}/{dims.ulysses}/{dims.ring}); "
                 "pick strategy=tp or a cp_* strategy, or set the degrees to 1")

    def apply(self, cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
        return apply(cfg, world, dims)


def apply(cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
    """Load the whole pipeline onto this rank's device, with the run's LoRA adapters (``model.loras``) and
    ``strategy.attention_backend``, if set."""
    pipe = lora.apply(load_pipeline(cfg.model, torch_dtype(cfg.dtype), world.device), cfg)
    if dims.attention_backend:
        pipe.transformer.set_attention_backend(dims.attention_backend)
    return pipe
