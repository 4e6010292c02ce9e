"""The two ways the benchmark compares, on one shared pipeline object: the diffusers guide's loop (``run_baseline``,
called with exactly the generation arguments the job uses) and shardgen's job (``run_shardgen``, through
``run_rank``'s supported ``pipeline=`` and ``on_batch=`` hooks)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from shardgen.bench.measure import (TransformerTimer, compiled_graphs, gpu_busy_s, peak_memory, psnr_stats,
                                    read_outputs, reset_peak, sync)


def baseline_kwargs(pipe, cfg, prompt: str, seed: int) -> dict:
    """The seed loop's keyword arguments for one prompt: the job's own (``pipeline_kwargs``: guidance,
    text length, ``true_cfg_scale`` and ``negative_prompt`` for true-CFG models), the prompt by keyword
    (Flux2Pipeline's first parameter is ``image``), one CPU generator, the pipeline's default PIL output."""
    from shardgen.run.generation import GenSettings, pipeline_kwargs

    kw = pipeline_kwargs(pipe, GenSettings.from_cfg(cfg), [prompt], [seed])
    kw.pop("output_type")
    kw.update(prompt=prompt, generator=kw["generator"][0])
    if "negative_prompt" in kw:
        kw["negative_prompt"] = kw["negative_prompt"][0]
    return kw


def run_baseline(pipe, cfg, prompts: list[str], seeds: list[int], out_dir: Path, timer: TransformerTimer,
                 device: torch.device) -> dict:
    """The diffusers guide's loop: one prompt per call, eager, PIL output saved as PNG."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # warm-up (CUDA/cuBLAS/cuDNN initialisation), 2 steps; its first transformer call is kept for the FLOP count
    timer.capture_next = True
    pipe(**dict(baseline_kwargs(pipe, cfg, prompts[0], seeds[0]), num_inference_steps=min(2, cfg.steps)))
    sync(device)
    reset_peak(device)
    timer.reset()
    t0 = time.perf_counter()
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        save_output(pipe(**baseline_kwargs(pipe, cfg, prompt, seed)), cfg, out_dir / f"{i:06d}")
    sync(device)
    wall = time.perf_counter() - t0
    return {"n": len(prompts), "wall_s": wall, "s_per_image": wall / len(prompts),
            "images_per_hour": 3600 * len(prompts) / wall, "transformer_s": timer.total_s(),
            "transformer_calls": len(timer.pairs), **peak_memory(device)}


def save_output(out, cfg, stem: Path) -> None:
    """The seed loop's save: ``out.images[0].save(png)``; for a video pipeline ``out.frames[0]`` as mp4 with the
    job's own encoder and settings (the guide's ``export_to_video`` needs imageio, which the job does not use:
    the same H.264 encode on both sides keeps the work equal)."""
    if hasattr(out, "frames"):
        from shardgen.dataio.shards import encode_video

        frames = np.asarray(out.frames[0])  # FxHxWx3 floats in [0, 1] (diffusers' default "np" output)
        pixels = (frames.astype(np.float32) * 255).round().clip(0, 255).astype(np.uint8)
        stem.with_suffix(".mp4").write_bytes(encode_video(pixels, cfg.fps, cfg.video_codec, cfg.video_crf))
    else:
        out.images[0].save(stem.with_suffix(".png"))


def noise_floor(pipe, cfg, prompts: list[str], seeds: list[int], work: Path, timer, device) -> dict:
    """PSNR between the baseline's images and the same eager loop with another exact attention kernel
    (flash, or memory-efficient where a mask rules flash out, instead of torch's own choice): how far bf16
    rounding alone moves the pixels of this model."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tr = pipe.transformer
    eager_forward = tr.forward

    def forward(*args, **kwargs):  # the transformer only: the text encoders keep their (masked) attention
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return eager_forward(*args, **kwargs)

    tr.forward = forward
    try:
        run_baseline(pipe, cfg, prompts, seeds, work / "noise-floor", timer, device)
    finally:
        del tr.forward
    stats = psnr_stats(read_outputs(work / "noise-floor", len(prompts)), read_outputs(work / "baseline", len(prompts)))
    return {"kernel": "flash/efficient", **stats}


class BatchClock:
    """``run_rank``'s ``on_batch`` hook: the start and end of each batch, and a torch.profiler CUDA trace
    of one batch cycle (from the start of batch ``profile_batch`` to the start of the next one)."""

    def __init__(self, device: torch.device, profile_batch: int | None = None):
        self.device, self.profile_batch = device, profile_batch
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.prof = None
        self.prof_window: tuple[float, float] | None = None
        self.prof_overhead_s = 0.0
        self.cycle_overhead: dict[int, float] = {}  # cycle index -> profiler start/stop seconds inside it
        self.worker = None
        self.stopped_at_end = False

    def __call__(self, event: str, worker) -> None:
        self.worker = worker
        if event == "end":
            self.ends.append(time.perf_counter())
            return
        k = len(self.starts)
        if self.prof is not None and self.prof_window is None:
            self._stop_profiler()
        if k == self.profile_batch and self.device.type == "cuda":
            self._start_profiler()
        self.starts.append(time.perf_counter())

    def _start_profiler(self):
        from torch.profiler import ProfilerActivity, profile

        t0 = time.perf_counter()
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.start()
        t1 = time.perf_counter()
        self._overhead(t1 - t0)
        self._win_start = t1

    def _stop_profiler(self):
        t0 = time.perf_counter()
        self.prof.stop()
        self.prof_window = (self._win_start, t0)
        self._overhead(time.perf_counter() - t0)

    def _overhead(self, dt: float) -> None:
        # called before batch k's start is taken: part of cycle k-1
        self.prof_overhead_s += dt
        k = len(self.starts) - 1
        if k >= 0:
            self.cycle_overhead[k] = self.cycle_overhead.get(k, 0.0) + dt

    def finish(self) -> None:
        """After the run: a trace still open (too few batches) closes here, at the end of the run."""
        if self.prof is not None and self.prof_window is None:
            sync(self.device)
            self.stopped_at_end = True
            self._stop_profiler()

    def idle(self) -> dict | None:
        if self.prof is None or self.prof_window is None:
            return None
        window = self.prof_window[1] - self.prof_window[0]
        busy, n, gaps, top = gpu_busy_s(self.prof)
        return {"window_s": round(window, 3), "gpu_busy_s": round(busy, 3), "gpu_activities": n,
                "idle_fraction": max(0.0, 1 - busy / window) if window > 0 else None, "largest_gaps_ms": gaps,
                "batches": [self.profile_batch], "window_includes_end_of_run": self.stopped_at_end,
                "top_kernels_ms": top}

    def cycles(self) -> list[float]:
        """Seconds from each batch's start to the next one's (the steady-state period of the loop), less
        the profiler's own start/stop time where it fell inside."""
        return [b - a - self.cycle_overhead.get(i, 0.0) for i, (a, b) in enumerate(zip(self.starts, self.starts[1:]))]


def run_shardgen(pipe, cfg, device: torch.device, timer: TransformerTimer, *, profile_batch: int | None = None,
                 before=None, skip_first: int = 0) -> dict:
    """``run_rank(cfg, pipeline=pipe)``: timings of the run and of each batch, and the graphs dynamo
    compiled after the first batch (0 in a steady state without recompilation)."""
    from shardgen.run.generation import GenSettings
    from shardgen.run.runner import run_rank
    from shardgen.speed import accel

    accel.prepare(pipe, GenSettings.from_cfg(cfg).accel)  # what run_pipeline would do first; hooks exist now
    extra = before(pipe) if before else None
    sync(device)
    reset_peak(device)
    timer.reset()
    clock = BatchClock(device, profile_batch)
    graphs, calls = [], []  # after each batch: graphs compiled so far, transformer calls so far

    def hook(event, worker):
        clock(event, worker)
        if event == "end":
            graphs.append(compiled_graphs())
            calls.append(len(timer.pairs))

    graphs0 = compiled_graphs()
    t0 = time.perf_counter()
    result = run_rank(cfg, pipeline=pipe, on_batch=hook)
    sync(device)
    wall = time.perf_counter() - t0
    clock.finish()
    res = _timings(cfg, result, wall, clock, timer, device, graphs0, graphs, skip_first, extra)
    if skip_first and len(calls) > skip_first:  # the batches that paid compilation are no denoising figure
        res.update(transformer_s=timer.total_s(calls[skip_first - 1]),
                   denoise_images=res["n"] - skip_first * cfg.batch_size)
    return res


def _timings(cfg, result, wall, clock: BatchClock, timer, device, graphs0, graphs, skip_first, extra) -> dict:
    n, cycles = result.generated_here, clock.cycles()
    sink = clock.worker.sink if clock.worker else None
    res = {"n": n, "ok": result.ok, "failed": result.failed, "wall_s": wall, "batches": len(clock.starts),
           "batch_s": [round(b - a, 3) for a, b in zip(clock.starts, clock.ends)],
           "cycle_s": [round(c, 3) for c in cycles], "profiler_overhead_s": round(clock.prof_overhead_s, 3),
           "transformer_s": timer.total_s(), "transformer_calls": len(timer.pairs),
           "writer_wait_s": round(sink.wait_s, 3) if sink else None, "writer_busy_s": round(sink.write_s, 3) if sink else None,
           "first_batch_s": round(clock.ends[0] - clock.starts[0], 3) if clock.ends else None,
           "graphs_compiled": graphs[0] - graphs0 if graphs else 0,
           "recompiles_after_first_batch": graphs[-1] - graphs[0] if graphs else 0,
           "idle": clock.idle(), **peak_memory(device)}
    eff = wall - clock.prof_overhead_s
    res["run_s_per_image"] = eff / n if n else None
    res["run_images_per_hour"] = 3600 * n / eff if n else None
    # steady state: the loop's period over full batches after the first `skip_first` (which pay compilation);
    # the whole-run figure also holds planning, the last shard's commit and the replica's wait for it
    steady = cycles[skip_first:]
    if not steady:  # too few batches for a clean cycle: the later batches' own time (no writer hand-over)
        steady = [b - a for a, b in zip(clock.starts, clock.ends)][skip_first:] or cycles
    res["steady_s_per_image"] = sum(steady) / (len(steady) * cfg.batch_size) if steady else res["run_s_per_image"]
    res["s_per_image"] = res["steady_s_per_image"]
    res["images_per_hour"] = 3600 / res["s_per_image"] if res["s_per_image"] else None
    if extra is not None:
        res["extra"] = extra() if callable(extra) else extra
    return res


def fbc_counter(pipe):
    """Count First-Block-Cache decisions (compute / skip the remaining blocks) on the head block's hook."""
    counts = {"computed": 0, "skipped": 0}
    diffs: list[float] = []
    for mod in pipe.transformer.modules():
        reg = getattr(mod, "_diffusers_hook", None)
        hook = reg.get_hook("fbc_leader_block_hook") if reg is not None else None
        if hook is not None:
            orig = hook._should_compute_remaining_blocks

            def decide(residual, _orig=orig, _hook=hook):
                prev = _hook.state_manager.get_state().head_block_residual
                if prev is not None:  # the quantity diffusers compares with the threshold
                    diffs.append(float((residual - prev).abs().mean() / prev.abs().mean()))
                r = _orig(residual)
                counts["computed" if r else "skipped"] += 1
                return r

            hook._should_compute_remaining_blocks = decide
            break

    def stats():
        q = np.quantile(diffs, [0, 0.1, 0.5, 0.9, 1]).round(4).tolist() if diffs else None
        return dict(counts, skipped_fraction=round(counts["skipped"] / max(1, sum(counts.values())), 3),
                    relative_change_quantiles_0_10_50_90_100=q)

    return stats
