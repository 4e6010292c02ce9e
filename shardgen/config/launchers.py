"""The launchers, one table: what each one means to the layers that do not start ranks (parallel/, run/), so that
none of them checks a launcher's name. Starting the ranks is shardgen/launch/ (jobs/generate.py picks
the launcher module); a new launcher adds its row here, its module there and its YAML in conf/launcher/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Launcher:
    """One launcher (``launcher.name``) as the code below shardgen/launch/ sees it."""

    name: str
    world_size: Callable[[Any], int]
    """The ranks a launch has, from the launcher config (a dry run, the checks before spawning or submitting)."""
    local_ranks: Callable[[int], int] = lambda world_size: 1
    """Ranks on this machine given the world size, unless LOCAL_WORLD_SIZE (torchrun) says."""
    described_nodes: Callable[[Any], tuple[int, int, str]] | None = None
    """(GPUs per node, ranks per node, where) of the nodes a launch will run on when this process cannot see them:
    the devices checked are the ones the config describes, and strategy=auto chooses on the nodes when the job
    starts. None: the ranks run on this machine, whose devices count."""


def _slurm_nodes(cfg: Any) -> tuple[int, int, str]:
    ln = cfg.launcher
    gpus = 0 if cfg.device == "cpu" else ln.gpus_per_node
    return gpus, ln.tasks_per_node or gpus or 1, f"each SLURM node (launcher.gpus_per_node={ln.gpus_per_node})"


LAUNCHERS = {launcher.name: launcher for launcher in (
    # this process, or torchrun's ranks when detected
    Launcher("none", world_size=lambda ln: int(os.environ.get("WORLD_SIZE", "1"))),
    # launcher.nprocs ranks spawned on this machine
    Launcher("local", world_size=lambda ln: ln.nprocs, local_ranks=lambda world_size: world_size),
    # submitit: launcher.nodes x tasks per node, started later on the cluster's nodes
    Launcher("slurm", world_size=lambda ln: ln.nodes * (ln.tasks_per_node or ln.gpus_per_node or 1),
             described_nodes=_slurm_nodes),
)}


def launcher_of(cfg: Any) -> Launcher:
    """The row of ``cfg.launcher.name`` (validate_config has refused a name not in LAUNCHERS)."""
    return LAUNCHERS[cfg.launcher.name]
