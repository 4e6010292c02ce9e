"""Throughput on one device: the plain diffusers loop against shardgen's generate path, in one run.

    python -m jobs.bench                          # FLUX.1-dev architecture, dummy bf16 weights, 32 prompts,
                                                  # 1024x1024, 28 steps, batch 4, compile on, opt-in fbc + fp8
    python -m jobs.bench --n 16 --out $OUT        # fewer prompts; results in $OUT/bench.json
    python -m jobs.bench --quick                  # CPU smoke test: the tiny model, 4 prompts, 2 steps

Both ways share one pipeline object (built once) and the same prompts and seeds:

1. baseline: the seed docs' data-parallel loop for one rank, eager: per prompt
   ``pipe(prompt, generator=Generator("cpu").manual_seed(seed)).images[0]`` then ``image.save(png)``
   (the seed is shardgen's sample seed of that prompt, so the images are comparable);
2. shardgen: ``shardgen.run.runner.run_rank`` with a composed ``jobs.generate`` config (the real job: plan,
   claims, batches, background PNG encoding, tar shards, checkpoints), the strategy's pipeline build
   replaced by the shared object. A one-batch warm-up run before it pays the compilation.

Printed (and written to ``--out``/bench.json): images/hour of each and their ratio; the transformer
FLOPs per image-step (counted by ``torch.utils.flop_counter`` on a real transformer call, and from the
config for FLUX); a bf16 matmul rate measured in the same run (largest of two big ``torch.matmul``);
denoising MFU (transformer FLOPs / GPU time inside the transformer calls, CUDA events) and end-to-end
MFU (transformer FLOPs / wall time); the GPU idle fraction of shardgen's steady state (a torch.profiler
CUDA trace over one whole batch cycle: 1 - union of kernel/memcpy intervals / wall time of the cycle);
peak memory; PSNR of shardgen's images against the baseline's; then each opt-in acceleration's
speed-up (steady batches against the exact run's) and PSNR against the exact output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
GiB = 1024 ** 3
ACCELS = {  # name -> config overrides (the threshold of fbc comes from --fbc-threshold)
    "fbc": lambda a: [f"first_block_cache={a.fbc_threshold}"],
    "fp8": lambda a: ["fp8=true"],
    "fp8+fbc": lambda a: ["fp8=true", f"first_block_cache={a.fbc_threshold}"],
    # exact diagnostics: where shardgen's difference to the baseline comes from (PSNR vs the baseline of
    # each): the same batches uncompiled, and compiled one prompt per batch
    "eager": lambda a: ["compile=false"],
    "batch1": lambda a: ["batch_size=1"],
}
DIAGNOSTICS = ("eager", "batch1")
RECOMPILING = ("fp8", "batch1")  # their first batch pays a compilation: left out of the timing


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="prompts (default 32; --quick 4)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; --quick 2)")
    ap.add_argument("--size", type=int, default=None, help="height = width (default 1024; --quick 64)")
    ap.add_argument("--batch", type=int, default=None, help="shardgen batch_size (default 4; --quick 2)")
    ap.add_argument("--model", default=None, help="model config (default flux_dev; --quick tiny)")
    ap.add_argument("--weights", default=None, help="model.weights (default dummy; --quick pretrained)")
    ap.add_argument("--device", default=None, help="auto | cpu | cuda (default auto; --quick cpu)")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None, help="shardgen compile=true")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--sdpa", default="auto", help="shardgen sdpa_backend")
    ap.add_argument("--compile-mode", default="default",
                    help="shardgen compile_mode: default | max-autotune-no-cudagraphs | max-autotune")
    ap.add_argument("--accel", default=None, help="extra runs, comma-separated from " + ",".join(ACCELS)
                    + ": the opt-in lossy options, and the exact diagnostics eager (compile off) and batch1"
                    + " (default fbc,fp8 on CUDA, none on CPU; 'none' for none)")
    ap.add_argument("--accel-n", type=int, default=None, help="prompts per opt-in run (default 3 batches)")
    ap.add_argument("--fbc-threshold", type=float, default=0.12)
    ap.add_argument("--profile-batch", type=int, default=1, help="batch whose cycle is traced for GPU idle")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--baseline-n", type=int, default=None, help="baseline on the first N prompts only (default all)")
    ap.add_argument("--noise-floor", type=int, default=0, metavar="N",
                    help="CUDA: rerun the baseline loop on N prompts with another exact SDPA kernel (flash) and give "
                         "its PSNR against the baseline: what bf16 rounding alone changes (default 0: off)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for bench.json (default $OUT)")
    ap.add_argument("--workdir", default=None, help="where run dirs and baseline PNGs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra jobs.generate config overrides (repeatable)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test on the tiny model")
    a = ap.parse_args(argv)
    quick = dict(n=4, steps=2, size=64, batch=2, model="tiny", weights="pretrained", device="cpu", compile=False)
    full = dict(n=32, steps=28, size=1024, batch=4, model="flux_dev", weights="dummy", device="auto", compile=True)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


# --- small measurement helpers ----------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype) -> dict:
    """The matmul rate of this device in ``dtype``: the best of a few big square products (TFLOP/s)."""
    sizes = (8192, 16384) if device.type == "cuda" else (512, 1024)
    best, per = 0.0, {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):
            torch.matmul(a, b)
        iters = 10 if device.type == "cuda" else 3
        _sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                torch.matmul(a, b)
            end.record()
            end.synchronize()
            sec = start.elapsed_time(end) / 1e3
        else:
            for _ in range(iters):
                torch.matmul(a, b)
            sec = time.perf_counter() - t0
        rate = 2 * n ** 3 * iters / sec / 1e12
        per[n] = round(rate, 1)
        best = max(best, rate)
        del a, b
    return {"tflops": best, "per_size": per, "dtype": str(dtype).replace("torch.", "")}


class TransformerTimer:
    """GPU time inside each transformer call (CUDA events around forward; wall time on a CPU)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs: list = []
        self.captured: tuple | None = None
        self.capture_next = False
        self._open = None
        self._h = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                   module.register_forward_hook(self._post)]

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        if self.capture_next:  # keep one call's inputs for the FLOP count
            self.capture_next = False
            clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x
            self.captured = (tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()})
        self._open = self._now()

    def _post(self, module, args, output):
        self.pairs.append((self._open, self._now()))

    def reset(self) -> None:
        self.pairs = []

    def total_s(self) -> float:
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        return sum(b - a for a, b in self.pairs)

    def remove(self) -> None:
        for h in self._h:
            h.remove()


def count_flops(module: torch.nn.Module, captured) -> float:
    """FLOPs of one forward call with the captured inputs (matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    args, kwargs = captured
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        module(*args, **kwargs)
    return float(fc.get_total_flops())


def flux_flops(config, image_tokens: int, text_tokens: int) -> float:
    """FLOPs of one FLUX transformer call for one image, from the config (matmuls and attention).

    Per block (double- or single-stream) and token: q, k, v, out projections (4 D^2 MACs) and an MLP of
    ratio 4 (8 D^2 MACs) = 12 D^2 MACs; attention over all N tokens: QK^T and AV = 2 N^2 D MACs.
    Plus the input/output embeddings. FLOPs = 2 x MACs.
    """
    d = config.num_attention_heads * config.attention_head_dim
    n = image_tokens + text_tokens
    blocks = config.num_layers + config.num_single_layers
    macs = blocks * (12 * d * d * n + 2 * n * n * d)
    macs += image_tokens * config.in_channels * d + text_tokens * config.joint_attention_dim * d
    macs += image_tokens * d * (config.out_channels or config.in_channels)
    return 2.0 * macs


def gpu_busy_s(prof) -> tuple[float, int, list[float], dict[str, float]]:
    """(seconds during which at least one kernel/copy ran, number of GPU activities, 5 largest gaps in ms,
    the 12 kernels with the most GPU time in ms)."""
    from collections import Counter

    from torch.autograd import DeviceType

    spans, per_kernel = [], Counter()
    try:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == DeviceType.CUDA:
                spans.append((e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3))  # us
                per_kernel[e.name()[:120]] += e.duration_ns() / 1e6
    except Exception:  # older/newer internals: the public (slower) path
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                spans.append((e.time_range.start, e.time_range.end))
                per_kernel[e.name[:120]] += (e.time_range.end - e.time_range.start) / 1e3
    top = {k: round(v, 1) for k, v in per_kernel.most_common(12)}
    if not spans:
        return 0.0, 0, [], top
    spans.sort()
    busy, gaps = 0.0, []
    cur_a, cur_b = spans[0]
    for a, b in spans[1:]:
        if a > cur_b:
            busy += cur_b - cur_a
            gaps.append(a - cur_b)
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    return busy / 1e6, len(spans), [round(g / 1e3, 2) for g in sorted(gaps, reverse=True)[:5]], top


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def psnr_stats(images: dict[int, np.ndarray], ref: dict[int, np.ndarray]) -> dict:
    """PSNR of ``images`` against ``ref`` over the indices both hold: first, mean of the finite ones
    (inf when all are identical), min, n; None figures when they share none."""
    vals = [psnr(images[i], ref[i]) for i in sorted(images) if i in ref]
    finite = [v for v in vals if not math.isinf(v)]
    return {"first": vals[0] if vals else None, "mean": float(np.mean(finite)) if finite else math.inf,
            "min": min(vals) if vals else None, "n": len(vals)}


def read_pngs(folder: Path, n: int) -> dict[int, np.ndarray]:
    """The baseline loop's ``000000.png`` ... of ``folder`` as RGB arrays, by index."""
    from PIL import Image

    return {i: np.asarray(Image.open(folder / f"{i:06d}.png").convert("RGB")) for i in range(n)}


def _fmt_db(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1f}"


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_allocated_GiB": round(torch.cuda.max_memory_allocated(device) / GiB, 2),
                "peak_reserved_GiB": round(torch.cuda.max_memory_reserved(device) / GiB, 2)}
    import resource

    return {"peak_rss_GiB_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def shard_images(run_dir: Path) -> dict[int, np.ndarray]:
    """prompt index -> decoded image of every committed sample of a run."""
    from PIL import Image

    from shardgen.dataio.verify import read_shard_members

    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for key, mem in read_shard_members(tar).items():
            img = next((v for k, v in mem.items() if k in ("png", "jpg", "webp")), None)
            if img is not None:
                out[int(key)] = np.asarray(Image.open(io.BytesIO(img)).convert("RGB"))
    return out


# --- the two ways --------------------------------------------------------------------------------------

def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from shardgen.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="generate", overrides=overrides)


def run_baseline(pipe, cfg, prompts: list[str], seeds: list[int], out_dir: Path, timer: TransformerTimer,
                 device: torch.device) -> dict:
    """The seed docs' loop: one prompt per call, eager, PIL output saved as PNG."""
    import inspect

    params = inspect.signature(pipe.__call__).parameters
    kw = dict(height=cfg.height, width=cfg.width, num_inference_steps=cfg.steps)
    if "guidance_scale" in params:
        kw["guidance_scale"] = cfg.guidance
    if "max_sequence_length" in params:
        kw["max_sequence_length"] = cfg.model.max_sequence_length
    out_dir.mkdir(parents=True, exist_ok=True)
    # warm-up (CUDA/cuBLAS/cuDNN initialisation), 2 steps; its first transformer call is kept for the FLOP count
    timer.capture_next = True
    pipe(prompts[0], generator=torch.Generator("cpu").manual_seed(seeds[0]), **dict(kw, num_inference_steps=min(2, cfg.steps)))
    _sync(device)
    _reset_peak(device)
    timer.reset()
    t0 = time.perf_counter()
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        image = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), **kw).images[0]
        image.save(out_dir / f"{i:06d}.png")
    _sync(device)
    wall = time.perf_counter() - t0
    return {"n": len(prompts), "wall_s": wall, "s_per_image": wall / len(prompts),
            "images_per_hour": 3600 * len(prompts) / wall, "transformer_s": timer.total_s(),
            "transformer_calls": len(timer.pairs), **peak_memory(device)}


def noise_floor(pipe, cfg, prompts: list[str], seeds: list[int], work: Path, timer, device) -> dict:
    """PSNR between the baseline's images and the same eager loop with another exact attention kernel
    (flash instead of torch's own choice): how far bf16 rounding alone moves the pixels of this model."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = "flash"
    tr = pipe.transformer
    eager_forward = tr.forward

    def forward(*args, **kwargs):  # the transformer only: the text encoders keep their (masked) attention
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return eager_forward(*args, **kwargs)

    tr.forward = forward
    try:
        run_baseline(pipe, cfg, prompts, seeds, work / "noise-floor", timer, device)
    finally:
        del tr.forward
    stats = psnr_stats(read_pngs(work / "noise-floor", len(prompts)), read_pngs(work / "baseline", len(prompts)))
    return {"kernel": kernel, **stats}


class _Patched:
    """Within the block: run_rank uses ``pipe`` instead of building one, and each batch is timed
    (and one batch cycle traced with torch.profiler when ``profile_batch`` is set)."""

    def __init__(self, pipe, device: torch.device, profile_batch: int | None = None, profile_cycles: int = 1):
        self.pipe, self.device = pipe, device
        self.profile_batch, self.profile_cycles = profile_batch, profile_cycles
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.prof = None
        self.prof_window: tuple[float, float] | None = None
        self.prof_overhead_s = 0.0
        self.cycle_overhead: dict[int, float] = {}  # cycle index -> profiler start/stop seconds inside it
        self.worker = None

    def __enter__(self):
        from shardgen.run import replica, runner

        self._saved = (runner.apply_strategy, replica.generate_batch, runner.ReplicaWorker.run)
        orig_gen, orig_run = replica.generate_batch, runner.ReplicaWorker.run
        runner.apply_strategy = lambda cfg, world, dims: self.pipe

        def generate_batch(pipe, settings, rows, *args):
            k = len(self.starts)
            if self.prof is not None and k == self.profile_batch + self.profile_cycles:
                self._stop_profiler()
            if k == self.profile_batch and self.device.type == "cuda":
                self._start_profiler()
            self.starts.append(time.perf_counter())
            out = orig_gen(pipe, settings, rows, *args)
            self.ends.append(time.perf_counter())
            return out

        def run(worker):
            self.worker = worker
            return orig_run(worker)

        replica.generate_batch = generate_batch
        runner.ReplicaWorker.run = run
        return self

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
        # called inside batch k's generate_batch before its start is taken: part of cycle k-1
        self.prof_overhead_s += dt
        k = len(self.starts) - 1
        if k >= 0:
            self.cycle_overhead[k] = self.cycle_overhead.get(k, 0.0) + dt

    def __exit__(self, *exc):
        from shardgen.run import replica, runner

        self._stopped_at_exit = False
        if self.prof is not None and self.prof_window is None:
            _sync(self.device)
            self._stopped_at_exit = True  # too few batches: the window closes at the end of the run
            self._stop_profiler()
        runner.apply_strategy, replica.generate_batch, runner.ReplicaWorker.run = self._saved
        return False

    def idle(self) -> dict | None:
        if self.prof is None or self.prof_window is None:
            return None
        window = self.prof_window[1] - self.prof_window[0]
        busy, n, gaps, top = gpu_busy_s(self.prof)
        return {"window_s": round(window, 3), "gpu_busy_s": round(busy, 3), "gpu_activities": n,
                "idle_fraction": max(0.0, 1 - busy / window) if window > 0 else None, "largest_gaps_ms": gaps,
                "batches": list(range(self.profile_batch, self.profile_batch + self.profile_cycles)),
                "window_includes_end_of_run": self._stopped_at_exit, "top_kernels_ms": top}

    def cycles(self) -> list[float]:
        """Seconds from each batch's start to the next one's (the steady-state period of the loop), less
        the profiler's own start/stop time where it fell inside."""
        return [b - a - self.cycle_overhead.get(i, 0.0) for i, (a, b) in enumerate(zip(self.starts, self.starts[1:]))]


def run_shardgen(pipe, cfg, device: torch.device, timer: TransformerTimer, *, profile_batch: int | None = None,
                 before=None, skip_first: int = 0) -> dict:
    """``shardgen.run.runner.run_rank(cfg)`` with the shared pipeline; timings of the run and of each batch."""
    from shardgen.speed import accel
    from shardgen.run.generation import GenSettings
    from shardgen.run.runner import run_rank

    accel.prepare(pipe, GenSettings.from_cfg(cfg).accel)  # what run_pipeline would do first; hooks exist now
    extra = before(pipe) if before else None
    _sync(device)
    _reset_peak(device)
    timer.reset()
    with _Patched(pipe, device, profile_batch) as p:
        t0 = time.perf_counter()
        result = run_rank(cfg)
        _sync(device)
        wall = time.perf_counter() - t0
    n = result.generated_here
    cycles = p.cycles()
    res = {"n": n, "ok": result.ok, "failed": result.failed, "wall_s": wall, "batches": len(p.starts),
           "batch_s": [round(b - a, 3) for a, b in zip(p.starts, p.ends)], "cycle_s": [round(c, 3) for c in cycles],
           "profiler_overhead_s": round(p.prof_overhead_s, 3), "transformer_s": timer.total_s(),
           "transformer_calls": len(timer.pairs), "writer_wait_s": round(p.worker.sink.wait_s, 3) if p.worker else None,
           "writer_busy_s": round(p.worker.sink.write_s, 3) if p.worker and p.worker.sink else None,
           "first_batch_s": round(p.ends[0] - p.starts[0], 3) if p.ends else None,
           "idle": p.idle(), **peak_memory(device)}
    eff = wall - p.prof_overhead_s
    res["run_s_per_image"] = eff / n if n else None
    res["run_images_per_hour"] = 3600 * n / eff if n else None
    # steady state: the loop's period over full batches (warm-up already paid); the whole-run figure also
    # holds planning, the last shard's commit and the replica's wait for it (fixed costs per run)
    steady = cycles[skip_first:]
    if not steady:  # too few batches for a clean cycle: the later batches' own time (no writer hand-over)
        steady = [b - a for a, b in zip(p.starts, p.ends)][skip_first:] or cycles
    res["steady_s_per_image"] = sum(steady) / (len(steady) * cfg.batch_size) if steady else res["run_s_per_image"]
    res["s_per_image"] = res["steady_s_per_image"]
    res["images_per_hour"] = 3600 / res["s_per_image"] if res["s_per_image"] else None
    if extra is not None:
        res["extra"] = extra() if callable(extra) else extra
    return res


def _fbc_counter(pipe):
    """Count First-Block-Cache decisions (compute / skip the remaining blocks) on the head block's hook."""
    counts = {"computed": 0, "skipped": 0}
    diffs: list[float] = []
    tr = pipe.transformer
    for mod in tr.modules():
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


# --- main ------------------------------------------------------------------------------------------------

def _prompts(n: int) -> list[str]:
    base = [l for l in (ROOT / "examples" / "prompts.txt").read_text(encoding="utf-8").splitlines() if l.strip()]
    return [base[i % len(base)] + ("" if i < len(base) else f" (variation {i // len(base)})") for i in range(n)]


class Report:
    def __init__(self, out: str | None):
        self.data: dict[str, Any] = {}
        self.path = Path(out) / "bench.json" if out else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        if self.path:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


_T0 = time.perf_counter()


def say(msg: str) -> None:
    print(msg if not msg else f"[{time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def _first_failure(run_dir: Path) -> str | None:
    from shardgen.dataio.verify import read_shard_members

    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for mem in read_shard_members(tar).values():
            meta = json.loads(mem["json"])
            if meta.get("status") == "failed":
                return meta.get("error")
    return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    from shardgen.run.runner import quiet_libraries
    from shardgen.dataio.plan import sample_seed
    from shardgen.models.loader import load_pipeline, torch_dtype
    from parallel.world import choose_device

    quiet_libraries()
    rep = Report(args.out)
    device = choose_device(args.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = args.accel if args.accel is not None else ("fbc,fp8" if device.type == "cuda" else "none")
    accel_names = [] if spec == "none" else [a for a in spec.split(",") if a]
    for a in accel_names:
        if a not in ACCELS:
            raise SystemExit(f"--accel {a}: use some of {', '.join(ACCELS)} or none")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardgen-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args.n)
    prompt_file = work / "prompts.txt"
    prompt_file.write_text("".join(p + "\n" for p in prompts), encoding="utf-8")
    common = [f"model={args.model}", f"model.weights={args.weights}", "prompts=txt", f"prompts.path={prompt_file}",
              f"steps={args.steps}", f"height={args.size}", f"width={args.size}", f"batch_size={args.batch}",
              f"device={device.type}", "progress=false", f"compile={str(args.compile).lower()}",
              f"sdpa_backend={args.sdpa}", f"compile_mode={args.compile_mode}", *args.overrides]
    cfg = compose(common + [f"run_dir={work / 'run'}"])
    dtype = torch_dtype(cfg.dtype)
    seeds = [sample_seed(cfg.seed, i) for i in range(args.n)]
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "model": args.model, "weights": args.weights,
           "dtype": cfg.dtype, "size": args.size, "steps": args.steps, "n": args.n, "batch": args.batch,
           "compile": args.compile, "compile_mode": args.compile_mode, "sdpa_backend": args.sdpa, "argv": sys.argv if argv is None else argv}
    try:
        import diffusers

        env["diffusers"] = diffusers.__version__
    except Exception:
        pass
    rep.put("env", env)
    say(f"== jobs.bench: {args.model} ({args.weights} weights, {cfg.dtype}), {args.size}x{args.size}, {args.steps} steps, "
        f"{args.n} prompts, batch {args.batch}, on {env['device']} ==")

    peak = matmul_peak(device, dtype)
    rep.put("matmul_peak", peak)
    say(f"{peak['dtype']} matmul rate (measured, best of {list(peak['per_size'])}): {peak['tflops']:.1f} TFLOP/s")

    t0 = time.perf_counter()
    pipe = load_pipeline(cfg.model, dtype, device)
    _sync(device)
    build_s = time.perf_counter() - t0
    rep.put("build_s", round(build_s, 2))
    say(f"pipeline built in {build_s:.1f} s ({type(pipe).__name__}); weights on device: "
        + (f"{torch.cuda.memory_allocated(device) / GiB:.1f} GiB" if device.type == "cuda" else "cpu"))
    timer = TransformerTimer(pipe.transformer, device)
    results: dict[str, Any] = {}

    # 1. baseline
    base = None
    if not args.skip_baseline:
        nb = min(args.baseline_n or args.n, args.n)
        base = run_baseline(pipe, cfg, prompts[:nb], seeds[:nb], work / "baseline", timer, device)
        results["baseline"] = base
        rep.put("baseline", base)
        say(f"baseline: {base['n']} images in {base['wall_s']:.1f} s = {base['images_per_hour']:.0f} images/hour")
        if args.noise_floor and device.type == "cuda":
            base["noise_floor"] = noise_floor(pipe, cfg, prompts[:min(args.noise_floor, nb)], seeds, work, timer, device)
            rep.put("baseline", base)
            nf = base["noise_floor"]
            say(f"bf16 noise floor: the baseline loop with SDPA {nf['kernel']} instead of torch's choice, PSNR vs "
                f"the baseline: first {_fmt_db(nf['first'])} dB, mean {_fmt_db(nf['mean'])} over {nf['n']}")
    else:
        timer.capture_next = True

    # FLOPs per image-step, from one real transformer call (batch 1) and, for FLUX, from the config
    flops = {}
    if timer.captured is None:  # no baseline: capture a call now
        pipe(prompts[0], num_inference_steps=1, height=args.size, width=args.size,
             generator=torch.Generator("cpu").manual_seed(seeds[0]))
    try:
        flops["counted"] = count_flops(pipe.transformer, timer.captured)
    except Exception as e:
        flops["counted_error"] = f"{type(e).__name__}: {e}"[:300]
    if device.type == "cuda":  # which kernels the plain (eager) transformer call runs, e.g. torch's attention choice
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            pipe.transformer(*timer.captured[0], **timer.captured[1])
            _sync(device)
        eager_top = gpu_busy_s(prof)[3]
        rep.put("eager_transformer_top_kernels_ms", eager_top)
        say("eager transformer call, GPU time by kernel (ms): "
            + "; ".join(f"{k[:60]} {v:.1f}" for k, v in list(eager_top.items())[:5]))
    tcfg = pipe.transformer.config
    if "num_single_layers" in tcfg:
        factor = getattr(pipe, "vae_scale_factor", 8) * 2
        flops["analytic_flux"] = flux_flops(tcfg, (args.size // factor) ** 2, cfg.model.max_sequence_length)
    per_step = flops.get("counted") or flops.get("analytic_flux")
    if flops.get("analytic_flux") and per_step < 0.95 * flops["analytic_flux"]:
        per_step = flops["analytic_flux"]  # the counter missed something (e.g. an attention kernel it has no formula for)
    flops["per_image_step"] = per_step
    timer.captured = None
    rep.put("flops", flops)
    say(f"transformer FLOPs per image-step: {_flop(per_step)} (torch flop counter)"
        + (f"; {_flop(flops['analytic_flux'])} from the FLUX config" if "analytic_flux" in flops else ""))

    def mfu(r: dict) -> tuple[float | None, float | None]:
        if not per_step or not r.get("n"):
            return None, None
        total = per_step * r["n"] * args.steps
        den = total / r["transformer_s"] / (peak["tflops"] * 1e12) if r.get("transformer_s") else None
        e2e = total / (r["s_per_image"] * r["n"]) / (peak["tflops"] * 1e12)
        return den, e2e

    if base:
        base["mfu_denoise"], base["mfu_e2e"] = mfu(base)
        rep.put("baseline", base)

    # 2. shardgen: warm-up (compilation, kernel choice, cuDNN autotuning), then the measured run
    warm_cfg = compose(common + [f"run_dir={work / 'warmup'}", f"prompts.limit={min(args.batch, args.n)}"])
    t0 = time.perf_counter()
    warm = run_shardgen(pipe, warm_cfg, device, timer)
    warm["wall_s"] = time.perf_counter() - t0
    if warm["failed"]:  # e.g. the chosen attention kernel does not compile here: say why, retry with torch's choice
        why = _first_failure(work / "warmup")
        say(f"shardgen warm-up: {warm['failed']} samples FAILED ({why}); retrying with sdpa_backend=default")
        rep.put("warmup_failure", why)
        common.append("sdpa_backend=default")
        cfg = compose(common + [f"run_dir={work / 'run'}"])
        warm_cfg = compose(common + [f"run_dir={work / 'warmup2'}", f"prompts.limit={min(args.batch, args.n)}"])
        t0 = time.perf_counter()
        warm = run_shardgen(pipe, warm_cfg, device, timer)
        warm["wall_s"] = time.perf_counter() - t0
    rep.put("shardgen_warmup", warm)
    say(f"shardgen warm-up (one batch of {warm['n']}, compile={args.compile}, compile_mode={args.compile_mode}): {warm['wall_s']:.1f} s")
    sg = run_shardgen(pipe, cfg, device, timer, profile_batch=args.profile_batch if device.type == "cuda" else None)
    sg["mfu_denoise"], sg["mfu_e2e"] = mfu(sg)
    if sg.get("steady_s_per_image"):
        sg["compile_s_estimate"] = round(warm["first_batch_s"] - sg["steady_s_per_image"] * warm["n"], 1)
    from shardgen.speed import accel as accel_mod

    sg["sdpa_choice"] = {str(k): v for k, v in accel_mod._SDPA_CHOICE.items()}
    results["shardgen"] = sg
    exact = shard_images(work / "run")
    if base:
        ref = read_pngs(work / "baseline", base["n"])
        sg["psnr_vs_baseline"] = psnr_stats(exact, ref)
    rep.put("shardgen", sg)
    say(f"shardgen: {sg['n']} images in {sg['wall_s']:.1f} s = {sg['images_per_hour']:.0f} images/hour")

    # 3. opt-in accelerations, each against the exact run's steady batches and images
    acc_n = args.accel_n or min(args.n, 3 * args.batch)
    exact_steady = sg.get("steady_s_per_image") or sg["s_per_image"]
    for name in accel_names:
        try:
            acfg = compose(common + ACCELS[name](args) + [f"run_dir={work / ('run-' + name)}", f"prompts.limit={acc_n}"])
            # the first batch pays any recompilation (fp8 changes the blocks' graphs)
            r = run_shardgen(pipe, acfg, device, timer, before=_fbc_counter if "fbc" in name else None,
                             skip_first=1 if any(k in name for k in RECOMPILING) else 0)
            per_img = r["steady_s_per_image"]
            imgs = shard_images(work / f"run-{name}")
            r.update(steady_s_per_image=per_img, speedup_vs_exact=exact_steady / per_img,
                     psnr_vs_exact=psnr_stats(imgs, exact))
            line = (f"{name}: {per_img:.2f} s/image steady ({r['speedup_vs_exact']:.2f}x the exact run), "
                    f"PSNR vs exact {_fmt_db(r['psnr_vs_exact']['mean'])} dB mean")
            if base:
                vb = psnr_stats(imgs, ref)
                if vb["n"]:
                    r["psnr_vs_baseline"] = vb["mean"]
                    line += f", vs baseline {_fmt_db(vb['mean'])} dB mean over {vb['n']}"
            say(("diagnostic " if name in DIAGNOSTICS else "opt-in ") + line)
        except Exception as e:  # report and go on: the main figures stand without it
            import traceback

            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"[:1000]}
            say(f"{'diagnostic' if name in DIAGNOSTICS else 'opt-in'} {name}: FAILED ({r['error'][:200]})")
        results.setdefault("accel", {})[name] = r
        rep.put("accel", results["accel"])

    timer.remove()
    summary = _summary(args, env, peak, flops, base, warm, sg, results.get("accel", {}))
    rep.put("summary", summary)
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return rep.data


def _flop(x: float) -> str:
    for unit, div in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} FLOP"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _summary(args, env, peak, flops, base, warm, sg, acc) -> dict:
    mem_key = "peak_allocated_GiB" if "peak_allocated_GiB" in sg else "peak_rss_GiB_process"
    idle = (sg.get("idle") or {}).get("idle_fraction")
    rows = []
    if base:
        rows.append(("baseline (diffusers loop)", base))
    rows.append(("shardgen (jobs.generate)", sg))
    say("")
    say(f"{'':27s}{'images/hour':>12s}{'(whole run)':>12s}{'s/image':>9s}{'denoise MFU':>13s}{'e2e MFU':>9s}"
        f"{'GPU idle':>10s}{'peak GiB':>10s}")
    for name, r in rows:
        say(f"{name:27s}{r['images_per_hour']:12.0f}{r.get('run_images_per_hour', r['images_per_hour']):12.0f}"
            f"{r['s_per_image']:9.2f}{_pct(r.get('mfu_denoise')):>13s}{_pct(r.get('mfu_e2e')):>9s}"
            f"{(_pct(idle) if r is sg else '-'):>10s}{r.get(mem_key, 0):10.1f}")
    out = {"shardgen_images_per_hour": sg["images_per_hour"], "gpu_idle_fraction": idle,
           "mfu_denoise": sg.get("mfu_denoise"), "mfu_e2e": sg.get("mfu_e2e"), "peak_GiB": sg.get(mem_key),
           "matmul_tflops": peak["tflops"], "flops_per_image_step": flops.get("per_image_step")}
    if base:
        ratio = sg["images_per_hour"] / base["images_per_hour"]
        run_ratio = sg["run_images_per_hour"] / base["images_per_hour"]
        out.update(baseline_images_per_hour=base["images_per_hour"], speedup=ratio, speedup_whole_run=run_ratio,
                   shardgen_run_images_per_hour=sg["run_images_per_hour"],
                   psnr_first=sg["psnr_vs_baseline"]["first"], psnr_mean=sg["psnr_vs_baseline"]["mean"],
                   psnr_min=sg["psnr_vs_baseline"]["min"])
        say(f"speed-up shardgen / baseline: {ratio:.2f}x steady state ({run_ratio:.2f}x over the whole {sg['n']}-prompt "
            "run, which also holds planning and the final shard commit)")
        p = sg["psnr_vs_baseline"]
        say(f"PSNR shardgen vs baseline (same prompt, same seed): first image {_fmt_db(p['first'])} dB; "
            f"mean {_fmt_db(p['mean'])}, min {_fmt_db(p['min'])} over {base['n']}")
        if base.get("noise_floor"):
            nf = base["noise_floor"]
            out.update(noise_floor_psnr_mean=nf["mean"], noise_floor_psnr_first=nf["first"])
            say(f"  for scale, the bf16 noise floor (eager loop, SDPA {nf['kernel']} vs torch's choice): "
                f"mean {_fmt_db(nf['mean'])} dB over {nf['n']}")
    if idle is not None:
        i = sg["idle"]
        say(f"GPU idle in steady state: {_pct(idle)} of batch {i['batches']}'s cycle ({i['window_s']:.2f} s, "
            f"torch.profiler CUDA trace, {i['gpu_activities']} kernels/copies; largest gaps {i['largest_gaps_ms']} ms)")
        top = list(i.get("top_kernels_ms", {}).items())[:6]
        if top:
            say("  GPU time by kernel in that cycle (ms): " + "; ".join(f"{k[:60]} {v:.0f}" for k, v in top))
    else:
        say("GPU idle in steady state: n/a (no CUDA device)")
    say(f"shardgen first batch (warm-up, compile={env['compile']}): {warm['first_batch_s']:.1f} s"
        + (f"; compile ~{sg['compile_s_estimate']:.0f} s" if sg.get("compile_s_estimate") is not None else ""))
    say(f"peak memory: {sg.get(mem_key, 0):.1f} GiB shardgen"
        + (f", {base.get(mem_key, 0):.1f} GiB baseline" if base else "") + f" ({mem_key})")
    for name, r in acc.items():
        kind = "diagnostic" if name in DIAGNOSTICS else "opt-in"
        if "error" in r:
            say(f"{kind} {name}: failed: {r['error'][:200]}")
            continue
        extra = r.get("extra") or {}
        say(f"{kind} {name}: {r['speedup_vs_exact']:.2f}x the exact shardgen run, PSNR vs exact "
            f"{_fmt_db(r['psnr_vs_exact']['mean'])} dB mean / {_fmt_db(r['psnr_vs_exact']['min'])} min"
            + (f", vs baseline {_fmt_db(r['psnr_vs_baseline'])} dB mean" if "psnr_vs_baseline" in r else "")
            + (f", skipped {100 * extra['skipped_fraction']:.0f}% of steps (relative change of the first block's "
               f"residual: quantiles 0/10/50/90/100% {extra['relative_change_quantiles_0_10_50_90_100']})"
               if "skipped_fraction" in extra else ""))
        out[f"accel_{name}"] = {"speedup": r["speedup_vs_exact"], "psnr_mean": r["psnr_vs_exact"]["mean"],
                                **({"psnr_vs_baseline": r["psnr_vs_baseline"]} if "psnr_vs_baseline" in r else {}),
                                **({"skipped_fraction": extra["skipped_fraction"]} if "skipped_fraction" in extra else {})}
    return out


if __name__ == "__main__":
    main()
