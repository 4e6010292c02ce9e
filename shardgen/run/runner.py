"""``run(cfg)``: the whole job for one rank, from config to committed shards.

Order matters and is the point of this module: everything that can be wrong with the
config, the prompt file or the run directory is found before any weight is read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from shardgen.dataio.claims import Claimer, owner_record
from shardgen.dataio.fingerprint import (check_or_write_fingerprint, compute_fingerprint, prompt_file_hash,
                                remember_prompt_hash)
from shardgen.dataio.ledger import read_ledger
from shardgen.dataio.plan import Plan, build_plan, load_plan
from shardgen.dataio.prompts import check_prompt_source, read_prompts
from shardgen.dataio.repair import load_plan_or_discard, record_plan_digests, repair_run_dir
from shardgen.dataio.rundir import RunDir, atomic_write_bytes, atomic_write_json, check_run_root, create_exclusive
from shardgen.dataio.sink import ShardSink
from shardgen.run.generation import GenSettings
from shardgen.run.progress import Progress
from shardgen.run.replica import ReplicaContext, ReplicaWorker
from shardgen.config.validate import validate_config
from shardgen.run.watchdog import StallWatchdog
from shardgen.models.loader import model_version
from parallel import world as W
from parallel.strategies import apply_strategy, parallel_dims

log = logging.getLogger("shardgen")
_ACTIVE_SINKS: list[ShardSink] = []  # this process's writers, drained on preemption (shardgen/launch/slurm.py)


def drain_writers(timeout_s: float) -> int:
    """Wait until this process's writers have made every handed-over batch durable; how many were active."""
    for sink in list(_ACTIVE_SINKS):
        sink.wait_idle(timeout_s)
    return len(_ACTIVE_SINKS)


@dataclass
class RunResult:
    """What one launch did (global rank 0's view)."""

    run_dir: str
    total: int
    ok: int
    failed: int
    rejected: int
    generated_here: int
    wall_s: float
    complete: bool
    writer_wait_s: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.generated_here / self.wall_s if self.wall_s > 0 else 0.0


PROJECT_ROOT = Path(__file__).resolve().parents[2]


def prompt_path(cfg: Any) -> Path:
    """The prompt file; a relative path is taken from the current directory, else from the project
    (so the shipped examples/prompts.txt works from anywhere)."""
    path = Path(os.path.expanduser(cfg.prompts.path))
    if not path.is_absolute() and not path.exists() and (PROJECT_ROOT / path).exists():
        return PROJECT_ROOT / path
    return path.absolute()


def _limited(rows, limit: int | None):
    for row in rows:
        if limit is not None and row.index >= limit:
            return
        yield row


def prepare_run(cfg: Any) -> Plan:
    """Check or create the run directory's fingerprint and plan, and repair what a killed job left
    (global rank 0 only; shardgen/dataio/repair.py says what is repaired and what is refused)."""
    run = RunDir(Path(cfg.run_dir).absolute())
    check_run_root(run.root)
    path = prompt_path(cfg)
    check_prompt_source(str(path), cfg.prompts.format, cfg.prompts.field)
    digest, identity = prompt_file_hash(run, path)
    fp = compute_fingerprint(cfg, digest, model_version(cfg.model))
    resuming = check_or_write_fingerprint(run, fp, allow_change=cfg.allow_fingerprint_change)
    plan = load_plan_or_discard(run)
    if plan is None:
        rows = read_prompts(str(path), format=cfg.prompts.format, field=cfg.prompts.field,
                            seed_field=cfg.prompts.seed_field, on_bad_row=cfg.prompts.on_bad_row)
        try:
            plan = build_plan(run, _limited(rows, cfg.prompts.limit), samples_per_shard=cfg.samples_per_shard,
                              run_seed=cfg.seed, prompt_file=str(path))
        except Exception:
            if not resuming:  # a new run that never started: leave no half-made directory behind
                run.fingerprint_path.unlink(missing_ok=True)
            raise
        log.info("planned %d prompts (%d rejected rows) into %d shards of %d in %s", plan.num_rows, plan.num_rejects,
                 plan.num_shards, plan.samples_per_shard, run.root)
    run.create()
    record_plan_digests(plan)
    repair_run_dir(plan, cfg.lease_s)
    remember_prompt_hash(run, digest, identity)
    _save_config(run, cfg)
    return plan


def _save_config(run: RunDir, cfg: Any) -> None:
    text = OmegaConf.to_yaml(cfg, resolve=True).encode()
    if not create_exclusive(run.config_path, text):
        atomic_write_bytes(run.later_config_path(time.time()), text)


def quiet_libraries() -> None:
    """diffusers/transformers warn once per batch about prompts longer than the text encoder's
    window (truncation is expected in batch generation); keep their errors only."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def share_cpu_threads(world) -> None:
    """Ranks sharing one machine's CPU split its cores (oversubscribed BLAS threads crawl)."""
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world.device.type == "cpu" and local > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def run_rank(cfg: Any) -> RunResult | None:
    """The job of one rank (all ranks call this); returns the summary on global rank 0."""
    t0 = time.time()
    quiet_libraries()
    validate_config(cfg)
    world = W.init_world(cfg.device, cfg.launcher.backend)
    share_cpu_threads(world)
    try:
        dims = parallel_dims(cfg, world.world_size)
        plan = W.on_rank0_then_share(lambda: prepare_run(cfg))
        plan = load_plan(RunDir(Path(plan.run.root)))
        if len(plan.run.done_shards()) == plan.num_shards and not (cfg.retry_failed and _has_failures(plan)):
            return _finish(cfg, plan, world, t0, generated=0, nothing_to_do=True)
        mesh = W.build_mesh(dims, world.device)
        pipe = apply_strategy(cfg, world, dims, mesh)
        ctx = _replica_context(world, dims, mesh)
        worker = _make_worker(cfg, plan, pipe, ctx, strategy=getattr(dims, "strategy", cfg.strategy.name))
        try:
            worker.run()
        finally:
            if worker.sink:
                worker.sink.close()
                _ACTIVE_SINKS.remove(worker.sink)
            worker.watchdog.close()
            if worker.claimer:
                worker.claimer.close()
            if worker.progress:
                worker.progress.close()
        generated = _sum_over_ranks(worker.generated if ctx.leader else 0)
        return _finish(cfg, plan, world, t0, generated=generated, writer_wait_s=worker.sink.wait_s if worker.sink else 0)
    finally:
        W.shutdown()


def _has_failures(plan: Plan) -> bool:
    return read_ledger(plan).totals()["failed"] > 0


def _replica_context(world, dims, mesh) -> ReplicaContext:
    group = None
    if dims.replica_size > 1:
        names = ("tp",) if dims.tp > 1 else ("ring", "ulysses")
        group = mesh[names].get_group() if len(names) == 1 else mesh[names]._flatten().get_group()
    rank = world.rank
    return ReplicaContext(index=dims.replica_of(rank), count=dims.dp, leader=dims.is_leader(rank),
                          leader_rank=rank - rank % dims.replica_size, group=group,
                          ranks=dims.replica_size)


def _make_worker(cfg, plan: Plan, pipe, ctx: ReplicaContext, strategy: str) -> ReplicaWorker:
    # samples record the strategy that ran (strategy=auto resolves to one)
    settings = dataclasses.replace(GenSettings.from_cfg(cfg), strategy=strategy)
    worker = ReplicaWorker(plan=plan, pipe=pipe, settings=settings, batch_size=cfg.batch_size, ctx=ctx,
                           retry_failed=cfg.retry_failed,
                           watchdog=StallWatchdog(cfg.stall_timeout_s, before_exit=lambda: drain_writers(30)))
    if ctx.leader:
        worker.sink = ShardSink(cfg.image_format, cfg.image_quality, cfg.writer_threads)
        _ACTIVE_SINKS.append(worker.sink)
        worker.claimer = Claimer(plan.run, owner_record(ctx.index), lease_s=cfg.lease_s, heartbeat_s=cfg.heartbeat_s)
        worker.poll_s = min(2.0, cfg.heartbeat_s)
        if ctx.index == 0 and cfg.progress:
            worker.progress = Progress(plan)
            worker.on_samples = worker.progress.advance
    return worker


def _sum_over_ranks(n: int) -> int:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return n
    t = torch.tensor([n], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return int(t.item())


def _finish(cfg, plan: Plan, world, t0: float, *, generated: int, nothing_to_do: bool = False,
            writer_wait_s: float = 0.0) -> RunResult | None:
    W.barrier()
    if world.rank != 0:
        return None
    ledger = read_ledger(plan, cfg.lease_s)
    totals = ledger.totals()
    result = RunResult(run_dir=str(plan.run.root), total=plan.num_rows, ok=totals["ok"], failed=totals["failed"],
                       rejected=totals["rejected"], generated_here=generated, wall_s=time.time() - t0,
                       complete=ledger.count("done") == plan.num_shards, writer_wait_s=writer_wait_s)
    atomic_write_json(plan.run.summary_path, dict(result.__dict__, images_per_s=result.images_per_s,
                                                  shards=plan.num_shards, world_size=world.world_size))
    if nothing_to_do:
        print(f"{plan.run.root}: already complete ({plan.num_rows} samples in {plan.num_shards} shards); nothing to do.")
    else:
        print(f"{plan.run.root}: {result.ok} images, {result.failed} failed, {result.rejected} rejected of "
              f"{plan.num_rows} prompts; generated {generated} samples this launch in {result.wall_s:.1f} s "
              f"({result.images_per_s:.2f} images/s)" + ("" if result.complete else "; INCOMPLETE, re-run to continue"))
    return result
