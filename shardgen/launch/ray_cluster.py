"""launcher=ray: the job's replicas as Ray actors on an existing cluster (or a local one started for the launch).

Each replica is a placement group of ``ranks_per_replica`` bundles (``gpus_per_rank`` GPUs and ``cpus_per_rank``
CPUs each) packed on one node, since tensor and context parallelism exchange activations at every layer; each
bundle holds one actor, a rank. The ranks of a replica form a torch.distributed world of their own (NCCL on GPUs,
gloo on CPU) that meets at its first actor's node, and run the same ``run_rank`` as torchrun's and SLURM's ranks over
the same run directory. Replicas share the shards through the run directory's claims, as the jobs of a SLURM array
do, so a lost actor stops its own replica only.

This process (the driver) plans the run first: a bad prompt file or a changed fingerprint stops the launch here,
before any actor starts. Then it starts every replica and waits:

- an actor or node lost (the actor's process died, its node left the cluster): the replica's other actors are
  killed (their peer is gone: they would wait in a collective until its timeout) and the replica is started again,
  at most ``max_restarts`` times. Its shard's claim is taken over at once: the new ranks are told which processes
  ended (``ENDED_ENV``: their host, pid and when), whichever node they ran on; the shard resumes after its last
  durable sample.
- a rank's user error (a setting that cannot work) stops the launch with that error's message.
- the driver itself dies: Ray ends the actors it owns, and the same command continues the run.

Each rank's log is ``<run_dir>/logs/ray/replicaNNN.rankN.log`` (appended across launches), beside what Ray keeps
in its own session logs; the ranks' console lines reach this terminal through Ray, tagged with their replica.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from shardgen.config.launchers import REPLICA_SLOT_ENV
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.liveness import ENDED_ENV, host_name
from shardgen.errors import UserError, is_user_error
from shardgen.launch.ranks import child_config, setup_rank_logging

log = logging.getLogger("shardgen.ray")

# what the driver's environment passes on to every actor (a cluster's nodes keep their own environment otherwise):
# shardgen's own settings (its model cache, debug tracebacks) and where this checkout's code is found
FORWARDED_PREFIXES = ("SHARDGEN_",)
FORWARDED_NAMES = ("PYTHONPATH",)


class RayMissingError(UserError, ImportError):
    """launcher=ray without Ray installed."""


class RayClusterError(UserError, RuntimeError):
    """The Ray cluster cannot run the launch as configured (too small, unreachable); the message says what it has."""


class RayReplicaLostError(UserError, RuntimeError):
    """A replica kept losing actors or nodes past ``launcher.max_restarts``."""


class RayRankError(UserError, RuntimeError):
    """A rank stopped on a user error (its message is this one's)."""


def import_ray():
    """The ``ray`` module, or RayMissingError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissingError("launcher=ray needs Ray: pip install 'shardgen[ray]' (or pip install ray), then run "
                              "the same command again") from None
    return ray


def ranks_per_replica(cfg: Any) -> int:
    """The actors one replica takes: ``launcher.ranks_per_replica``, else what the strategy's degrees make (one rank
    for strategy=auto, which then chooses within that rank's devices)."""
    if cfg.launcher.ranks_per_replica:
        return int(cfg.launcher.ranks_per_replica)
    from parallel.dims import launched_replica_size

    return launched_replica_size(cfg)


def gpus_per_rank(cfg: Any) -> float:
    """The GPUs each rank asks Ray for: none with device=cpu."""
    return 0.0 if cfg.device == "cpu" else float(cfg.launcher.gpus_per_rank)


def forwarded_env() -> dict[str, str]:
    """The driver's variables every actor gets (FORWARDED_PREFIXES, FORWARDED_NAMES)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def rank_log_path(run_root: str, replica: int, rank: int) -> Path:
    """Where the actor of ``rank`` in ``replica`` logs, inside the run directory."""
    return RunDir.at(run_root).ray_logs_dir / f"replica{replica:03d}.rank{rank}.log"


class RankActor:
    """One rank of one replica (a Ray actor: ``ray.remote`` wraps this class when the launch starts)."""

    def where(self, want_port: bool) -> dict:
        """This actor's node, the GPUs Ray gave it, and (``want_port``) a free port on its node for the rendezvous."""
        import ray

        port = None
        if want_port:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        ctx = ray.get_runtime_context()
        return dict(ip=ray.util.get_node_ip_address(), node=ctx.get_node_id(), port=port, pid=os.getpid(),
                    host=host_name(), gpus=[str(g) for g in ray.get_gpu_ids()])

    def run(self, cfg_yaml: str, env: dict[str, str], log_level: int, log_path: str, tag: str) -> dict | None:
        """Run the rank (``run_rank``) with the torch.distributed environment ``env``; its RunResult as a dict on
        the replica's rank 0, None on the others, ``{"user_error": message}`` for a user error."""
        os.environ.update(env)
        logging.getLogger().handlers.clear()  # Ray's worker handler would print each line a second time
        setup_rank_logging(tag, log_level)
        from shardgen.dataio.rundir.runlog import RankLogHandler
        from shardgen.run.runner import run_rank

        handler = None
        try:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            handler = RankLogHandler(Path(log_path))  # never written through a symlink or into a FIFO
            handler.setFormatter(logging.Formatter(f"[%(asctime)s][{tag}][%(name)s][%(levelname)s] %(message)s"))
            handler.start_writing()  # the driver planned the run: its directory is a run's
            logging.getLogger().addHandler(handler)
            result = run_rank(OmegaConf.create(cfg_yaml))
        except Exception as e:
            if is_user_error(e) and os.environ.get("SHARDGEN_DEBUG", "") in ("", "0"):
                logging.getLogger("shardgen").error("stopped: %s", e)
                return {"user_error": str(e)}
            logging.getLogger("shardgen").exception("the rank failed")
            raise
        finally:
            if handler is not None:
                handler.flush()
        return None if result is None else dict(result.__dict__)


@dataclass
class Replica:
    """One replica's placement group and actors, as the driver tracks them."""

    index: int
    restarts: int = 0
    pg: Any = None
    actors: list = field(default_factory=list)
    refs: dict = field(default_factory=dict)
    """The pending ``run`` calls: object ref -> rank."""
    results: list = field(default_factory=list)
    done: bool = False
    places: list = field(default_factory=list)
    """What each actor's ``where`` said (host, pid, ...), while it runs."""
    ended: list = field(default_factory=list)
    """"host:pid:time" of the actors this replica lost or had killed: its next start takes their claims over at once."""

    def stop(self, ray) -> None:
        """Kill its actors and free its placement group (a finished or a lost replica)."""
        now = time.time()
        self.ended += [f"{p['host']}:{p['pid']}:{now:.3f}" for p in self.places]
        self.places = []
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone with its node)
                pass
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
        self.pg, self.actors, self.refs = None, [], {}


class RayLaunch:
    """The driver's side of one launch: places the replicas, starts their ranks, restarts lost ones."""

    def __init__(self, ray, cfg: Any, job_cfg: str, run_root: str):
        self.ray, self.cfg, self.job_cfg, self.run_root = ray, cfg, job_cfg, run_root
        ln = cfg.launcher
        self.size, self.gpus, self.cpus = ranks_per_replica(cfg), gpus_per_rank(cfg), float(ln.cpus_per_rank)
        self.replicas = [Replica(i) for i in range(ln.replicas)]
        self.pending: dict = {}  # object ref -> (replica, "placed" | "rank")
        self.level = logging.getLogger("shardgen").getEffectiveLevel()
        self.actor_cls = ray.remote(RankActor)

    def place(self, r: Replica) -> None:
        """Ask the cluster for the replica's bundles, packed on one node."""
        from ray.util.placement_group import placement_group

        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        r.pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="STRICT_PACK",
                               name=f"shardgen-{os.getpid()}-replica{r.index}-{r.restarts}")
        self.pending[r.pg.ready()] = (r, "placed")

    def start(self, r: Replica) -> None:
        """Create the replica's actors in its bundles and start their ranks."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = dict(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0)
        r.actors = [self.actor_cls.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=r.pg, placement_group_bundle_index=i)).remote() for i in range(self.size)]
        from ray.exceptions import RayActorError

        try:
            places = self.ray.get([a.where.remote(i == 0) for i, a in enumerate(r.actors)])
        except RayActorError as e:  # an actor died (or its node left) before its rank started
            self._lost(r, 0, e)
            return
        r.places = places
        visible = sorted({g for p in places for g in p["gpus"]}, key=lambda g: (len(g), g))  # one node: STRICT_PACK
        for rank, (actor, p) in enumerate(zip(r.actors, places)):
            env = self._rank_env(r, rank, places[0], visible, p["gpus"])
            tag = f"replica {r.index} rank {rank}"
            ref = actor.run.remote(self.job_cfg, env, self.level, str(rank_log_path(self.run_root, r.index, rank)),
                                   tag)
            r.refs[ref] = rank
            self.pending[ref] = (r, "rank")
        log.info("replica %d: %d rank(s) on node %s (pids %s)%s", r.index, self.size, places[0]["ip"],
                 ", ".join(str(p["pid"]) for p in places), f", restart {r.restarts}" if r.restarts else "")

    def _rank_env(self, r: Replica, rank: int, first: dict, visible: list[str], mine: list[str]) -> dict[str, str]:
        """torchrun's variables for ``rank`` of replica ``r``: its own world, meeting at the first actor's node. On
        GPUs every rank sees the replica's GPUs (NCCL then reaches its peers directly) and takes its own."""
        env = dict(RANK=str(rank), WORLD_SIZE=str(self.size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(self.size),
                   MASTER_ADDR=first["ip"], MASTER_PORT=str(first["port"]),
                   **{REPLICA_SLOT_ENV: f"{r.index}/{len(self.replicas)}"})
        if r.ended:  # its lost actors' claims: taken over at once, not after lease_s (they ran on other nodes too)
            env[ENDED_ENV] = ",".join(r.ended[-64:])
        if visible:
            env.update(CUDA_VISIBLE_DEVICES=",".join(visible), LOCAL_RANK=str(visible.index(mine[0])))
        else:
            env["OMP_NUM_THREADS"] = str(max(1, int(self.cpus)))
        return env

    def run(self) -> list[dict]:
        """Place and run every replica until each has finished; the replicas' rank-0 results."""
        for r in self.replicas:
            self.place(r)
        deadline = time.monotonic() + float(self.cfg.launcher.placement_timeout_s)
        placed_once = False
        try:
            while not all(r.done for r in self.replicas):
                ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=5.0)
                if not ready:
                    if not placed_once and time.monotonic() > deadline:
                        raise RayClusterError(self._unplaced_message())
                    continue
                r, kind = self.pending.pop(ready[0])
                if kind == "placed":
                    placed_once = True
                    self.start(r)
                else:
                    self._rank_ended(r, ready[0])
        finally:
            for r in self.replicas:
                r.stop(self.ray)
        return [res for r in self.replicas for res in r.results if res]

    def _rank_ended(self, r: Replica, ref) -> None:
        rank = r.refs.pop(ref, None)
        if rank is None:  # a call of an actor already stopped with its replica
            return
        from ray.exceptions import RayActorError

        try:
            out = self.ray.get(ref)
        except RayActorError as e:
            self._lost(r, rank, e)
            return
        if isinstance(out, dict) and "user_error" in out:
            raise RayRankError(out["user_error"])
        r.results.append(out)
        if not r.refs:
            r.done = True
            r.stop(self.ray)

    def _lost(self, r: Replica, rank: int, e: BaseException) -> None:
        """An actor (or its node) of ``r`` is gone: stop the rest of the replica and start it again."""
        why = " ".join(str(e).split())[:300]
        for ref in list(r.refs):
            self.pending.pop(ref, None)
        r.stop(self.ray)
        if r.restarts >= self.cfg.launcher.max_restarts:
            raise RayReplicaLostError(
                f"replica {r.index} lost rank {rank} ({why}) after {r.restarts} restart(s) "
                f"(launcher.max_restarts={self.cfg.launcher.max_restarts}); re-run the same command to continue: the "
                "run directory keeps every durable sample")
        r.restarts += 1
        log.warning("replica %d lost rank %d (%s); starting it again (restart %d of %d): its shard resumes after "
                    "its last durable sample", r.index, rank, why, r.restarts, self.cfg.launcher.max_restarts)
        self.place(r)

    def _unplaced_message(self) -> str:
        have = self.ray.cluster_resources()
        return (f"the Ray cluster placed no replica in launcher.placement_timeout_s="
                f"{self.cfg.launcher.placement_timeout_s:g} s: one needs {self.size} x ({self.cpus:g} CPU"
                f"{f', {self.gpus:g} GPU' if self.gpus else ''}) on one node; it has {_resources(have)} in all. Free "
                "resources, add nodes, or lower launcher.cpus_per_rank / launcher.gpus_per_rank")


def _resources(res: dict) -> str:
    return f"{res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU on {sum(1 for k in res if k.startswith('node:') and k != 'node:__internal_head__')} node(s)"


def cluster_address(cfg: Any) -> str | None:
    """``launcher.address``, else RAY_ADDRESS, else None (a cluster started on this machine)."""
    return cfg.launcher.address or os.environ.get("RAY_ADDRESS") or None


def check_reachable(address: str | None, timeout_s: float = 10.0) -> None:
    """Refuse, in one line and before the run is planned, a ``HOST:PORT`` (or ``ray://HOST:PORT``) nothing answers
    at: ray.init would retry it for minutes without a word. ``auto`` and None are left to ray.init."""
    text = (address or "").removeprefix("ray://")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RayClusterError(f"nothing answers at the Ray cluster address {address} ({e.strerror or e}); check "
                              "launcher.address / RAY_ADDRESS (`ray status` on a node prints it), or leave both unset "
                              "to start a cluster on this machine") from None


CONNECT_ATTEMPTS = 3  # ray.init tries on a cluster that answers: a head busy ending a job can miss one handshake
# Ray waits 5 s for the head's GCS by default, which a head that answers TCP but is busy (ending a job, on a loaded
# machine) can miss; tried CONNECT_ATTEMPTS times, that wait is the launch's patience. A user's own setting is kept.
GCS_CONNECT_ENV, GCS_CONNECT_TIMEOUT_S = "RAY_gcs_rpc_server_connect_timeout_s", "30"


def connect(ray, cfg: Any, attempts: int = CONNECT_ATTEMPTS, pause_s: float = 5.0) -> None:
    """ray.init on ``launcher.address`` (else RAY_ADDRESS, else a local cluster), the driver's SHARDGEN_* and
    PYTHONPATH handed to every actor; one line when the cluster cannot be reached after ``attempts`` tries."""
    address = cluster_address(cfg)
    os.environ.setdefault(GCS_CONNECT_ENV, GCS_CONNECT_TIMEOUT_S)  # read by ray.init's core worker
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, runtime_env={"env_vars": forwarded_env()}, log_to_driver=True,
                     logging_level=logging.WARNING, configure_logging=True)
            break
        except (ConnectionError, RuntimeError, ValueError) as e:
            reason = " ".join(str(e).split())
            ray.shutdown()  # a half-made connection would make the next ray.init refuse to start
            if attempt == attempts:
                raise RayClusterError(
                    f"cannot reach the Ray cluster at {address} after {attempts} tries ({reason[:300]}); check "
                    "launcher.address / RAY_ADDRESS (ray status on a node prints it), or leave both unset to start "
                    "a cluster on this machine") from None
            log.warning("connecting to the Ray cluster at %s failed (%s); trying again in %g s", address,
                        reason[:300], pause_s)
            time.sleep(pause_s)
    from shardgen.run.stopping import stop_on_sigterm

    stop_on_sigterm()  # ray.init put its own SIGTERM handler (a stack dump) in place of the job's clean stop


def check_cluster(ray, cfg: Any) -> None:
    """Refuse, in one line, a cluster that cannot hold one replica even when idle (a placement would wait for ever)."""
    size, gpus, cpus = ranks_per_replica(cfg), gpus_per_rank(cfg), float(cfg.launcher.cpus_per_rank)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = any(n["Resources"].get("CPU", 0) >= size * cpus and n["Resources"].get("GPU", 0) >= size * gpus
               for n in nodes)
    if not fits:
        gpu_hint = " (set device=cpu for CPU ranks)" if gpus and not any(n["Resources"].get("GPU") for n in nodes) \
            else ""
        raise RayClusterError(
            f"no node of the Ray cluster can hold one replica: it needs {size} rank(s) x ({cpus:g} CPU"
            f"{f', {gpus:g} GPU' if gpus else ''}) on one node; the cluster has {_resources(ray.cluster_resources())}"
            f"{gpu_hint}. Lower launcher.cpus_per_rank / launcher.gpus_per_rank or the degrees, or add a larger node")


def launch(cfg: Any) -> Any:
    """``launcher=ray``: plan, connect, run ``launcher.replicas`` replicas to the run's end; print the run's line."""
    from parallel.strategies import parallel_dims
    from shardgen.dataio.shards import is_video
    from shardgen.run.runner import RunResult, nothing_to_do, prepare_run, prompt_path, say_nothing_to_do

    t0 = time.time()
    ray = import_ray()
    ln = cfg.launcher
    parallel_dims(cfg, ln.replicas * ranks_per_replica(cfg))  # impossible degrees fail here, before any actor
    check_reachable(cluster_address(cfg))  # a wrong address fails here, before the plan is written
    plan = prepare_run(cfg, ln.replicas, save_config=False)  # each replica's rank 0 prepares again and records it
    if nothing_to_do(cfg, plan):
        say_nothing_to_do(plan)
        return None
    root = str(plan.run.root)
    job_cfg = child_config(cfg, {"run_dir": root, "prompts.path": str(prompt_path(cfg))})
    connect(ray, cfg)
    try:
        check_cluster(ray, cfg)
        print(f"{root}: {ln.replicas} Ray replica(s) of {ranks_per_replica(cfg)} rank(s); rank logs in "
              f"{plan.run.ray_logs_dir}; watch: python -m jobs.status {root}", flush=True)
        results = RayLaunch(ray, cfg, job_cfg, root).run()
    except KeyboardInterrupt as e:
        from shardgen.run.stopping import Terminated, sigterm_received

        if sigterm_received() and not isinstance(e, Terminated):  # Ray's calls re-raise it as a KeyboardInterrupt
            raise Terminated() from None
        raise
    finally:
        ray.shutdown()
    if not results:
        return None
    last = max(results, key=lambda x: x["wall_s"])  # the replica that ended last read the whole run's counts
    generated = sum(x["generated_here"] for x in results)
    result = RunResult(**{**last, "generated_here": generated, "wall_s": time.time() - t0})
    unit = "videos" if is_video(cfg) else "images"
    print(f"{root}: {result.ok} {unit}, {result.failed} failed, {result.rejected} rejected of {result.total} samples; "
          f"generated {generated} this launch on {ln.replicas} Ray replica(s) in {result.wall_s:.1f} s"
          + ("" if result.complete else "; INCOMPLETE, re-run to continue"), flush=True)
    return result
