"""Choosing, validating and applying a strategy: each one a ``Strategy`` class in its own module (parallel/registry.py).

Replicas always split the data; a strategy says how one replica spreads over its ranks/devices.
``plan_layout`` runs before any weight is read (on every rank, and before sbatch for SLURM): the
degrees are checked against each other and the world by ``ParallelDims`` itself, then here against
the devices, the model's transformer (from its config file alone), the attention backend and the
sequence lengths (each strategy's own checks), each message saying what to change; the
``ParallelLayout`` it returns checks the rows' own sizes once the plan has counted them.
``apply_strategy`` then builds this rank's part of its replica's pipeline with the strategy's ``apply``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from parallel import cfg as cfg_parallel
from parallel import registry
from parallel.auto import decide
from parallel.dims import ParallelConfigError, ParallelDims
from parallel.transformer import SequenceShape, TransformerInfo, sequence_shape, transformer_info
from shardgen.config.launchers import launcher_of
from shardgen.config.schema import EIGHT_BIT_ATTENTION
from shardgen.models import lora

if TYPE_CHECKING:
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.strategies")
# import every strategy module now, at a known time, rather than at the first lookup inside whatever context
# (a test's monkeypatch, a rank's signal window) happens to be running then
registry.names()


def _fail(msg: str) -> None:
    raise ParallelConfigError(msg)


@dataclass(frozen=True)
class DeviceFacts:
    """The devices the ranks will run on: this machine, or the nodes a SLURM submission asks for."""

    type: str
    """cuda | cpu"""
    count: int
    """GPUs per node (0 on CPU)."""
    local_ranks: int
    """Ranks sharing one node."""
    where: str = "this machine"


def device_facts(cfg: GenerateConfig, world_size: int) -> DeviceFacts:
    """Facts about the devices, without touching them (no CUDA context is created)."""
    import torch

    launcher = launcher_of(cfg)
    if launcher.described_nodes:  # validating a submission: the nodes are described by the launcher config
        gpus, local_ranks, where = launcher.described_nodes(cfg)
        return DeviceFacts(type="cuda" if gpus else "cpu", count=gpus, local_ranks=local_ranks, where=where)
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or launcher.local_ranks(world_size)
    return DeviceFacts(type="cuda" if cuda else "cpu", count=torch.cuda.device_count() if cuda else 0,
                       local_ranks=local)


def _check_cfg(r: ParallelDims, cfg: GenerateConfig, sequence: SequenceShape) -> None:
    """cfg_degree=2 needs a pipeline that runs true CFG (two transformer branches per step), switched on."""
    if r.cfg == 1:
        return
    m = cfg.model
    if not sequence.true_cfg:
        _fail(f"cfg_degree={r.cfg}: {m.pipeline} has no true classifier-free guidance (no true_cfg_scale; guidance-"
              "distilled models run the transformer once per step), so there is no second branch to split off; "
              "set cfg_degree=1")
    if m.true_cfg_scale <= 1:
        _fail(f"cfg_degree={r.cfg} splits true CFG's two branches over two ranks, but model.true_cfg_scale="
              f"{m.true_cfg_scale} turns true CFG off (one branch per step); set model.true_cfg_scale above 1 (with "
              "model.negative_prompt, default \" \") or cfg_degree=1")


def _check_latent_checkpoints(dims: ParallelDims, cfg: GenerateConfig) -> None:
    """Latent checkpoints every N steps resume one rank's batch: a replica of one rank on one device only."""
    every = cfg.get("latent_checkpoint_every")
    if isinstance(every, int) and not isinstance(every, bool) and not dims.kind.one_gpu_per_replica:
        _fail(f"latent_checkpoint_every={every}: use N >= 1 steps, with a video model and strategy=dp "
              f"(model={cfg.model.name}, strategy={dims.strategy}), auto or null")


def _check_loras(kind: registry.Strategy, cfg: GenerateConfig) -> None:
    """Adapters that change between batches need the whole transformer on every rank."""
    if kind.splits_transformer and lora.per_row(cfg):
        _fail(f"prompts.row_settings=[loras] switches adapters between batches, which strategy={kind.name} cannot do "
              "(each rank holds a slice of the fused weights); use strategy=dp or cp_ulysses, or one set for the run "
              "in model.loras")


def validate(cfg: GenerateConfig, dims: ParallelDims, facts: DeviceFacts, sequence: SequenceShape,
             info_fn: Callable[[Any], TransformerInfo] = transformer_info) -> ParallelDims:
    """Every check of ``dims`` that needs the devices, the model's config or the run's sequence, in order; returns
    ``dims`` with its attention backend resolved."""
    kind = dims.kind
    kind.check_devices(dims, facts, cfg)
    _check_cfg(dims, cfg, sequence)
    _check_latent_checkpoints(dims, cfg)
    _check_loras(kind, cfg)  # again: auto may have chosen such a strategy
    kind.check_model(dims, cfg, info_fn)
    dims.attention_backend = kind.attention_backend(dims, facts, cfg.dtype)
    check_eight_bit_attention(dims, cfg)
    kind.check_sequence(dims, sequence, facts)
    return dims


def check_eight_bit_attention(dims: ParallelDims, cfg: GenerateConfig) -> None:
    """An 8-bit ``sdpa_backend`` takes the place of torch's SDPA, which the transformer calls only under diffusers'
    ``native`` attention backend; under another (ring attention's LSE kernel, or one the user named) the run would
    compute exact attention while its samples say they were made with 8-bit attention."""
    name = cfg.sdpa_backend
    if name not in EIGHT_BIT_ATTENTION or dims.attention_backend in (None, "native"):
        return
    if dims.ring > 1:  # ring attention merges partial results by their log-sum-exp, which SDPA does not return
        why = f"ring attention runs through diffusers' {dims.attention_backend} backend"
        way = "use strategy=cp_ulysses (its attention is torch's SDPA)"
    else:
        why = f"strategy.attention_backend={dims.attention_backend} sends attention past it"
        way = "leave strategy.attention_backend unset"
    _fail(f"sdpa_backend={name} replaces torch's SDPA, and {why}: the 8-bit kernel would never run. Either {way}, "
          "or set sdpa_backend=auto")


@dataclass(frozen=True)
class ParallelLayout:
    """A run's parallel layout, planned once before any weight is read (``plan_layout``): the strategy and degrees,
    the devices they were checked against, and the tokens one sample puts through the transformer."""

    dims: ParallelDims
    facts: DeviceFacts
    sequence: SequenceShape

    def check_rows(self, shapes: dict | None, device_type: str | None = None) -> None:
        """The strategy's sequence checks for the sizes rows give themselves (prompts.row_settings), once the plan
        has counted them (``Plan.shapes``: Shape -> rows), before any weight is read. ``device_type``: this rank's
        ("cuda" or "cpu"; None: the devices the layout was checked against)."""
        if shapes:
            self.dims.kind.check_rows(self.dims, self.sequence, shapes, device_type or self.facts.type)


def plan_layout(cfg: GenerateConfig, world_size: int) -> ParallelLayout:
    """The strategy and degrees to run, validated against the world, the devices, the model's config and the run's
    sequence (no weights touched); ``auto`` is resolved to its choice here."""
    # the devices are only read here (Ray's replica size, which derives from the degrees, came with world_size)
    facts = device_facts(cfg, world_size)
    name = cfg.strategy.name
    if name != registry.AUTO:  # an unknown name is refused with the choices
        _check_loras(registry.get(name), cfg)  # before the degrees: it is the first thing to change
    sequence = sequence_shape(cfg)
    dims = (decide(cfg, world_size, facts, sequence) if name == registry.AUTO else
            ParallelDims.from_cfg(cfg, world_size))
    return ParallelLayout(validate(cfg, dims, facts, sequence), facts, sequence)


def parallel_dims(cfg: GenerateConfig, world_size: int) -> ParallelDims:
    """``plan_layout``'s strategy and degrees (a launcher sizing and checking the ranks it starts)."""
    return plan_layout(cfg, world_size).dims


def apply_strategy(cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
    """Build this rank's part of its replica's pipeline (``dims.build_mesh`` has run)."""
    log.info("strategy %s: %d replica(s) of %d rank(s)%s%s", dims.strategy, dims.dp, dims.replica_size,
             f" x {dims.gpus_per_replica} GPU(s)" if dims.kind.spans_gpus_in_one_process else "",
             f" (cfg parallel x{dims.cfg})" if dims.cfg > 1 else "")
    pipe = dims.kind.apply(cfg, world, dims)
    if dims.cfg > 1:
        cfg_mesh = dims.mesh("cfg")
        cfg_parallel.enable(pipe.transformer, cfg_mesh.get_group(), cfg_mesh.get_local_rank())
    return pipe
