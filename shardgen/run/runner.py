"""``run_rank(cfg)``: the whole job for one rank, from config to committed shards.

Order matters and is the point of this module: everything that can be wrong with the
config, the prompt file or the run directory is found before any weight is read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from omegaconf import OmegaConf

from shardgen.dataio.prompts import (Plan, PromptSource, TruncationCheck, build_plan, check_prompt_source,
                                     checks_while_planning, estimate_rows, idle_warning, load_plan, planning_windows,
                                     prompt_file_path, rules_from_cfg)
from shardgen.dataio.resume import (check_or_write_fingerprint, compute_fingerprint,
                                    extend_if_appended, load_plan_or_discard, prompt_file_hash, read_status_ledger,
                                    record_plan_digests, remember_prompt_hash, remove_dead_launch_markers,
                                    repair_run_dir, run_settings, start_generating, stop_generating)
from shardgen.dataio.rundir import (Claimer, RankMetrics, RunDir, atomic_write_bytes, attach_rank_log, bytes_read,
                                    check_run_dir_text, check_run_root, detach_rank_log, escape_log_lines,
                                    first_missing_dir, is_url,
                                    log_to_file_only, owner_record, probe_conditional_writes, record_launch,
                                    redact_urls)
from shardgen.dataio.shards.container import ContainerError
from shardgen.dataio.shards import (SampleAnnotator, ShardSink, ShardUploader, Signals, VIDEO_EXT, VideoEncoder,
                                    is_video, resolve_samples_per_shard, run_provenance, text_windows)
from shardgen.dataio.rundir.fileio import json_bytes
from shardgen.dataio.rundir.storage import RunDirError, storage_error
from shardgen.run.generation import BatchOutOfMemory, GenSettings
from shardgen.run.memory import cuda_oom, out_of_memory
from shardgen.quality.gate import (Bounds, CalibrationFailed, calibrate, calibrates, earlier_verdict, made_for,
                                   provenance_summary, record_bytes)
from shardgen.speed.autocompile import (AutoCompile, compile_cache_counts, compiled_graphs, prior_speedup,
                                       record_key)
from shardgen.run import auto_8bit, rates
from shardgen.run.progress import Progress
from shardgen.run.replica import ReplicaContext, ReplicaWorker, expected_here
from shardgen.config.validate import validate_config
from shardgen.run.watchdog import StallWatchdog
from shardgen.run.shardrun import MadeAhead
from shardgen.models.loader import model_sha256, model_version
from shardgen.models.lora import check_planned as check_planned_adapters, preload as preload_adapters
from shardgen.models import schedulers
from shardgen.pick import pick
from shardgen.models.quiet import quiet_libraries  # noqa: F401 (also re-exported to tests and bench)
from parallel import world as W
from parallel.attention import active_backend, restore_active_backend
from parallel.dims import ParallelDims
from parallel.memory import check_memory
from parallel.strategies import apply_strategy, check_eight_bit_attention, plan_layout

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen")


@dataclass
class RankControl:
    """The launcher's handle on a running rank (instead of module globals): what to do when the rank stalls,
    and draining its writers when the job is preempted (shardgen/launch/slurm.py holds one per task)."""

    on_stall: list[Callable[[str], object]] = field(default_factory=list)
    """Run with what stalled, after the writers drained, before a stalled rank exits."""
    _sinks: list[ShardSink] = field(default_factory=list, repr=False)

    @contextlib.contextmanager
    def writing(self, sink: ShardSink | None) -> Iterator[None]:
        """Within the block, ``drain_writers`` waits for ``sink``."""
        if sink is None:
            yield
            return
        self._sinks.append(sink)
        try:
            yield
        finally:
            self._sinks.remove(sink)

    def drain_writers(self, timeout_s: float) -> int:
        """Wait until the rank's writers have made every handed-over batch durable; how many were active."""
        sinks = list(self._sinks)
        for sink in sinks:
            sink.wait_idle(timeout_s)
        return len(sinks)


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
    truncated: int = 0

    @property
    def images_per_s(self) -> float:
        return self.generated_here / self.wall_s if self.wall_s > 0 else 0.0


def prompt_path(cfg: GenerateConfig) -> Path | str:
    """The prompt file of ``cfg`` (``prompt_file_path``: a URL as it is)."""
    return prompt_file_path(cfg.prompts.path)


def prepare_run(cfg: GenerateConfig, replicas: int = 1, *, save_config: bool = True) -> Plan:
    """Check or create the run directory's fingerprint and plan, and repair what a killed job left
    (global rank 0 only; shardgen/dataio/resume/repair.py says what is repaired and what is refused).
    ``save_config``: record the resolved config (a launcher preparing before its ranks leaves that to rank 0).

    A run_dir that is not a shardgen run is refused before anything is written; a new run refused while
    planning (a bad prompt row) leaves nothing behind: what this launch created is removed again, unless its plan
    was already in place (an interrupt after planning: the run is kept and resumes)."""
    run = RunDir.at(cfg.run_dir, container=cfg.shard_container)  # a known one: validate_config checked it
    check_run_dir_text(cfg.run_dir)
    if run.store:  # a bucket that would let two replicas create one claim is refused before anything is planned
        probe_conditional_writes(run.store)
    new = check_run_root(run.root)
    top = first_missing_dir(run.root)
    path = prompt_path(cfg)
    check_prompt_source(str(path), cfg.prompts.format, cfg.prompts.field)
    if uploader := ShardUploader.from_cfg(cfg, run):
        uploader.check()  # no bucket, no permission: one line naming the URL, before planning or any weight
    source = PromptSource.from_cfg(cfg.prompts, path, rules_from_cfg(cfg))
    digest, identity = prompt_file_hash(run, path, source.format)
    fp = compute_fingerprint(cfg, digest, model_version(cfg.model), model_sha256(cfg.model))
    # rows appended to an existing run's prompt file are planned as an extension (a new run has no fingerprint)
    extend_if_appended(run, fp, source, identity["size"], lambda: planning_truncation_check(cfg, source))
    resuming = True
    try:
        resuming = check_or_write_fingerprint(run, fp, allow_change=cfg.allow_fingerprint_change, prompt_path=path)
        plan = load_plan_or_discard(run, path)
        if plan is None:
            plan = _make_plan(cfg, run, source, digest, replicas)
    except BaseException:
        # a new run stopped before its plan was in place leaves no half-made directory behind; once plan/ is renamed
        # into place (planning may have read millions of rows) the run is kept, and the same command resumes it
        if new and not resuming and not run.files.present(run.plan_json_path):
            run.files.delete(run.fingerprint_path)
            run.undo_start(top)
        raise
    if plan.run.container != run.container:
        raise ContainerError(f"{run.name} was planned with shard_container={plan.run.container}; this launch asks for "
                             f"{run.container}. Set shard_container={plan.run.container} to continue it, or choose "
                             "another run_dir")
    check_planned_adapters(plan.adapters())  # a row's LoRA file changed since planning: refused like model.loras
    if warning := idle_warning(plan.num_shards, replicas, plan.samples_per_shard):
        log.warning(warning)
    run.create()
    record_plan_digests(plan)
    repair_run_dir(plan, cfg.lease_s)
    remove_dead_launch_markers(run)
    if uploader:
        uploader.resume()  # the uploads a killed launch left unfinished
    remember_prompt_hash(run, digest, identity)
    if save_config:
        _save_config(run, cfg)
    return plan


def _make_plan(cfg: GenerateConfig, run: RunDir, source: PromptSource, digest: str, replicas: int) -> Plan:
    images = cfg.images_per_prompt
    per_shard = resolve_samples_per_shard(cfg.samples_per_shard, source, images=images, **shard_sizing(cfg, replicas))
    plan = build_plan(run, source, samples_per_shard=per_shard, run_seed=cfg.seed,
                      truncation=planning_truncation_check(cfg, source), prompt_sha256=digest, images_per_prompt=images)
    per = f" x {images} images = {plan.num_rows} samples" if images > 1 else ""
    log.info("planned %d prompts%s (%d rejected rows) into %d shards of %d in %s", plan.num_prompts, per,
             plan.num_rejects, plan.num_shards, plan.samples_per_shard, run.name)
    if is_url(source.path):
        log.info("%s: %d bytes read so far by ranged reads (the file has %d; nothing copied to disk)", source.path,
                 bytes_read(source.path), plan.meta["prompt_size"] if plan.meta else -1)
    return plan


def planning_truncation_check(cfg: GenerateConfig, source: PromptSource) -> TruncationCheck | None:
    """The token count planning does: none for on_truncation=warn (generation counts each batch)."""
    policy = cfg.prompts.on_truncation
    if not checks_while_planning(policy):
        return None
    return TruncationCheck(planning_windows(cfg.model), policy, total=estimate_rows(source), progress=cfg.progress)


def shard_sizing(cfg: GenerateConfig, replicas: int) -> dict:
    """What choosing samples_per_shard needs to know about the samples (a video run: mp4s of num_frames) and the
    replicas: this launch's ``replicas``, or ``plan_replicas`` when more launches will join the run."""
    video = is_video(cfg)
    return dict(width=cfg.width, height=cfg.height, image_format=VIDEO_EXT if video else cfg.image_format,
                frames=cfg.num_frames if video else 1, replicas=max(replicas, getattr(cfg, "plan_replicas", None) or 0),
                batch_size=cfg.batch_size)


def _save_config(run: RunDir, cfg: GenerateConfig) -> None:
    """config.yaml for the first launch; a later launch's config.<time>.yaml only when it differs from the last one
    kept (a launch repeated as it was, "nothing to do" included, adds no file). A presigned URL's secret stays out."""
    text = redact_urls(OmegaConf.to_yaml(cfg, resolve=True)).encode()
    if run.files.create(run.config_path, text):
        return
    later = sorted(n for n in run.files.names(run.root) if n.startswith("config.") and n.endswith(".yaml")
                   and n != run.config_path.name)
    try:
        if run.files.read(run.root / later[-1] if later else run.config_path) == text:
            return
    except OSError:
        pass  # unreadable: keep this launch's
    run.files.replace(run.later_config_path(time.time()), text)


def run_rank(cfg: GenerateConfig, *, control: RankControl | None = None, pipeline: Any = None,
             on_batch: Callable[[str, Any], None] | None = None) -> RunResult | None:
    """The job of one rank (all ranks call this); returns the summary on global rank 0. ``control``: the
    launcher's handle on this rank (stall hooks, draining the writers on preemption).

    ``pipeline``: use this pipeline, already on this rank's device, instead of the strategy's build
    (benchmarks and notebooks reuse one object across runs). ``on_batch(event, worker)`` is called with
    ``"start"`` just before each batch's pipeline call and ``"end"`` just after it (timing, profiling)."""
    t0 = time.time()
    control = control or RankControl()
    quiet_libraries()
    validate_config(cfg)
    world = W.init_world(cfg.device, cfg.launcher.backend)
    W.share_cpu_threads(world)
    rank_log = attach_rank_log(cfg.run_dir, world.rank)  # logs/rank<R>.log, appended across launches
    escape_log_lines()  # lines quote run files: a terminal is shown their control characters, never obeys them
    started = None
    backend = active_backend()  # a strategy's attention backend stays this job's
    try:
        layout = plan_layout(cfg, world.world_size)
        dims = layout.dims
        # with the run's settings as accepted, to find a launch that starts the run over while this one loads
        plan, settings, attention = W.on_rank0_then_share(
            lambda: _prepared_with_settings(cfg, dims.dp, world.device, dims.attention_backend))
        rank_log.start_writing()  # the run directory is accepted: the lines held so far go into the file
        # a run kept in a bucket: each rank's own scratch folder (rank 0's may be another machine's path)
        plan = load_plan(RunDir.at(cfg.run_dir) if plan.run.store else RunDir(Path(plan.run.root)), prompt_path(cfg))
        layout.check_rows(plan.shapes(), world.device.type)  # the rows' own sizes, before any weight
        if nothing_to_do(cfg, plan):
            return _finish(cfg, plan, world, t0, generated=0, nothing_to_do=True)
        if attention is not None:  # sdpa_backend=auto_8bit: the run's kernel, which this rank's GPU must run
            auto_8bit.check_runs_here(plan.run, attention, world.device)
            cfg = auto_8bit.with_choice(cfg, attention)
            check_eight_bit_attention(dims, cfg)  # and this launch's strategy must send attention through SDPA
        dims.build_mesh(world.device.type)
        if pipeline is None:
            check_memory(cfg, dims, world.device.type)  # "can't allocate memory" half-way is no message
        pipe = pipeline if pipeline is not None else apply_strategy(cfg, world, dims)
        pipe = schedulers.apply(pipe, cfg.scheduler, cfg.scheduler_shift)
        preload_adapters(pipe, plan.adapters())  # rows' own LoRAs (prompts.row_settings=[loras]), before any batch
        ctx = _replica_context(world, dims)
        # from here the run is this launch's settings' (no other launch starts it over); a leader's refusal stops
        # its replica's other ranks with its message, not in the first batch's collective it never joins
        started = _on_leader(ctx, lambda: _start_generating(plan.run, settings, attention))
        with _make_worker(cfg, plan, pipe, ctx, dims.strategy, control, on_batch) as worker, \
                control.writing(worker.sink):
            worker.run()
        log_compile_summary(worker)
        generated = _sum_over_ranks(worker.generated if ctx.leader else 0)
        result = _finish(cfg, plan, world, t0, generated=generated, writer_wait_s=worker.sink.wait_s if worker.sink else 0)
        if result is not None and worker.generated and worker.gen_s > 0:  # for a later dry_run of another run
            key = rates.rate_key(cfg, dims.strategy, dims.replica_size, rates.device_name(world.device))
            rates.record_rate(key, worker.generated / worker.gen_s, str(plan.run.root))
        return result
    except Exception as e:
        log_to_file_only(rank_log, e)
        if (full := storage_error(e)) is not None and full is not e:  # a refused write, maybe from a writer thread
            raise full from None
        if (oom := cuda_oom(e)) is not None:
            batch = e if isinstance(e, BatchOutOfMemory) else None
            raise out_of_memory(cfg, oom, batch.during if batch else "loading or preparing the model",
                                batch.batch if batch else None) from None
        raise
    finally:
        stop_generating(started)
        restore_active_backend(backend)
        W.shutdown()
        detach_rank_log(rank_log)


def _on_leader(ctx: ReplicaContext, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the replica's leader (None on its other ranks), and its error raised on every rank of the
    replica (``on_leader_then_share``): a leader that stops here never leaves its peers waiting in a collective it
    does not join (a gloo traceback, or a hang under NCCL), and its message is printed once."""
    made = []
    W.on_leader_then_share(lambda: made.append(fn()), ctx.leader_rank, ctx.group)
    return made[0] if made else None


def _start_generating(run: RunDir, settings: tuple, attention: auto_8bit.Choice | None) -> Path:
    """The replica leader's step into generating: its ``start_generating`` marker, then with
    ``sdpa_backend=auto_8bit`` the check that the run's kernel is still the one this launch took."""
    marker = start_generating(run, settings)
    if attention is not None:
        try:
            auto_8bit.check_unchanged(run, attention)
        except BaseException:
            stop_generating(marker)
            raise
    return marker


def _prepared_with_settings(cfg: GenerateConfig, replicas: int, device: Any,
                            attention_backend: str | None) -> tuple[Plan, tuple, auto_8bit.Choice | None]:
    """``prepare_run``, the run's settings as accepted, and with ``sdpa_backend=auto_8bit`` the run's attention
    kernel (pinned at its first launch; global rank 0's)."""
    plan = prepare_run(cfg, replicas)
    settings = run_settings(plan.run)
    if cfg.sdpa_backend != auto_8bit.AUTO_8BIT:
        return plan, settings, None
    choice = auto_8bit.pin(plan.run, cfg.model.pipeline, device, attention_backend, cfg.allow_fingerprint_change)
    log.info("sdpa_backend=auto_8bit: %s runs %s (%s; chosen on %s, %s)", plan.run.name, choice.sdpa_backend,
             choice.why, choice.gpu, plan.run.files.where(plan.run.attention_path))
    return plan, settings, choice


def log_compile_summary(worker: ReplicaWorker) -> None:
    """How compilation went in this process: the auto decision and the graphs compiled (bounded: one per
    block class and batch shape; a number that grows with the batches means recompilation)."""
    if worker.autocompile is not None:
        worker.autocompile.finish()
        log.info("%s", worker.autocompile.summary())
    if worker.batches.settings.accel.compile:
        cache = compile_cache_counts()
        log.info("compiled graphs in this process: %d%s", compiled_graphs(), f" ({cache})" if cache else "")


def nothing_to_do(cfg: GenerateConfig, plan: Plan) -> bool:
    """Every shard is committed, and retry_failed (if set) finds no failed sample to regenerate."""
    return len(plan.run.done_shards()) == plan.num_shards and not (cfg.retry_failed and _has_failures(plan))


def say_nothing_to_do(plan: Plan) -> None:
    """The line a launch of a complete run prints."""
    print(f"{plan.run.name}: already complete ({plan.num_rows} samples in {plan.num_shards} shards); nothing to do.")


def _has_failures(plan: Plan) -> bool:
    return read_status_ledger(plan).done.totals["failed"] > 0  # as _finish reads them: the stats cache


def _replica_context(world: W.World, dims: ParallelDims) -> ReplicaContext:
    """This rank's replica among the launch's: the world's replicas, placed among the worlds a launcher started
    side by side (launcher=ray: replica_slot)."""
    from shardgen.config.launchers import replica_slot

    rank = world.rank
    slot, slots = replica_slot()
    return ReplicaContext(index=slot * dims.dp + dims.replica_of(rank), count=slots * dims.dp,
                          leader=dims.is_leader(rank), leader_rank=dims.leader_of(rank), group=dims.replica_group(),
                          ranks=dims.replica_size, peer=dims.replica_of(rank), peers=dims.dp)


def _without_auto_compile_where_nothing_compiles(settings: GenSettings, pipe) -> GenSettings:
    """``compile: auto`` off for a transformer with no repeated blocks to compile (a pipeline no family knows):
    the default must run it eagerly, not fail as ``compile=true`` does."""
    from shardgen.speed.blocks import repeated_blocks

    tr = getattr(pipe, "transformer", None)
    if not settings.compile_auto or (tr is not None and repeated_blocks(tr)):
        return settings
    log.info("compile=auto: %s has no repeated blocks to compile regionally; running eagerly", type(tr).__name__)
    return replace(settings, compile_auto=False, accel=replace(settings.accel, compile=False))


def _make_worker(cfg: GenerateConfig, plan: Plan, pipe, ctx: ReplicaContext, strategy: str,
                 control: RankControl, on_batch: Callable[[str, Any], None] | None = None) -> ReplicaWorker:
    """The replica's worker, built complete: its settings, compile=auto's decider, and on the leader the writer,
    the claims, the metrics, the uploads and the progress bar."""
    # samples record the strategy that ran (strategy=auto resolves to one), and compile=auto follows it
    settings = _without_auto_compile_where_nothing_compiles(GenSettings.from_cfg(cfg, strategy), pipe)
    autocompile = _autocompile(plan, pipe, ctx, settings)
    # the quality gate's lossy pass runs as the first batch will
    first = _first_batch_settings(autocompile, plan, ctx, settings) if calibrates(cfg, settings) else settings
    calibrated, calibration, made_ahead = _calibrated(cfg, plan, pipe, ctx, settings, first)
    if calibrated is not settings:  # the gate fell back to lossless: compile=auto decides for those settings
        settings, autocompile = calibrated, _autocompile(plan, pipe, ctx, calibrated)
    on_stall = [lambda what: control.drain_writers(30), *control.on_stall]
    leader = _on_leader(ctx, lambda: _leader_parts(cfg, plan, pipe, ctx, settings, strategy, calibration)) or {}
    worker = ReplicaWorker(plan=plan, pipe=pipe, batch_size=cfg.batch_size, ctx=ctx, retry_failed=cfg.retry_failed,
                           settings=settings, autocompile=autocompile,
                           watchdog=StallWatchdog(cfg.stall_timeout_s, on_stall=on_stall), on_batch=on_batch,
                           made_ahead=made_ahead, **leader)
    return worker


def _first_batch_settings(autocompile: AutoCompile | None, plan: Plan, ctx: ReplicaContext,
                          settings: GenSettings) -> GenSettings:
    """The settings the replica's first batch takes: with compile=auto, its decider's choice for the work this
    replica is expected to do (made now when an earlier process's figures allow, else eager until its batches
    show), the choice the worker then keeps."""
    if autocompile is None:
        return settings
    shards_left = plan.num_shards - len(plan.run.done_shards())
    autocompile.remaining = lambda: expected_here(plan, shards_left, ctx.count)
    return autocompile.settings(settings)


def _autocompile(plan: Plan, pipe, ctx: ReplicaContext, settings: GenSettings) -> AutoCompile | None:
    """compile=auto's decider on a one-rank replica (model-parallel ranks would have to agree), also for
    compile=true, which is timed and recorded (the figures a later auto process uses); None otherwise. The worker
    it is given to binds it to its own count of the work left (``ReplicaWorker.remaining_here``)."""
    if not (settings.compile_auto or settings.accel.compile) or ctx.ranks != 1:
        return None
    shapes = [shape.label for shape in plan.shapes() or ()]  # per-row sizes: the run's shape set
    untuned = replace(settings, accel=replace(settings.accel, compile_tuning=False))
    return AutoCompile(record_key(pipe, settings, shapes), remaining=lambda: 0, shapes=max(1, len(shapes)),
                       untuned_key=record_key(pipe, untuned, shapes) if settings.tuning_auto else None,
                       prior_speedup=prior_speedup(pipe, settings.accel.fused_blocks, settings.accel.fp8),
                       decided=None if settings.compile_auto else True)


def _calibrated(cfg: GenerateConfig, plan: Plan, pipe, ctx: ReplicaContext, settings: GenSettings,
                first: GenSettings) -> tuple[GenSettings, dict | None, MadeAhead | None]:
    """The quality gate (``calibrate_samples``, shardgen/quality/gate.py) before the first batch, its lossy pass
    with ``first``, the first batch's settings: the settings the run goes on with, the figures, which replica 0's
    leader writes to RUN_DIR/calibration.json (also when the gate stops the job), and the lossy samples the run may
    take as its own (a one-rank replica's: the ranks of a model-parallel one would all have to take the same batch
    the same way). The replicas of one world split the calibration's rows."""
    if not calibrates(cfg, settings):
        return settings, None, None
    path = plan.run.calibration_path
    # named before the 2N calibration samples, not after them
    if path.is_dir() and not path.is_symlink():
        raise RunDirError(f"{path} is a directory, and the quality gate (calibrate_samples) writes its record there: "
                          "move it away, then launch again")

    def read_earlier() -> tuple[dict, dict | None]:  # this launch's made_for, and the earlier verdict it finds
        now = made_for(plan, pipe, settings, ctx.ranks, pick(Bounds, cfg))
        return now, earlier_verdict(plan, settings, now)

    # one rank reads the run's files for the others: two reads around another job's write would part them. The
    # replica's leader for its ranks; rank 0 for the whole world where several replicas split the rows (each makes
    # every peers-th row both ways), so that all of them calibrate or none does
    now, earlier = (W.on_rank0_then_share(read_earlier) if ctx.peers > 1
                    else W.on_leader_then_share(read_earlier, ctx.leader_rank, ctx.group))
    split = dict(share=(ctx.peer, ctx.peers), gather=W.on_every_rank_then_gather) if ctx.peers > 1 else {}
    try:
        settings, record, made_ahead = calibrate(cfg, plan, pipe, settings, ctx.ranks, first_batch=first,
                                                 earlier=earlier, now=now, **split)
    except CalibrationFailed as e:
        failed = e.record
        _on_leader(ctx, lambda: _write_calibration(plan, ctx, failed))
        raise
    if earlier is None:
        _on_leader(ctx, lambda: _write_calibration(plan, ctx, record))
    else:
        _on_leader(ctx, lambda: _put_back_in_the_bucket(plan, ctx, earlier))
    return settings, record, made_ahead if ctx.ranks == 1 else None


def _write_calibration(plan: Plan, ctx: ReplicaContext, record: dict | None) -> None:
    """RUN_DIR/calibration.json, by replica 0's leader; a bucket run's also in the bucket beside its files, where
    jobs.report on any machine reads it."""
    if record is not None and ctx.leader and ctx.index == 0:
        data = record_bytes(record)
        atomic_write_bytes(plan.run.calibration_path, data)
        if plan.run.store:
            plan.run.files.replace(plan.run.calibration_path, data)


def _put_back_in_the_bucket(plan: Plan, ctx: ReplicaContext, record: dict) -> None:
    """A bucket run's earlier verdict, which this machine may have read from its own copy of calibration.json (the
    bucket's lost, or its upload cut short), created in the bucket where it is missing: jobs.report on any machine
    reads it there. A create: the bucket's copy, where there is one, is left as it is."""
    if plan.run.store and ctx.leader and ctx.index == 0:
        plan.run.files.create(plan.run.calibration_path, record_bytes(record))


def _leader_parts(cfg: GenerateConfig, plan: Plan, pipe, ctx: ReplicaContext, settings: GenSettings,
                  strategy: str, calibration: dict | None = None) -> dict:
    """What only the replica's leader holds, as ReplicaWorker's fields: the annotator, the writer (sink), the
    claims, the metrics file, the uploader, and on replica 0 the progress bar. ``calibration``: the quality gate's
    figures, which join the samples' provenance (without the per-sample ones)."""
    provenance = run_provenance(cfg, pipe, model_version(cfg.model), settings.accel, strategy)
    if calibration is not None:
        provenance["calibration"] = provenance_summary(calibration)
    parts = dict(
        annotate=SampleAnnotator(provenance, text_windows(pipe, cfg.model.max_sequence_length)),
        sink=ShardSink(cfg.image_format, cfg.image_quality, cfg.writer_threads, signals=Signals(cfg.signals),
                       encoder=VideoEncoder.from_cfg(cfg) if is_video(cfg) else None),
        claimer=Claimer(plan.run, owner_record(ctx.index), lease_s=cfg.lease_s, heartbeat_s=cfg.heartbeat_s),
        metrics=RankMetrics(plan.run, rank=ctx.leader_rank, replica=ctx.index, ranks_per_replica=ctx.ranks),
        poll_s=min(2.0, cfg.heartbeat_s),
        uploader=ShardUploader.from_cfg(cfg, plan.run))
    if ctx.index == 0 and cfg.progress:
        parts["progress"] = Progress(plan, unit="video" if is_video(cfg) else "img")
        parts["on_samples"] = parts["progress"].advance
    return parts


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


def _finish(cfg: GenerateConfig, plan: Plan, world: W.World, t0: float, *, generated: int, nothing_to_do: bool = False,
            writer_wait_s: float = 0.0) -> RunResult | None:
    W.barrier()
    if world.rank != 0:
        return None
    # the whole run's counts, as jobs.status reads them: only the stats committed since the last reader are read
    # (stats_cache.npz), not every committed shard's at each job's end (100k reads per job on a 100k-shard run)
    ledger = read_status_ledger(plan, cfg.lease_s)
    totals = ledger.done.totals
    result = RunResult(run_dir=plan.run.name, total=plan.num_rows, ok=totals["ok"], failed=totals["failed"],
                       rejected=totals["rejected"], generated_here=generated, wall_s=time.time() - t0,
                       complete=ledger.count("done") == plan.num_shards, writer_wait_s=writer_wait_s,
                       truncated=totals["truncated"])
    summary = dict(result.__dict__, images_per_s=result.images_per_s, shards=plan.num_shards,
                   world_size=world.world_size)
    plan.run.files.replace(plan.run.summary_path, json_bytes(summary))
    record_launch(plan.run, summary)  # launches.jsonl: every launch's summary
    if nothing_to_do:
        say_nothing_to_do(plan)
    else:
        unit = "videos" if is_video(cfg) else "images"
        of = (f"{plan.num_prompts} prompts = {plan.num_rows} samples (the rows' own images_per_prompt)"
              if plan.per_row_images else f"{plan.num_rows} prompts" if plan.images == 1 else
              f"{plan.num_prompts} prompts x {plan.images} images = {plan.num_rows} samples")
        print(f"{plan.run.name}: {result.ok} {unit}, {result.failed} failed, {result.rejected} rejected of {of}; "
              f"generated {generated} samples this launch in {result.wall_s:.1f} s "
              f"({result.images_per_s:.2f} {unit}/s)" + ("" if result.complete else "; INCOMPLETE, re-run to continue"))
    if result.complete and result.rejected and not result.ok and not result.failed:
        log.warning("no sample was made: every row was rejected (their reasons: jobs.status %s, or the shards' "
                    "parquet index). The run holds no sample, so the same command with the fix (e.g. another "
                    "prompts.field) starts it over with the new settings", plan.run.root)
    if result.truncated and not nothing_to_do:
        log.warning("%d prompt(s) were longer than the text encoders keep: generated from their first tokens and "
                    "flagged \"truncated\": true in their json and index (prompts.on_truncation=skip or error refuses "
                    "them while planning)", result.truncated)
    return result
