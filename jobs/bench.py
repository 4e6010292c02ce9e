"""Throughput on one device: the plain diffusers loop against shardgen's generate path, in one run.

    python -m jobs.bench                          # FLUX.1-dev architecture, dummy bf16 weights, 32 prompts,
                                                  # 1024x1024, the model's steps, batch 4, compile auto, fbc + fp8
    python -m jobs.bench --model qwen_image --n 16 --out $OUT   # any conf/model/; results in $OUT/bench.json
    python -m jobs.bench --quick                  # CPU smoke test: the tiny model, 4 prompts, 2 steps

Both ways share one pipeline object (built once) and the same prompts (1-70 words) and seeds:

1. baseline: diffusers' data-parallel guide's loop for one rank, eager: per prompt
   ``pipe(prompt=prompt, generator=Generator("cpu").manual_seed(seed), **the job's generation arguments)``
   (guidance, text length, ``true_cfg_scale`` and ``negative_prompt`` where the model has true CFG: equal
   work), then ``image.save(png)``;
2. shardgen: ``run_rank(cfg, pipeline=pipe, on_batch=...)`` with a composed ``jobs.generate`` config (the real
   job: plan, claims, batches, background PNG encoding, tar shards, checkpoints). A one-batch warm-up run
   pays the compilation first, or, with ``--no-warmup``, the measured run pays it in its first batch (the
   whole-run figure then includes it).

The measuring code is in shardgen/bench/ (measure.py, ways.py, report.py, main.py); docs/performance.md says
what each printed figure means.
"""

from __future__ import annotations

import argparse
import os
import sys

from shardgen.bench.main import ACCELS
from shardgen.bench.main import run as run_bench
from shardgen.cli import run_program


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=None, help="prompts (default 32; --quick 4)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's; --quick 2)")
    ap.add_argument("--size", default=None, help="height = width, or HEIGHTxWIDTH, e.g. 480x832 (default: the "
                                                 "model's own size; --quick 64)")
    ap.add_argument("--batch", type=int, default=None, help="shardgen batch_size (default 4; --quick 2)")
    ap.add_argument("--model", default=None, help="model config (default flux_dev; --quick tiny)")
    ap.add_argument("--weights", default=None, help="model.weights (default dummy; --quick pretrained)")
    ap.add_argument("--device", default=None, help="auto | cpu | cuda (default auto; --quick cpu)")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None,
                    help="shardgen compile=true (default on CUDA: the compiled path's steady state; "
                         "else the config's compile=auto)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="shardgen compile=false")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no separate warm-up run: the measured run pays the compilation in its first batch")
    ap.add_argument("--sdpa", default="auto", help="shardgen sdpa_backend")
    ap.add_argument("--compile-mode", default="default",
                    help="shardgen compile_mode: default | max-autotune-no-cudagraphs | max-autotune")
    ap.add_argument("--accel", default=None, help="extra runs, comma-separated from " + ",".join(ACCELS)
                    + ": the opt-in lossy options, and the exact diagnostics eager (compile off), batch1 and "
                    + "nocfgbatch (true CFG as two calls) (default fbc,fp8 on CUDA, none on CPU; 'none' for none)")
    ap.add_argument("--accel-n", type=int, default=None, help="prompts per opt-in run (default 3 batches)")
    ap.add_argument("--fbc-threshold", type=float, default=0.12,
                    help="First-Block-Cache threshold of the fbc run (default 0.12)")
    ap.add_argument("--profile-batch", type=int, default=1, help="batch whose cycle is traced for GPU idle")
    ap.add_argument("--skip-baseline", action="store_true", help="measure shardgen only (no diffusers loop)")
    ap.add_argument("--baseline-only", action="store_true",
                    help="the seed loop only (its images/hour), no shardgen run: benchmarks/real_runs.py's yardstick")
    ap.add_argument("--baseline-offload", action="store_true",
                    help="the baseline with diffusers' enable_model_cpu_offload(): each component moved to the GPU "
                         "for its own call, the diffusers way to run a pipeline larger than the GPU (FLUX.2-dev on "
                         "an 80 GB card); with --baseline-only, on a CUDA GPU")
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
    quick = dict(n=4, steps=2, size=64, batch=2, model="tiny", weights="pretrained", device="cpu")
    full = dict(n=32, batch=4, model="flux_dev", weights="dummy", device="auto")
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.baseline_offload and not a.baseline_only:
        ap.error("--baseline-offload measures the diffusers loop alone: add --baseline-only (shardgen's own run places "
                 "a pipeline larger than the GPU with strategy=device_map or strategy=auto)")
    return a


def main(argv=None) -> dict:
    """Run the benchmark; returns what bench.json holds."""
    return run_bench(parse_args(argv))


def cli() -> int:
    """``python -m jobs.bench``: 0 once the figures are printed and bench.json written; 2 with one line for what the
    user can change (a model too large for the device); a bug raises."""
    from shardgen.errors import UserError

    try:
        main()
    except UserError as e:
        print(f"jobs.bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_program(cli, "jobs.bench")
