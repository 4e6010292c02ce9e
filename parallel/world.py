"""The world of ranks: detecting it, its device, the process group, and sharing objects between ranks.

The degrees and the device mesh are parallel/dims.py's (``ParallelDims``).
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

from parallel.registry import ParallelConfigError
from shardgen.errors import UserError

log = logging.getLogger("shardgen.world")


@dataclass
class World:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None


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


def share_cpu_threads(world: World) -> None:
    """Ranks sharing one machine's CPU split its cores (oversubscribed BLAS threads crawl)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world.device.type == "cpu" and local > 1 and not os.environ.get("OMP_NUM_THREADS"):  # a launcher's count wins
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


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
    return _one_then_share(fn, 0, None)


def on_leader_then_share(fn: Callable[[], Any], leader: int, group: Any) -> Any:
    """Run ``fn`` on a replica's leader (global rank ``leader``) and hand its result, or its error, to every rank
    of ``group`` (the replica's), so that a leader's refusal stops its peers with the same message instead of
    leaving them in a collective it never joins. ``group`` None: a one-rank replica, whose leader runs ``fn``
    alone."""
    return fn() if group is None else _one_then_share(fn, leader, group)


def _one_then_share(fn: Callable[[], Any], src: int, group: Any) -> Any:
    """``fn``'s result or error on global rank ``src``, shared with every rank of ``group`` (None: all)."""
    result: Any = None
    if not dist.is_initialized() or dist.get_rank() == src:
        try:
            result = ("ok", fn())
        except Exception as e:  # shared, then raised everywhere (the source re-raises the original)
            if not dist.is_initialized():
                raise
            result = ("error", _shareable(e))
            error = e
    shared = broadcast_object(result, src, group)
    if shared[0] == "error":
        if dist.get_rank() == src:
            raise error
        _raise_echo(shared[1])
    return shared[1]


def on_every_rank_then_gather(fn: Callable[[], Any]) -> list[Any]:
    """``fn``'s result on every rank of the world, gathered on every rank (a list in global rank order): work the
    ranks split, whose results they all need. Where ``fn`` raised on any rank, every rank raises (the first such
    rank's error; that rank its own), so that none goes on alone or waits in a later collective for one that
    stopped."""
    try:
        mine = ("ok", fn())
    except Exception as e:
        if not dist.is_initialized():
            raise
        mine, error = ("error", _shareable(e)), e
    if not dist.is_initialized():
        return [mine[1]]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for src, (status, value) in enumerate(everyone):
        if status == "error":
            if src == dist.get_rank():
                raise error
            _raise_echo(value)
    return [value for _, value in everyone]


def _shareable(e: Exception) -> Exception:
    """``e``, or where it cannot be pickled to another rank, a RemoteError with its message."""
    try:
        pickle.dumps(e)
    except Exception:
        return RemoteError(str(e))
    return e


def _raise_echo(err: Exception) -> None:
    """Raise another rank's error here, marked as its echo: the rank it came from says it, and the launcher
    (torchrun) need not print it once per rank."""
    err.echo_of_rank0 = True
    raise err


def echo_of_rank0(e: BaseException) -> bool:
    """True for an error this rank raised because rank 0, its replica's leader or another rank did
    (``on_rank0_then_share``, ``on_leader_then_share``, ``on_every_rank_then_gather``): that rank reports it."""
    return getattr(e, "echo_of_rank0", False) is True


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group if we made one."""
    if dist.is_initialized():
        dist.destroy_process_group()
