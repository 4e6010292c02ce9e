"""The world of ranks: detecting it, the process group, and the one place the device mesh is built.

Mesh = dp x (tp) or dp x (ring x ulysses). A *replica* is one dp slice: all its ranks get the
same prompts and generators; only its leader (the slice's first rank) claims shards and writes.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from shardgen.errors import UserError

log = logging.getLogger("shardgen.world")


class ParallelConfigError(UserError, ValueError):
    """Parallel degrees that cannot work; the message says what to change."""


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of one job. ``__post_init__`` checks they fit the world; nothing else does."""

    world_size: int
    tp: int = 1
    """Tensor-parallel ranks per replica."""
    ulysses: int = 1
    """Ulysses context-parallel ranks per replica."""
    ring: int = 1
    """Ring context-parallel ranks per replica."""
    dp: int = field(init=False)
    """Replicas (data parallel), derived: world_size / (tp * ulysses * ring)."""

    def __post_init__(self):
        for name in ("tp", "ulysses", "ring"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"{name}_degree must be >= 1, got {getattr(self, name)}")
        if self.tp > 1 and self.ulysses * self.ring > 1:
            raise ParallelConfigError(
                f"tp_degree={self.tp} with ulysses_degree={self.ulysses}, ring_degree={self.ring}: tensor and "
                "context parallelism are not combined in one replica; set tp_degree=1 or the cp degrees to 1")
        if self.world_size % self.replica_size:
            raise ParallelConfigError(
                f"{self.replica_size} ranks per replica (tp {self.tp} x ulysses {self.ulysses} x ring {self.ring}) "
                f"do not divide the world of {self.world_size} ranks; launch a multiple of {self.replica_size} ranks "
                f"(e.g. launcher=local launcher.nprocs={self.replica_size}) or lower the degrees")
        self.dp = self.world_size // self.replica_size

    @property
    def replica_size(self) -> int:
        return self.tp * self.ulysses * self.ring

    def replica_of(self, rank: int) -> int:
        """The dp index of ``rank`` (ranks of a replica are contiguous, so they share a node when they can)."""
        return rank // self.replica_size

    def is_leader(self, rank: int) -> bool:
        return rank % self.replica_size == 0


@dataclass
class World:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun / submitit / our local launcher's variables."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def choose_device(pref: str, local_rank: int) -> torch.device:
    """The device of this rank: ``auto`` picks CUDA when present (one GPU per local rank)."""
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ParallelConfigError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
        if pref == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise ParallelConfigError(
                    f"local rank {local_rank} needs a GPU but only {torch.cuda.device_count()} are visible; "
                    "launch at most one rank per GPU")
            return torch.device("cuda", local_rank)
    return torch.device(pref)


def init_world(device_pref: str = "auto", backend: str | None = None) -> World:
    """Detect the ranks and start the process group when there are several."""
    rank, world_size, local_rank = env_world()
    device = choose_device(device_pref, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    if world_size > 1:
        world.backend = backend or ("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(world.backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=60),
                                    device_id=device if device.type == "cuda" else None)
        log.info("rank %d/%d on %s (%s)", rank, world_size, device, world.backend)
    return world


def build_mesh(dims: ParallelDims, device: torch.device):
    """The job's device mesh: ("dp", "tp") or ("dp", "ring", "ulysses"); None for one process."""
    if dims.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if dims.tp > 1:
        return init_device_mesh(device.type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device.type, (dims.dp, dims.ring, dims.ulysses), mesh_dim_names=("dp", "ring", "ulysses"))


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """``obj`` from rank ``src`` (global rank) to every rank of ``group``; a no-op without a process group."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class RemoteError(UserError, RuntimeError):
    """An error raised on another rank, re-raised here so every rank stops with the same message."""


def on_rank0_then_share(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on global rank 0 and hand its result, or its error, to every rank."""
    result: Any = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = ("ok", fn())
        except Exception as e:  # shared, then raised everywhere (rank 0 re-raises the original)
            if not dist.is_initialized():
                raise
            result = ("error", e)
    shared = broadcast_object(result)
    if shared[0] == "error":
        if dist.get_rank() == 0:
            raise shared[1]
        err = shared[1]
        try:
            pickle.dumps(err)
        except Exception:
            err = RemoteError(str(err))
        raise err
    return shared[1]


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group if we made one."""
    if dist.is_initialized():
        dist.destroy_process_group()
