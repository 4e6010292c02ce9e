"""Strategies by name: each one a ``Strategy`` subclass in its own module, registered there with ``@register``.

A strategy owns what differs between strategies: its name, the mesh dimensions of one replica, its degree
checks, its device and model checks, its weight share per process, and ``apply``. Code outside the strategy
modules asks a strategy's capabilities (``splits_transformer``, ``context_parallel``, ...), never its name.

Every module of the ``parallel`` package is imported the first time a strategy is looked up, so a new
strategy is one module here (plus its YAML in conf/strategy/); this module itself imports no torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, ClassVar

from parallel.attention import backend_name_problem
from shardgen.errors import UserError

# what the methods take, named for the reader: parallel/dims.py, parallel/world.py and the config schema import
# this module, so it does not import them back
ParallelDims = World = GenerateConfig = Any

DEFAULT = "dp"
"""The strategy of a config that names none: a full pipeline per rank."""
AUTO = "auto"
"""strategy=auto: not a strategy, parallel/auto.py's choice of one."""
REPLICAS_DIM = "dp"
"""The outermost mesh dimension: the replicas (data parallel)."""

_REGISTRY: dict[str, Strategy] = {}
_loaded = False


class ParallelConfigError(UserError, ValueError):
    """Parallel degrees that cannot work; the message says what to change."""


def fail(msg: str) -> None:
    raise ParallelConfigError(msg)


class Strategy:
    """How one replica spreads over its ranks/devices. Subclasses set ``name`` and the capabilities that hold
    for them, and override the checks that concern them; every check runs before any weight is read."""

    name: ClassVar[str]
    splits_transformer: ClassVar[bool] = False
    """Each rank holds only a part of the transformer's weights."""
    context_parallel: ClassVar[bool] = False
    """The replica's ranks split each sequence (ring x ulysses): the attention backend and token counts matter."""
    spans_gpus_in_one_process: ClassVar[bool] = False
    """One process drives several GPUs (ranks per node x GPUs per replica must fit a node)."""
    loras_fused_whole: ClassVar[bool] = False
    """With ``model.loras``, each rank fuses the adapters into the whole transformer on its device before splitting
    it (so it holds all of it for a while)."""
    one_gpu_per_replica: ClassVar[bool] = False
    """A replica is one rank on one device with the whole pipeline: what compile=auto was measured on, and what
    latent checkpoints resume."""

    def replica_dims(self, dims: ParallelDims) -> tuple[tuple[str, int], ...]:
        """The mesh dimensions inside one replica besides ``cfg``, outermost first, with their degrees."""
        return ()

    def own_degrees(self, dims: ParallelDims) -> list[str]:
        """This strategy's settings beyond the ``*_degree`` keys, as the command line sets them."""
        return [f"strategy.degree={dims.degree}"] if dims.degree > 1 else []

    def check_degrees(self, dims: ParallelDims) -> None:
        """The degrees this strategy needs, against each other (not yet the world)."""

    def check_devices(self, dims: ParallelDims, facts: Any, cfg: GenerateConfig) -> None:
        """Enough devices of the right kind: one per rank of a node by default."""
        if facts.type == "cuda" and facts.local_ranks > facts.count:
            fail(f"{facts.local_ranks} ranks per node need one GPU each, but {facts.where} has {facts.count}; launch "
                 f"at most {facts.count} ranks per node, or lower the degrees (one replica takes {dims.replica_size}; "
                 "a model larger than one GPU: strategy=device_map)")

    def check_model(self, dims: ParallelDims, cfg: GenerateConfig, info_fn: Callable[[Any], Any]) -> None:
        """The model's transformer (``info_fn(cfg.model)``: its class and config, no weights) can be split so."""

    def attention_backend(self, dims: ParallelDims, facts: Any, dtype: str) -> str | None:
        """The attention backend this strategy's replicas run with: the configured one, its name checked (None: the
        model's own)."""
        if dims.attention_backend and (problem := backend_name_problem(dims.attention_backend)):
            fail(problem)
        return dims.attention_backend

    def check_sequence(self, dims: ParallelDims, sequence: Any, facts: Any) -> None:
        """The tokens one sample puts through the transformer (``sequence``: parallel/transformer.py's
        SequenceShape) can be split so; ``attention_backend`` has resolved the backend."""

    def check_rows(self, dims: ParallelDims, sequence: Any, shapes: dict, device_type: str) -> None:
        """``check_sequence`` for the sizes rows give themselves (``shapes``: Shape -> rows, ``Plan.shapes``;
        ``sequence.at`` counts each), on ``device_type`` ("cuda" or "cpu")."""

    def weights_bytes(self, transformer: int, others: int, dtype_bytes: int, dims: ParallelDims) -> int:
        """Bytes of weights one process holds, from the transformer's and the other components' parameters."""
        return (transformer + others) * dtype_bytes

    def apply(self, cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
        """This rank's part of its replica's pipeline (``dims.build_mesh`` has run)."""
        raise NotImplementedError

    @staticmethod
    def refuse_combined(dims: ParallelDims, fix: str) -> None:
        """Tensor and context parallelism are never combined in one replica."""
        if dims.tp > 1 and dims.ulysses * dims.ring > 1:
            fail(f"strategy={dims.strategy} with tp_degree={dims.tp}, ulysses_degree={dims.ulysses}, ring_degree="
                 f"{dims.ring}: tensor and context parallelism are not combined in one replica; {fix}")


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` the strategy of its ``name`` (once; a second class of the name is refused)."""
    held = _REGISTRY.get(cls.name)
    if held is not None and type(held).__qualname__ != cls.__qualname__:
        raise ValueError(f"strategy {cls.name!r} is registered twice: {type(held).__qualname__} and {cls.__qualname__}")
    _REGISTRY[cls.name] = cls()
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import parallel

    for module in sorted(m.name for m in pkgutil.iter_modules(parallel.__path__)):
        importlib.import_module(f"parallel.{module}")


def names() -> list[str]:
    """Every registered strategy's name, sorted."""
    _load()
    return sorted(_REGISTRY)


def choices() -> list[str]:
    """What ``strategy=`` accepts: every strategy and ``auto``."""
    return sorted([*names(), AUTO])


def find(name: str) -> Strategy | None:
    """The strategy called ``name``; None for ``auto`` or an unknown name."""
    _load()
    return _REGISTRY.get(name)


def get(name: str) -> Strategy:
    """The strategy called ``name``; ParallelConfigError listing the choices for any other name."""
    strategy = find(name)
    if strategy is None:
        fail(f"strategy={name} is not available; choose one of {choices()}")
    return strategy
