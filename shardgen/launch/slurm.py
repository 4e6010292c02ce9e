"""``launcher=slurm``: submit the job through submitit; each SLURM task is one rank.

The submitted callable holds only its config. On preemption or timeout submitit calls its
``checkpoint()``: it lets the writer make the last handed-over batch durable and returns a
fresh submission of itself; the requeued job reads its progress back from the run directory.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

# not parallel.world: unpickling the submitted job imports this module before submitit installs its signal handler,
# and torch takes seconds to import: a preemption or time-limit signal in that window would kill the job
from parallel import registry
from parallel.dims import ParallelConfigError
from shardgen.dataio.rundir import RunDir
from shardgen.dataio.rundir.fileio import read_regular
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.errors import UserError
from shardgen.launch.ranks import child_config, setup_rank_logging

log = logging.getLogger("shardgen.slurm")
_SAFE_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")


class SlurmConfigError(UserError, ValueError):
    """A submission that cannot work; raised before anything reaches sbatch."""


def tasks_per_node(launcher: Any) -> int:
    """Ranks per node: as set, else one per GPU, else one."""
    return launcher.tasks_per_node or launcher.gpus_per_node or 1


def _check_text(name: str, value: Any) -> None:
    # submitit writes each parameter as an `#SBATCH --key=value` line: a newline would start a new directive
    if isinstance(value, str) and (any(c in value for c in "\n\r\0") or value != value.strip()):
        raise SlurmConfigError(f"launcher.{name}={value!r}: newlines, NUL or surrounding spaces are not allowed")


def validate_slurm(cfg: Any) -> None:
    """Check a SLURM submission against its parallel degrees, before sbatch is called."""
    from parallel.strategies import parallel_dims

    ln = cfg.launcher
    for key in ("nodes", "cpus_per_task", "time_min", "array"):
        if ln[key] < 1:
            raise SlurmConfigError(f"launcher.{key}={ln[key]}: use 1 or more")
    if ln.gpus_per_node < 0 or ln.max_num_timeout < 0 or ln.max_failures < 0:
        raise SlurmConfigError("launcher.gpus_per_node, launcher.max_num_timeout and launcher.max_failures cannot be "
                               "negative")
    tpn = tasks_per_node(ln)
    kind = registry.find(cfg.strategy.name)  # None for auto
    if ln.gpus_per_node and tpn > ln.gpus_per_node and not (kind and kind.spans_gpus_in_one_process):
        raise SlurmConfigError(
            f"launcher.tasks_per_node={tpn} > launcher.gpus_per_node={ln.gpus_per_node}: each rank needs its own GPU; "
            f"set launcher.tasks_per_node={ln.gpus_per_node} (or leave it null)")
    try:
        dims = parallel_dims(cfg, ln.nodes * tpn)
    except ParallelConfigError as e:
        raise SlurmConfigError(f"{ln.nodes} nodes x {tpn} tasks = {ln.nodes * tpn} ranks: {e}") from None
    _check_replicas_fit_nodes(ln.nodes, tpn, dims.replica_size)
    for key in ("partition", "account", "qos", "constraint", "exclude", "log_dir"):
        _check_text(key, ln[key])
    for key, value in (ln.additional_parameters or {}).items():
        if not _SAFE_KEY.match(str(key)):
            raise SlurmConfigError(f"launcher.additional_parameters key {key!r} is not a valid sbatch option name")
        _check_text(f"additional_parameters.{key}", str(value))
    _check_no_url_secret(cfg)


def _check_no_url_secret(cfg: Any) -> None:
    """A URL holding a secret (a presigned URL's signature, a password) is refused: submitit pickles the job's
    config into the run's SLURM log folder, where the run's own files keep only the URL's public form."""
    from omegaconf import OmegaConf

    from shardgen.dataio.rundir.remote import public_url, urls_in

    secret = next((url for url in urls_in(OmegaConf.to_yaml(cfg, resolve=True)) if public_url(url) != url), None)
    if secret is not None:
        raise SlurmConfigError(
            f"{public_url(secret)} carries a secret in its query or user part, and launcher=slurm would write it into "
            "the run's SLURM log folder (submitit saves the job's config there): give the file by its s3:// (or "
            "gs://, ...) path with credentials from the environment, or copy it to a path the nodes share")


def _check_replicas_fit_nodes(nodes: int, tpn: int, size: int) -> None:
    # SLURM numbers the ranks node by node and a replica is `size` consecutive ranks: a replica that straddles
    # two nodes would run its per-layer collectives over the network instead of within a node
    if nodes > 1 and (tpn % size if size <= tpn else size % tpn):
        fit = f"a multiple of {size}" if size <= tpn else f"a divisor of {size}"
        raise SlurmConfigError(
            f"replicas of {size} ranks do not fit on nodes of launcher.tasks_per_node={tpn}: some would span two "
            f"nodes; set launcher.tasks_per_node to {fit}")


def node_placement(cfg: Any, rank: int, world_size: int) -> str:
    """Where this rank runs and which replica it serves, for the job's log (``rank 2 of 4 on node2, replica 1
    = ranks 2-3``)."""
    import socket

    from parallel.strategies import parallel_dims

    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if cfg.strategy.name == registry.AUTO:  # chosen later by rank 0, once the world exists: nothing to measure here
        return f"rank {rank} of {world_size} on {node}"
    dims = parallel_dims(cfg, world_size)
    first = rank - rank % dims.replica_size
    return (f"rank {rank} of {world_size} on {node}, replica {dims.replica_of(rank)} = ranks {first}-"
            f"{first + dims.replica_size - 1}")


def make_executor(cfg: Any, log_dir: Path):
    """A submitit executor with the launcher's parameters (submitit rejects unknown ones itself)."""
    import submitit

    ln = cfg.launcher
    ex = submitit.AutoExecutor(folder=str(log_dir / "%j"), cluster="slurm", slurm_max_num_timeout=ln.max_num_timeout)
    params = dict(name=f"shardgen-{Path(cfg.run_dir).name}", nodes=ln.nodes, tasks_per_node=tasks_per_node(ln),
                  cpus_per_task=ln.cpus_per_task, timeout_min=ln.time_min, slurm_signal_delay_s=ln.signal_delay_s,
                  slurm_additional_parameters=dict(ln.additional_parameters or {}))
    if ln.kill_on_bad_exit:  # SLURM's default lets the other tasks run on, stuck in their next collective
        params["slurm_srun_args"] = ["--kill-on-bad-exit=1"]
    if ln.gpus_per_node:
        params["gpus_per_node"] = ln.gpus_per_node
    if ln.mem_gb:
        params["mem_gb"] = ln.mem_gb
    optional = dict(slurm_partition=ln.partition, slurm_account=ln.account, slurm_qos=ln.qos,
                    slurm_constraint=ln.constraint, slurm_exclude=ln.exclude, slurm_array_parallelism=ln.array_parallelism)
    params.update({k: v for k, v in optional.items() if v is not None})
    ex.update_parameters(**params)
    return ex


class GenerateJob:
    """The submitted callable: one SLURM task = one rank of ``jobs.generate``."""

    def __init__(self, cfg_yaml: str, log_level: int = logging.INFO):
        self.cfg_yaml = cfg_yaml
        self.log_level = log_level  # the submitting process's level for shardgen's loggers

    def __call__(self) -> dict | None:
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        setup_rank_logging(os.environ["RANK"], self.log_level)
        from shardgen.errors import never_retry
        from shardgen.run.runner import RankControl, run_rank

        cfg = OmegaConf.create(self.cfg_yaml)
        log.info("job %s restart %s: %s", os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0"),
                 node_placement(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
        self._control = RankControl(on_stall=[lambda what: requeue_after_failure(cfg, what)])
        try:
            result = run_rank(cfg, control=self._control)
        except Exception as e:
            # not a setup error (it would fail the same way again), nor submitit's own end (timeouts used up)
            if not never_retry(e) and requeue_after_failure(cfg, f"{type(e).__name__}: {e}"):
                log.exception("this attempt failed; the job is requeued")
                # leave no result: submitit would take this attempt's error for the job's and stop waiting
                os._exit(1)
            raise
        return None if result is None else dict(result.__dict__)

    def checkpoint(self, *args, **kwargs):
        """Preempted or timed out: let the last batch become durable, then requeue a fresh copy."""
        import submitit

        control = getattr(self, "_control", None)  # set while this task runs
        drained = control.drain_writers(timeout_s=60) if control else 0
        log.warning("checkpoint: %d writer(s) drained; progress is in the run directory; requeueing", drained)
        return submitit.helpers.DelayedSubmission(GenerateJob(self.cfg_yaml, self.log_level))


def _attempt(mark: Path) -> int:
    return int(mark.name.rsplit(".attempt", 1)[1])


def failure_marks(run_root, job_id, before: int | None = None) -> list[str]:
    """What failed on each attempt of ``job_id`` that a rank failed or stalled on (those before attempt
    ``before`` only, if given), oldest first."""
    run = RunDir.at(run_root)
    marks = sorted(run.failures_dir.glob(run.failure_mark_path(job_id, "*").name), key=_attempt)
    return [_mark_text(m) for m in marks if before is None or _attempt(m) < before]


def _mark_text(mark: Path) -> str:
    """What a failure mark says (a mark that is not a readable regular file: that it is unreadable)."""
    try:
        return read_regular(mark, follow=False, limit=1 << 16).decode("utf-8", "replace").strip()
    except (OSError, RunDirError) as e:
        return f"(unreadable failure record {mark.name}: {e})"


def requeue_after_failure(cfg: Any, reason: str) -> bool:
    """Requeue this job after one of its ranks failed or stalled, at most ``launcher.max_failures`` times
    (counted per job in ``<run_dir>/logs/failures``); True when the job is being requeued.

    Every failing rank of an attempt reaches the same decision (it depends only on earlier attempts);
    the first one to create the attempt's mark file records the reason and calls ``scontrol requeue``."""
    import subprocess

    import submitit

    job_id, attempt = submitit.JobEnvironment().job_id, int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    run = RunDir.at(cfg.run_dir)
    run.failures_dir.mkdir(parents=True, exist_ok=True)
    earlier, limit = len(failure_marks(cfg.run_dir, job_id, before=attempt)), cfg.launcher.max_failures
    try:
        fd = os.open(run.failure_mark_path(job_id, attempt), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return earlier < limit  # another rank of this attempt failed first and acts on the same decision
    with os.fdopen(fd, "w") as f:
        f.write(f"rank {os.environ.get('RANK')}: {reason}\n")
    if earlier >= limit:
        log.error("job %s: a rank failed (%s) and launcher.max_failures=%d is used up: not requeueing. Fix the cause, "
                  "then re-run the same command to continue.", job_id, reason, limit)
        return False
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60, capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError) as e:  # the original error matters more: report, do not raise
        log.error("job %s: scontrol requeue failed (%s); re-run the same command to continue", job_id, e)
        return False
    log.warning("job %s: a rank failed (%s): requeued (failure %d of launcher.max_failures=%d); the requeued job "
                "resumes from the run directory", job_id, reason, earlier + 1, limit)
    return True


def submit(cfg: Any) -> list:
    """Validate, plan, then submit ``launcher.array`` jobs; print how to watch them; optionally wait."""
    import submitit

    from shardgen.run.runner import prepare_run, prompt_path

    validate_slurm(cfg)
    plan = prepare_run(cfg)  # a bad prompt file or a changed fingerprint fails here, before sbatch
    log_dir = Path(cfg.launcher.log_dir or plan.run.slurm_logs_dir).absolute()
    log_dir.mkdir(parents=True, exist_ok=True)
    job_cfg = child_config(cfg, {"run_dir": str(plan.run.root), "prompts.path": str(prompt_path(cfg))})
    ex = make_executor(cfg, log_dir)
    try:
        with ex.batch():  # one sbatch call: a SLURM array of launcher.array jobs
            level = logging.getLogger("shardgen").getEffectiveLevel()
            jobs = [ex.submit(GenerateJob(job_cfg, level)) for _ in range(cfg.launcher.array)]
    except submitit.core.utils.FailedJobError as e:  # sbatch said no: its own words name the cause
        why = " ".join(str(e).split()) or "no message"
        raise SlurmSubmitError(f"sbatch refused the job: {why}. Check launcher.partition, launcher.gpus_per_node, "
                               f"launcher.time_min, launcher.mem_gb and launcher.additional_parameters against the "
                               f"cluster (sinfo); nothing was submitted, and {plan.run.root} keeps its plan") from None
    return _report(cfg, plan, jobs, log_dir)


class SlurmSubmitError(UserError, RuntimeError):
    """sbatch refused the submission (an unknown partition, more resources than a node has, ...)."""


def _report(cfg: Any, plan, jobs: list, log_dir: Path) -> list:
    print(f"submitted {len(jobs)} SLURM job(s) for {plan.run.root} ({plan.num_rows} prompts, {plan.num_shards} shards):")
    for j in jobs:
        print(f"  job {j.job_id}  logs {log_dir / str(j.job_id)}")
    print(f"watch:  python -m jobs.status {plan.run.root}")
    if cfg.launcher.wait:
        wait_for(jobs, plan)
    return jobs


def wait_for(jobs: list, plan) -> None:
    """Wait for the jobs; report each one's end and the run's state (a used-up timeout limit included). Ctrl-C or
    SIGTERM here stops the waiting, not the jobs: it says so, with how to watch and how to stop them (a re-run would
    submit a second set beside them), and exits 130 / 143."""
    from shardgen.run.stopping import SIGTERM_EXIT, Terminated

    try:
        _wait_for(jobs, plan)
    except KeyboardInterrupt as e:
        ids = " ".join(str(j.job_id) for j in jobs)
        log.error("stopped waiting; SLURM job(s) %s keep running for %s. Watch: python -m jobs.status %s; stop them: "
                  "scancel %s (the run keeps its progress: the same command continues it)", ids, plan.run.root,
                  plan.run.root, ids)
        raise SystemExit(SIGTERM_EXIT if isinstance(e, Terminated) else 130) from None


def _wait_for(jobs: list, plan) -> None:
    import submitit

    for j in jobs:
        try:
            results = j.results()
            r = next((x for x in results if x), None)
            print(f"job {j.job_id}: done" + (f", run {r['ok']} ok / {r['total']} complete={r['complete']}" if r else ""))
        except submitit.core.utils.UncompletedJobError as e:
            failures = failure_marks(plan.run.root, j.job_id)
            if failures:  # a rank failed or stalled (it exited without a result) on each of these attempts
                print(f"job {j.job_id}: failed {len(failures)} time(s), launcher.max_failures used up; last: "
                      f"{failures[-1]}\n  the run keeps its progress: fix the cause, then re-run the same command "
                      "to continue")
                continue
            reason = "timeout limit used up" if "too many times" in str(e) else "did not complete"
            print(f"job {j.job_id}: {reason}: {str(e).splitlines()[0]}\n  the run keeps its progress: re-run the same "
                  "command to continue (or raise launcher.time_min / launcher.max_num_timeout)")
        except Exception as e:  # a failed task: show its error, keep reporting the others
            print(f"job {j.job_id}: failed: {str(e).strip().splitlines()[-1]}")
