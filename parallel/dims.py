"""The job's parallel shape: the strategy, its degrees, and the device mesh built from them.

``ParallelDims`` (torchtitan's shape) is the one place that knows the degrees: it checks them against
each other and against the world once, in ``__post_init__``, and builds the device mesh with its named
sub-meshes. Strategies and the replica loop ask it for a named sub-mesh (``mesh``) or ``replica_group()``;
nothing else calls ``init_device_mesh``. The strategy (parallel/registry.py) names the dimensions inside a
replica and checks its own degrees; callers ask ``dims.kind`` and ``tp_enabled`` / ``cp_enabled``.

Mesh = dp x [cfg] x the strategy's dimensions (tp; ring x ulysses; none for dp). A *replica* is one dp
slice: all its ranks get the same prompts and generators; only its leader (the slice's first rank) claims
shards and writes. Ranks of a replica are contiguous, so they share a node when they can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parallel import registry
from parallel.registry import ParallelConfigError, Strategy, fail as _fail

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig

__all__ = ["ParallelConfigError", "ParallelDims", "divisors"]


@dataclass(kw_only=True)
class ParallelDims:
    """A strategy with its degrees, checked against the world (``__post_init__``), and its mesh.

    Made from the command line (``from_cfg``) or by ``strategy=auto``'s choice; never ``auto`` itself.
    """

    world_size: int
    strategy: str = registry.DEFAULT
    """The strategy to apply: a name registered in parallel/registry.py (conf/strategy/ has one YAML each)."""
    tp: int = 1
    """Tensor-parallel ranks per replica (``tp_degree``)."""
    ulysses: int = 1
    """Ulysses context-parallel ranks per replica (``ulysses_degree``)."""
    ring: int = 1
    """Ring context-parallel ranks per replica (``ring_degree``)."""
    cfg: int = 1
    """CFG-parallel ranks per replica (``cfg_degree``, 1 or 2): the two branches of true CFG on two ranks."""
    gpus_per_replica: int = 1
    """device_map: GPUs the one process of a replica spans (1 for every other strategy)."""
    degree: int = 1
    """Ranks per replica of a strategy whose mesh dimension is its own (``strategy.degree``)."""
    attention_backend: str | None = None
    """The diffusers attention backend to set (cp: resolved from the device when not configured)."""
    ulysses_anything: bool = False
    """Ulysses over any sequence length / head count (uneven split)."""
    ring_anything: bool = False
    """Ring over any sequence length (uneven split)."""
    dp: int = field(init=False)
    """Replicas (data parallel), derived: world_size / replica_size."""
    _mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _replica_group: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_cfg(cls, cfg: GenerateConfig, world_size: int) -> ParallelDims:
        """The strategy and degrees as asked for on the command line (``strategy.name`` is not ``auto``)."""
        s = cfg.strategy
        spans = registry.get(s.name).spans_gpus_in_one_process
        return cls(world_size=world_size, strategy=s.name, tp=cfg.tp_degree, ulysses=cfg.ulysses_degree,
                   ring=cfg.ring_degree, cfg=cfg.cfg_degree, gpus_per_replica=s.gpus_per_replica if spans else 1,
                   degree=s.get("degree", 1), attention_backend=s.attention_backend,
                   ulysses_anything=s.ulysses_anything, ring_anything=s.ring_anything)

    def __post_init__(self):
        self._check_degrees()
        if self.world_size % self.replica_size:
            shape = " x ".join(f"{name} {degree}" for name, degree in self.replica_dims())
            n = self.replica_size
            _fail(f"{n} ranks per replica ({shape}) do not divide the world of {self.world_size} ranks; launch a "
                  f"multiple of {n} ranks (e.g. launcher=local launcher.nprocs={n}) or lower the degrees")
        self.dp = self.world_size // self.replica_size

    @property
    def kind(self) -> Strategy:
        """The strategy's class (registered under ``strategy``): its capabilities and checks."""
        return registry.get(self.strategy)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.ulysses * self.ring > 1

    @property
    def cfg_enabled(self) -> bool:
        return self.cfg > 1

    # --- the shape ---------------------------------------------------------------------------------------

    def replica_dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh dimensions inside one replica, outermost first, with their degrees.

        ``cfg`` (cfg_degree 2: the conditional and unconditional branch of true CFG on two ranks) comes first,
        then the strategy's own (``Strategy.replica_dims``); the mesh, the replica size and the replica group
        all follow from this list."""
        cfg = (("cfg", self.cfg),) if self.cfg > 1 else ()
        return (*cfg, *self.kind.replica_dims(self))

    @property
    def replica_size(self) -> int:
        """Ranks in one replica."""
        return math.prod(degree for _, degree in self.replica_dims())

    def replica_of(self, rank: int) -> int:
        """The dp index of ``rank``."""
        return rank // self.replica_size

    def leader_of(self, rank: int) -> int:
        """The global rank of the leader of ``rank``'s replica (its first rank)."""
        return rank - rank % self.replica_size

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` leads its replica (claims shards and writes)."""
        return rank % self.replica_size == 0

    def describe(self) -> str:
        """``tp_degree=4`` / ``strategy.gpus_per_replica=2``: the degrees as the command line sets them."""
        parts = [f"{k}={v}" for k, v in (("cfg_degree", self.cfg), ("tp_degree", self.tp),
                                         ("ulysses_degree", self.ulysses), ("ring_degree", self.ring)) if v > 1]
        return " ".join([*parts, *self.kind.own_degrees(self)])

    # --- the mesh ----------------------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> None:
        """Build the device mesh and the replica group (collectives: every rank calls this once, in the same
        order); nothing for one process."""
        if self.world_size == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip((registry.REPLICAS_DIM, self.dp), *self.replica_dims())
        self._mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        if self.replica_size > 1:
            inner = self._mesh[names[1:]]
            self._replica_group = (inner if len(names) == 2 else inner._flatten()).get_group()

    def mesh(self, name: str):
        """A named sub-mesh: the replicas', ``cfg``, a strategy's own, or ``cp`` (ring x ulysses)."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.mesh() before build_mesh(), or in a one-process job (no mesh)")
        return self._mesh["ring", "ulysses"] if name == "cp" else self._mesh[name]

    def replica_group(self):
        """The process group of this rank's replica (all its ranks); None for one-rank replicas."""
        return self._replica_group

    # --- validation --------------------------------------------------------------------------------------

    def _check_degrees(self) -> None:
        """The degrees every strategy shares, then the strategy's own; the anything-variants last."""
        for key, degree in (("tp_degree", self.tp), ("ulysses_degree", self.ulysses), ("ring_degree", self.ring)):
            if degree < 1:
                _fail(f"{key} must be >= 1, got {degree}")
        if self.degree < 1:
            _fail(f"strategy.degree must be >= 1, got {self.degree}")
        if self.cfg not in (1, 2):
            _fail(f"cfg_degree={self.cfg}: true CFG has two branches, so use cfg_degree=1 or cfg_degree=2")
        self.kind.check_degrees(self)
        self._check_anything()

    def _check_anything(self) -> None:
        cp_strategy = self.kind.context_parallel
        if self.ulysses_anything and not (cp_strategy and self.ulysses > 1 and self.ring == 1):
            _fail("strategy.ulysses_anything=true needs a Ulysses-only replica (strategy=cp_ulysses, "
                  "ulysses_degree >= 2, ring_degree=1); set it to false")
        if self.ring_anything and not (cp_strategy and self.ring > 1 and self.ulysses == 1):
            _fail("strategy.ring_anything=true needs a ring-only replica (strategy=cp_ring, ring_degree >= 2, "
                  "ulysses_degree=1); set it to false")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` from 2 up (the degrees that could split ``n`` ranks, heads or tokens)."""
    return [d for d in range(2, n + 1) if n % d == 0]


def replica_size_of(cfg: GenerateConfig) -> int:
    """Ranks one replica of ``cfg``'s strategy and degrees takes (``strategy.name`` not auto), before any world
    exists (a launcher sizing the replicas it starts): the degrees are checked, no world is."""
    return ParallelDims.from_cfg(cfg, world_size=0).replica_size


def launched_replica_size(cfg: GenerateConfig) -> int:
    """Ranks a launcher starts for one replica of ``cfg``: ``replica_size_of``, or one for strategy=auto, which then
    chooses within that rank's devices. ParallelConfigError for impossible degrees."""
    return 1 if cfg.strategy.name == "auto" else replica_size_of(cfg)
