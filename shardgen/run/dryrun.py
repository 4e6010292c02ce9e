"""``dry_run=true``: what a launch would do, without loading a model or writing to the run directory.

The prompt file is read and planned as a launch would (bad rows fail the same way), but a new plan is
built in a temporary directory and thrown away; an existing run's plan and fingerprint are only read.
The expected time comes from this run's own measured rate (its launches); before a first launch there is
no honest figure, and the dry run says so instead of guessing.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen.config.launchers import launcher_of
from shardgen.config.sizes import format_bytes
from shardgen.dataio.prompts import (PromptSource, Shape, build_plan, check_prompt_source, detect_format, load_plan,
                                     rules_from_cfg, shape_legend)
from shardgen.dataio.resume import (compute_fingerprint, diff_fingerprints, holds_no_samples, prompt_file_hash,
                                    read_fingerprint, read_ledger)
from shardgen.dataio.rundir import RunDir, check_run_dir_text, check_run_root, read_run_jsonl
from shardgen.dataio.shards import ShardUploader, resolve_samples_per_shard, sample_bytes_estimate
from shardgen.models.loader import model_sha256, model_version

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig


@dataclass
class DryRun:
    """What a launch of a config would do (``jobs.generate dry_run=true`` prints it)."""

    run_dir: str
    prompts: int
    rejected: int
    shards: int
    samples_per_shard: int
    done_samples: int
    world_size: int
    replicas: int
    ranks_per_replica: int
    strategy: str
    sample: str
    expected_bytes: float
    rate: float | None
    """Samples/s this run measured in its last launch that generated (None: never measured)."""
    expected_s: float | None
    refused: str | None
    """Why the launch would be refused (a changed fingerprint), or None."""
    rate_source: str = "this run's last measured rate"
    """Where ``rate`` comes from: this run's launches, or another run's record (shardgen/run/rates.py)."""
    prompt_rows: int | None = None
    """Prompt rows planned (``prompts`` counts samples: more with images_per_prompt)."""
    images: int = 1
    """images_per_prompt: ``prompts`` counts samples, this many per prompt row (``rejected``: rows)."""
    shapes: dict[str, int] | None = None
    """Rows per shape (``WIDTHxHEIGHT[xFRAMES]``, most first) when rows set their own size or frames
    (prompts.row_settings); the expected size adds up each shape's samples. None: every row has the run's shape."""
    calibration: str | None = None
    """What the quality gate would do (``calibrate_samples`` with a lossy setting; gate.preview), or None."""


def world_size_of(cfg: GenerateConfig) -> int:
    """The ranks a launch of ``cfg`` would have."""
    return launcher_of(cfg).world_size(cfg)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def measured_rate(run: RunDir) -> float | None:
    """Samples/s of this run's last launch that generated anything (launches.jsonl)."""
    launches = read_run_jsonl(run, run.launches_path)
    rates = [l.get("images_per_s") for l in launches if l.get("generated_here") and l.get("images_per_s")]
    return float(rates[-1]) if rates else None


def attention_resolved(cfg: GenerateConfig, run: RunDir, device: Any, attention_backend: str | None,
                       judge_device: bool = True) -> tuple[Any, str | None]:
    """``cfg`` with ``sdpa_backend=auto_8bit`` resolved as a launch would: the run's pinned kernel once it holds a
    sample, else the one this device chooses; and why the launch would be refused for it (the pinned kernel does
    not run on ``device``, when ``judge_device``; the run holds samples and no pin). Rates are recorded under the
    kernel that ran, so an unresolved auto_8bit would find fp8-alone rates for a run that will take 8-bit
    attention."""
    from shardgen.run import auto_8bit

    if cfg.sdpa_backend != auto_8bit.AUTO_8BIT:
        return cfg, None
    try:
        pinned, choice = auto_8bit.decision(run, cfg.model.pipeline, device, attention_backend,
                                            cfg.allow_fingerprint_change)
    except auto_8bit.MissingPin as e:  # refused, and this device's choice is what it would have taken
        return auto_8bit.with_choice(cfg, auto_8bit.choose(cfg.model.pipeline, device, attention_backend)), str(e)
    try:
        if judge_device and choice is pinned:
            auto_8bit.check_runs_here(run, pinned, device)
    except auto_8bit.PinnedKernelUnavailable as e:
        return auto_8bit.with_choice(cfg, choice), str(e)
    return auto_8bit.with_choice(cfg, choice), None


def dry_run(cfg: GenerateConfig) -> DryRun:
    """Plan ``cfg``'s launch without loading a model or writing to its run directory."""
    from parallel.strategies import plan_layout
    from shardgen.dataio.shards import VIDEO_EXT, is_video
    from shardgen.quality.gate import preview
    from shardgen.run.generation import GenSettings
    from shardgen.run.runner import planning_truncation_check, prompt_path, shard_sizing

    world = world_size_of(cfg)
    layout = plan_layout(cfg, world)  # impossible degrees fail as they would at launch; auto logs its choice
    dims = layout.dims
    check_run_dir_text(cfg.run_dir)
    run = RunDir.at(cfg.run_dir)
    check_run_root(run.root)  # a run_dir the launch would refuse (not a run, /, home) is refused here too; reads only
    path = prompt_path(cfg)
    check_prompt_source(str(path), cfg.prompts.format, cfg.prompts.field)
    if uploader := ShardUploader.from_cfg(cfg, run):
        uploader.check_readable()  # no bucket, no permission, another run's folder: as the launch refuses, read-only
    old = read_fingerprint(run) if run.files.exists(run.fingerprint_path) else None
    refused = None
    if old is not None:
        digest = prompt_file_hash(run, path, detect_format(str(path), cfg.prompts.format))[0]
        diffs = diff_fingerprints(old, compute_fingerprint(cfg, digest, model_version(cfg.model),
                                                         model_sha256(cfg.model)))
        # a run without a sample takes the new settings: the launch starts it over
        if diffs and not cfg.allow_fingerprint_change and not holds_no_samples(run):
            refused = f"{run.name} was made with other settings ({'; '.join(diffs)})"
    # a host without a GPU (a login node) cannot judge the GPU the launch will get
    device = cfg.device if cfg.device != "auto" else ("cuda" if _cuda() else "cpu")
    rate_cfg, attention_refused = attention_resolved(cfg, run, device, dims.attention_backend,
                                                     judge_device=cfg.device != "auto" or device != "cpu")
    refused = refused or attention_refused
    plan = load_plan(run)
    sizing = shard_sizing(cfg, dims.dp)
    images = plan.images if plan is not None else cfg.images_per_prompt
    if plan is not None:
        counts = (plan.num_rows, plan.num_rejects, plan.num_shards, plan.samples_per_shard,
                  read_ledger(plan).done_samples)
        prompt_rows = plan.num_prompts
        shapes = plan.shapes()
    else:
        with tempfile.TemporaryDirectory(prefix="shardgen-dry-run-") as tmp:
            source = PromptSource.from_cfg(cfg.prompts, path, rules_from_cfg(cfg))
            per_shard = resolve_samples_per_shard(cfg.samples_per_shard, source, images=images, **sizing)
            # the launch's own planning: prompts are tokenized only where on_truncation makes planning count them
            new = build_plan(RunDir(Path(tmp)), source, samples_per_shard=per_shard, run_seed=cfg.seed,
                             truncation=planning_truncation_check(cfg, source), images_per_prompt=images)
            counts = (new.num_rows, new.num_rejects, new.num_shards, new.samples_per_shard, 0)
            prompt_rows = new.num_prompts
            shapes = new.shapes()
    rows, rejected, shards, per_shard, done = counts
    layout.check_rows(shapes)  # as the launch would refuse after planning
    if not shapes:  # every valid row at the run's size and frames
        shapes = {Shape(cfg.width, cfg.height, cfg.num_frames if is_video(cfg) else None): prompt_rows - rejected}
    expected = sum(n * images * sample_bytes_estimate(width=s.width, height=s.height,  # rows x images: samples
                                                      image_format=sizing["image_format"], frames=s.frames or 1)
                   for s, n in shapes.items())
    shape_rows = {s.label: n for s, n in shapes.items()} if len(shapes) > 1 or cfg.prompts.get("row_settings") \
        else None
    rate, rate_source = measured_rate(run), "this run's last measured rate"
    if rate is None:  # another run's, with the same model, size, steps, device and strategy
        from shardgen.run import rates

        rec = rates.recorded_rate(rates.rate_key(rate_cfg, dims.strategy, dims.replica_size,
                                                 rates.device_name(device)))
        if rec is not None:
            rate = rec["per_replica"] * dims.dp
            when = time.strftime("%Y-%m-%d", time.localtime(rec.get("time") or 0))
            rate_source = (f"the rate recorded for this model, size, steps, device and settings "
                           f"({rec['per_replica']:.2f} samples/s per replica, {when}, {rec.get('run_dir')}) x "
                           f"{dims.dp} replica(s)")
    calibration = preview(rate_cfg, run, GenSettings.from_cfg(rate_cfg, dims.strategy))
    what = f"{cfg.width}x{cfg.height} " + (f"{VIDEO_EXT} of {cfg.num_frames} frames" if is_video(cfg)
                                           else cfg.image_format)
    return DryRun(run_dir=run.name, prompts=rows, rejected=rejected, shards=shards, samples_per_shard=per_shard,
                  done_samples=done, world_size=world, replicas=dims.dp, ranks_per_replica=dims.replica_size,
                  strategy=" ".join(filter(None, (dims.strategy, dims.describe()))),
                  sample=f"{what}, {cfg.steps} steps, batch {cfg.batch_size}, model {cfg.model.name} "
                         f"({cfg.model.weights} weights, {cfg.dtype})",
                  expected_bytes=expected, rate=rate, expected_s=(rows - done) / rate if rate else None,
                  refused=refused, shapes=shape_rows, images=images, rate_source=rate_source, prompt_rows=prompt_rows,
                  calibration=calibration)


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def describe(d: DryRun) -> str:
    """The dry run as the lines ``jobs.generate dry_run=true`` prints."""
    left = d.prompts - d.done_samples
    time_line = (f"~{_fmt_s(d.expected_s)} for the {left} samples left, at {d.rate_source} "
                 f"({d.rate:.2f} samples/s; it scales with the replicas)" if d.expected_s is not None else
                 "not measured yet: a first launch measures it (jobs.status shows the rate and ETA); try "
                 "prompts.limit=N on another run_dir for a quick figure")
    lines = [f"dry run of {d.run_dir}: no model loaded, nothing written",
             f"  prompts   {d.prompts} ({d.rejected} rejected rows)" if d.prompt_rows in (None, d.prompts) else
             f"  prompts   {d.prompt_rows} ({d.rejected} rejected rows)" + (f" x {d.images} images" if d.images > 1
                                                                         else "") + f" = {d.prompts} samples",
             f"  shards    {d.shards} of {d.samples_per_shard} samples"
             + (f"; {d.done_samples} samples already done" if d.done_samples else ""),
             f"  ranks     {d.world_size}: {d.replicas} replica(s) of {d.ranks_per_replica} rank(s), strategy {d.strategy}",
             f"  samples   {d.sample}"]
    if d.shapes:
        lines.append("  shapes    " + ", ".join(f"{n} at {shape}" for shape, n in d.shapes.items())
                     + f" (rows per {shape_legend(d.shapes)}; prompts.row_settings)")
    lines += [f"  size      ~{format_bytes(d.expected_bytes)} of tars (estimated from the sample size"
              + (" of each shape)" if d.shapes else ")"),
              f"  time      {time_line}"]
    if d.calibration:
        lines.append(f"  quality   {d.calibration}")
    if d.refused:
        lines.append(f"  REFUSED   this launch would be refused: {d.refused}")
    return "\n".join(lines)
