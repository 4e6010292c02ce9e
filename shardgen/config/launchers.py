"""The launchers, one registry: each launcher's config class (its own fields), what it means to the layers that do
not start ranks (parallel/, run/), and the function that starts the job, so that nothing checks a launcher's
name. A new launcher is a module of its own (its start function) registering its row with ``register_launcher``,
plus a YAML in conf/launcher/ naming its config as ``base_<name>`` (or a ConfigStore entry of its own).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from shardgen.config.schema import LauncherConfig, LocalLauncherConfig, RayLauncherConfig, SlurmLauncherConfig


# set by a launcher that starts its replicas as worlds of their own (launcher=ray): "i/n", this world's replica
# among the launch's n, so each walks the plan from its own place and counts the work left as its share of n
REPLICA_SLOT_ENV = "SHARDGEN_REPLICA_SLOT"


def replica_slot() -> tuple[int, int]:
    """(index, count) of this process's world among its launch's (REPLICA_SLOT_ENV), (0, 1) when none is set."""
    text = os.environ.get(REPLICA_SLOT_ENV, "")
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        return 0, 1
    return (index, count) if 0 <= index < count else (0, 1)


@dataclass(frozen=True)
class Launcher:
    """One launcher (``launcher.name``): its config class, how it starts the job, and what the code below
    shardgen/launch/ asks of it."""

    name: str
    world_size: Callable[[Any], int]
    """The ranks a launch has, from the whole config (a dry run, the checks before spawning or submitting)."""
    local_ranks: Callable[[int], int] = lambda world_size: 1
    """Ranks on this machine given the world size, unless LOCAL_WORLD_SIZE (torchrun) says."""
    described_nodes: Callable[[Any], tuple[int, int, str]] | None = None
    """(GPUs per node, ranks per node, where) of the nodes a launch will run on when this process cannot see them:
    the devices checked are the ones the config describes, and strategy=auto chooses on the nodes when the job
    starts. None: the ranks run on this machine, whose devices count."""
    config: type = LauncherConfig
    """The dataclass of ``launcher.*`` for this option: LauncherConfig's fields plus its own."""
    start: Callable[[Any], Any] = lambda cfg: run_here(cfg)
    """What runs the job with the composed config (a function that imports the launch module it calls when the job
    starts: the launch modules sit above this layer)."""
    check: Callable[[Any], str | None] = lambda launcher_cfg: None
    """A problem with the launcher config in one line (what to set instead), or None; run by validate_config."""

    def starter(self) -> Callable[[Any], Any]:
        """The start function itself."""
        return self.start


def run_here(cfg: Any) -> Any:
    """Run the job's ranks in this process (one, or this one of torchrun's)."""
    from shardgen.run.runner import run_rank

    return run_rank(cfg)


def start_local(cfg: Any) -> Any:
    """Spawn ``launcher.nprocs`` ranks on this machine and wait for them."""
    from shardgen.launch.local import start_local as start

    return start(cfg)


def typed_ranks(cfg: Any) -> int:
    """The ranks ``launcher=none`` runs: torchrun's (WORLD_SIZE) when it started this process, else one replica of
    the strategy's degrees (``strategy=tp tp_degree=4``: 4), which ``start_here`` starts on this machine, so the
    command works as typed; one for strategy=auto, which chooses within this process's devices."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    from parallel.dims import ParallelConfigError, launched_replica_size

    try:
        return launched_replica_size(cfg)
    except ParallelConfigError:  # impossible degrees: refused by the checks, in their order, as on any launcher
        return 1


def _typed_local_ranks(world_size: int) -> int:
    """Ranks on this machine: all of them where ``start_here`` spawns them; one where some other launcher set
    WORLD_SIZE without LOCAL_WORLD_SIZE (its ranks may span nodes; torchrun and submitit set both)."""
    return 1 if "WORLD_SIZE" in os.environ else world_size


def start_here(cfg: Any) -> Any:
    """``launcher=none``: this process (or this one of torchrun's), or, where one replica takes several ranks and
    nothing started them, those ranks spawned on this machine as ``launcher=local`` would."""
    from shardgen.errors import ConfigError
    from shardgen.launch.local import launch_local, launched_by_torchrun

    if launched_by_torchrun() or (nprocs := typed_ranks(cfg)) == 1:
        return run_here(cfg)
    if (tasks := int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)) > 1:  # set inside an srun step, not a batch script
        raise ConfigError(
            f"one replica of strategy={cfg.strategy.name} takes {nprocs} ranks, and this process is one of {tasks} "
            "tasks of an srun step without torch.distributed's variables (RANK, WORLD_SIZE): each task would start "
            f"{nprocs} ranks of its own on the same GPUs. Submit with launcher=slurm (one task a rank), run the "
            "command once (srun -n 1, or in the batch script), or start torchrun in each task")
    return launch_local(cfg, nprocs, said=True)


def submit_slurm(cfg: Any) -> Any:
    """Submit the job's ranks to SLURM through submitit."""
    from shardgen.launch.slurm import submit

    return submit(cfg)


LAUNCHERS: dict[str, Launcher] = {}


def register_launcher(launcher: Launcher) -> Launcher:
    """Add (or replace) a launcher row under its name; returns it."""
    LAUNCHERS[launcher.name] = launcher
    return launcher


def start_ray(cfg: Any) -> Any:
    """Run the job's replicas as Ray actors and wait for them."""
    from shardgen.launch.ray_cluster import launch

    return launch(cfg)


def _ray_replica_size(cfg: Any) -> int:
    from shardgen.launch.ray_cluster import ranks_per_replica

    return ranks_per_replica(cfg)


def _ray_nodes(cfg: Any) -> tuple[int, int, str] | None:
    """A replica is packed on one node: the GPUs it asks for are the ones its ranks see."""
    ranks = _ray_replica_size(cfg)
    gpus = 0 if cfg.device == "cpu" else int(ranks * cfg.launcher.gpus_per_rank)
    return gpus, ranks, f"each Ray replica's node (launcher.gpus_per_rank={cfg.launcher.gpus_per_rank:g})"


def _check_ray(ln: Any) -> str | None:
    if ln.replicas < 1:
        return f"launcher.replicas={ln.replicas}: use 1 or more"
    if ln.max_restarts < 0:
        return f"launcher.max_restarts={ln.max_restarts}: use 0 (stop at the first loss) or more"
    if ln.ranks_per_replica is not None and ln.ranks_per_replica < 1:
        return f"launcher.ranks_per_replica={ln.ranks_per_replica}: use 1 or more (or null: the strategy's degrees)"
    if ln.gpus_per_rank < 0 or ln.cpus_per_rank <= 0:
        return (f"launcher.gpus_per_rank={ln.gpus_per_rank:g} launcher.cpus_per_rank={ln.cpus_per_rank:g}: GPUs 0 or "
                "more, CPUs more than 0")
    return None


def _slurm_nodes(cfg: Any) -> tuple[int, int, str]:
    ln = cfg.launcher
    gpus = 0 if cfg.device == "cpu" else ln.gpus_per_node
    return gpus, ln.tasks_per_node or gpus or 1, f"each SLURM node (launcher.gpus_per_node={ln.gpus_per_node})"


def _check_local(ln: Any) -> str | None:
    return None if ln.nprocs >= 1 else f"launcher.nprocs={ln.nprocs}: use 1 or more"


# this process, torchrun's ranks when detected, or one replica's ranks started here (strategy=tp tp_degree=4)
register_launcher(Launcher("none", world_size=typed_ranks, local_ranks=_typed_local_ranks, start=start_here))
# launcher.nprocs ranks spawned on this machine
register_launcher(Launcher("local", world_size=lambda cfg: cfg.launcher.nprocs, local_ranks=lambda world_size: world_size,
                           config=LocalLauncherConfig, start=start_local,
                           check=_check_local))
# submitit: launcher.nodes x tasks per node, started later on the cluster's nodes
register_launcher(Launcher("slurm", world_size=lambda cfg: cfg.launcher.nodes * _slurm_nodes(cfg)[1],
                           described_nodes=_slurm_nodes, config=SlurmLauncherConfig, start=submit_slurm))
# Ray: launcher.replicas placement groups of ranks_per_replica actors each, on an existing (or a local) cluster
register_launcher(Launcher("ray", world_size=lambda cfg: cfg.launcher.replicas * _ray_replica_size(cfg),
                           described_nodes=_ray_nodes, config=RayLauncherConfig, start=start_ray, check=_check_ray))


def launcher_of(cfg: Any) -> Launcher:
    """The row of ``cfg.launcher.name`` (validate_config has refused a name not in LAUNCHERS)."""
    return LAUNCHERS[cfg.launcher.name]
