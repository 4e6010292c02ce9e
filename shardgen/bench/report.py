"""What the benchmark prints and writes: ``bench.json`` (every raw timing) and the summary table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardgen.bench.measure import fmt_db as _fmt_db

DIAGNOSTICS = ("eager", "batch1", "nocfgbatch", "cfgbatch")


class Report:
    """``bench.json`` under ``out``, rewritten after every figure (a run cut short keeps what it measured)."""

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


def fmt_flop(x: float) -> str:
    for unit, div in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} FLOP"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summary(args, env, peak, flops, base, warm, sg, acc, unit: str = "image") -> dict:
    """Print the summary table and lines; return its figures (``images_per_hour`` keys count videos for a video
    model: ``unit`` only changes the words)."""
    mem_key = "peak_allocated_GiB" if "peak_allocated_GiB" in sg else "peak_rss_GiB_process"
    idle = (sg.get("idle") or {}).get("idle_fraction")
    rows = []
    if base:
        rows.append(("baseline (diffusers loop)", base))
    rows.append(("shardgen (jobs.generate)", sg))
    say("")
    say(f"{'':27s}{unit + 's/hour':>12s}{'(whole run)':>12s}{'s/' + unit:>9s}{'denoise MFU':>13s}{'e2e MFU':>9s}"
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
        say(f"speed-up shardgen / baseline: {ratio:.2f}x steady state, {run_ratio:.2f}x over the whole {sg['n']}-prompt "
            "run (planning, the final shard commit" + (")" if warm else " and the compilation of its first batch)"))
        p = sg["psnr_vs_baseline"]
        say(f"PSNR shardgen vs baseline (same prompt, same seed): first {unit} {_fmt_db(p['first'])} dB; "
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
    first = (warm or sg)["first_batch_s"]
    say(f"shardgen first batch ({'warm-up run' if warm else 'of the measured run'}, compile={env['compile']}): "
        f"{first:.1f} s, {first / (sg['steady_s_per_image'] * args.batch):.2f}x a steady batch"
        + (f"; compile ~{sg['compile_s_estimate']:.0f} s" if sg.get("compile_s_estimate") is not None else ""))
    say(f"graphs compiled: {sg['graphs_compiled']} in the measured run's first batch, "
        f"{sg['recompiles_after_first_batch']} after it")
    out.update(first_batch_s=first, first_batch_vs_steady=first / (sg["steady_s_per_image"] * args.batch),
               recompiles_after_first_batch=sg["recompiles_after_first_batch"])
    say(f"peak memory: {sg.get(mem_key, 0):.1f} GiB shardgen"
        + (f", {base.get(mem_key, 0):.1f} GiB baseline" if base else "") + f" ({mem_key})")
    for name, r in acc.items():
        kind = "diagnostic" if name in DIAGNOSTICS else "opt-in"
        if "error" in r:
            say(f"{kind} {name}: failed: {r['error'][:200]}")
            continue
        extra = r.get("extra") or {}
        main = "the lossy main" if env.get("lossy") else "the exact"
        say(f"{kind} {name}: {r['speedup_vs_exact']:.2f}x {main} shardgen run, PSNR vs it "
            f"{_fmt_db(r['psnr_vs_exact']['mean'])} dB mean / {_fmt_db(r['psnr_vs_exact']['min'])} min"
            + (f", vs baseline {_fmt_db(r['psnr_vs_baseline'])} dB mean" if "psnr_vs_baseline" in r else "")
            + (f", skipped {100 * extra['skipped_fraction']:.0f}% of steps (relative change of the first block's "
               f"residual: quantiles 0/10/50/90/100% {extra['relative_change_quantiles_0_10_50_90_100']})"
               if "skipped_fraction" in extra else ""))
        out[f"accel_{name}"] = {"speedup": r["speedup_vs_exact"], "psnr_mean": r["psnr_vs_exact"]["mean"],
                                **({"psnr_vs_baseline": r["psnr_vs_baseline"]} if "psnr_vs_baseline" in r else {}),
                                **({"skipped_fraction": extra["skipped_fraction"]} if "skipped_fraction" in extra else {})}
    return out
