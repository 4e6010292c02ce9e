"""The job's parallel shape: the strategy, its degrees, and the device mesh built from them.

``ParallelDims`` (torchtitan's shape) is the one place that knows the degrees: it checks them against
each other and against the world once, in ``__post_init__``, and builds the device mesh with its named
sub-meshes. Strategies and the replica loop ask it for ``mesh("tp")``, ``mesh("cp")`` or
``replica_group()``; no other module names a mesh dimension or calls ``init_device_mesh``.

Mesh = dp x tp, or dp x ring x ulysses. A *replica* is one dp slice: all its ranks get the same
prompts and generators; only its leader (the slice's first rank) claims shards and writes. Ranks
of a replica are contiguous, so they share a node when they can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardgen.errors import UserError

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig

CP_STRATEGIES = ("cp_ulysses", "cp_ring", "cp_unified")


class ParallelConfigError(UserError, ValueError):
    """Parallel degrees that cannot work; the message says what to change."""


def _fail(msg: str) -> None:
    raise ParallelConfigError(msg)


@dataclass(kw_only=True)
class ParallelDims:
    """A strategy with its degrees, checked against the world (``__post_init__``), and its mesh.

    Made from the command line (``from_cfg``) or by ``strategy=auto``'s choice; never ``auto`` itself.
    """

    world_size: int
    strategy: str = "dp"
    """The strategy to apply: dp | tp | cp_ulysses | cp_ring | cp_unified | device_map."""
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
        return cls(world_size=world_size, strategy=s.name, tp=cfg.tp_degree, ulysses=cfg.ulysses_degree,
                   ring=cfg.ring_degree, cfg=cfg.cfg_degree, gpus_per_replica=s.gpus_per_replica if s.name == "device_map" else 1,
                   attention_backend=s.attention_backend, ulysses_anything=s.ulysses_anything,
                   ring_anything=s.ring_anything)

    def __post_init__(self):
        self._check_degrees()
        if self.world_size % self.replica_size:
            _fail(f"{self.replica_size} ranks per replica (cfg {self.cfg} x tp {self.tp} x ulysses {self.ulysses} x ring "
                  f"{self.ring}) "
                  f"do not divide the world of {self.world_size} ranks; launch a multiple of {self.replica_size} "
                  f"ranks (e.g. launcher=local launcher.nprocs={self.replica_size}) or lower the degrees")
        self.dp = self.world_size // self.replica_size

    # --- the shape ---------------------------------------------------------------------------------------

    def replica_dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh dimensions inside one replica, outermost first, with their degrees.

        Where a new dimension goes: a ``cfg`` dimension (cfg_degree 1|2, the conditional and unconditional
        branch of true CFG on two ranks) would come first, giving dp x cfg x tp or dp x cfg x ring x ulysses;
        the mesh, the replica size and the replica group all follow from this list."""
        cfg = (("cfg", self.cfg),) if self.cfg > 1 else ()
        if self.tp > 1:
            return (*cfg, ("tp", self.tp))
        return (*cfg, ("ring", self.ring), ("ulysses", self.ulysses))

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
        return rank % self.replica_size == 0

    def describe(self) -> str:
        """``tp_degree=4`` / ``strategy.gpus_per_replica=2``: the degrees as the command line sets them."""
        parts = [f"{k}_degree={v}" for k, v in (("cfg", self.cfg), ("tp", self.tp), ("ulysses", self.ulysses),
                                                   ("ring", self.ring)) if v > 1]
        if self.strategy == "device_map":
            parts.append(f"strategy.gpus_per_replica={self.gpus_per_replica}")
        return " ".join(parts)

    # --- the mesh ----------------------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> None:
        """Build the device mesh and the replica group (collectives: every rank calls this once, in the same
        order); nothing for one process."""
        if self.world_size == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip(("dp", self.dp), *self.replica_dims())
        self._mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        if self.replica_size > 1:
            inner = self._mesh[names[1:]]
            self._replica_group = (inner if len(names) == 2 else inner._flatten()).get_group()

    def mesh(self, name: str):
        """A named sub-mesh: ``dp``, ``cfg``, ``tp``, ``ring``, ``ulysses``, or ``cp`` (ring x ulysses)."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.mesh() before build_mesh(), or in a one-process job (no mesh)")
        return self._mesh["ring", "ulysses"] if name == "cp" else self._mesh[name]

    def replica_group(self):
        """The process group of this rank's replica (all its ranks); None for one-rank replicas."""
        return self._replica_group

    # --- validation --------------------------------------------------------------------------------------

    def _check_degrees(self) -> None:
        """Each strategy's own degrees; tensor and context parallelism never combined."""
        name, tp, ulysses, ring, cp = self.strategy, self.tp, self.ulysses, self.ring, self.ulysses * self.ring
        for key in ("tp", "ulysses", "ring"):
            if getattr(self, key) < 1:
                _fail(f"{key}_degree must be >= 1, got {getattr(self, key)}")
        if self.cfg not in (1, 2):
            _fail(f"cfg_degree={self.cfg}: true CFG has two branches, so use cfg_degree=1 or cfg_degree=2")
        if self.cfg > 1 and name == "device_map":
            _fail("cfg_degree=2 splits the two CFG branches over two ranks, and strategy=device_map runs one process "
                  "per replica; set cfg_degree=1, or use strategy=dp / tp / cp_* with cfg_degree=2")
        if name == "dp" and (tp, ulysses, ring) != (1, 1, 1):
            _fail(f"strategy=dp ignores tp_degree/ulysses_degree/ring_degree ({tp}/{ulysses}/{ring}); pick "
                  "strategy=tp or a cp_* strategy, or set the degrees to 1")
        if tp > 1 and cp > 1:
            fix = "set ulysses_degree=1 ring_degree=1 (or use a cp_* strategy)" if name == "tp" else \
                "set tp_degree=1 (or use strategy=tp)"
            _fail(f"strategy={name} with tp_degree={tp}, ulysses_degree={ulysses}, ring_degree={ring}: tensor and "
                  f"context parallelism are not combined in one replica; {fix}")
        if name == "tp" and tp < 2:
            _fail(f"strategy=tp needs tp_degree >= 2 (got {tp}); e.g. strategy=tp tp_degree=2, or strategy=dp")
        if name == "cp_ulysses" and (ulysses < 2 or ring != 1):
            _fail(f"strategy=cp_ulysses needs ulysses_degree >= 2 and ring_degree=1 (got {ulysses}/{ring}); "
                  "e.g. strategy=cp_ulysses ulysses_degree=2, or strategy=cp_unified for both")
        if name == "cp_ring" and (ring < 2 or ulysses != 1):
            _fail(f"strategy=cp_ring needs ring_degree >= 2 and ulysses_degree=1 (got {ring}/{ulysses}); "
                  "e.g. strategy=cp_ring ring_degree=2, or strategy=cp_unified for both")
        if name == "cp_unified" and cp < 2:
            _fail("strategy=cp_unified needs ring_degree x ulysses_degree >= 2; e.g. ring_degree=2 ulysses_degree=2")
        self._check_anything()
        if name == "device_map" and (tp, ulysses, ring) != (1, 1, 1):
            _fail("strategy=device_map spreads one process over several GPUs and ignores tp/ulysses/ring degrees; "
                  "set them to 1")
        if name == "device_map" and self.gpus_per_replica < 1:
            _fail(f"strategy.gpus_per_replica={self.gpus_per_replica}: use 1 or more")

    def _check_anything(self) -> None:
        cp_strategy = self.strategy in CP_STRATEGIES
        if self.ulysses_anything and not (cp_strategy and self.ulysses > 1 and self.ring == 1):
            _fail("strategy.ulysses_anything=true needs a Ulysses-only replica (strategy=cp_ulysses, "
                  "ulysses_degree >= 2, ring_degree=1); set it to false")
        if self.ring_anything and not (cp_strategy and self.ring > 1 and self.ulysses == 1):
            _fail("strategy.ring_anything=true needs a ring-only replica (strategy=cp_ring, ring_degree >= 2, "
                  "ulysses_degree=1); set it to false")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` from 2 up (the degrees that could split ``n`` ranks, heads or tokens)."""
    return [d for d in range(2, n + 1) if n % d == 0]
