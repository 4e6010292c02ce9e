"""Lossless against lossy, whole runs as a user launches them, with the fidelity beside each speed.

    python benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 24 [--seed-n 8] --out $OUT/flux_dev
    python benchmarks/lossy_runs.py --model flux_dev --steps 28 --n 96 --ways fp8 \
      --seed-from $OUT/flux_dev/summary.json --out $OUT/flux_dev-96    # the same machine's seed loop, not run again

One process per way, in this order, on one prompt file of captions of 1 to 200 words
(``shardgen.bench.main.bench_prompts``), each on a fresh ``$SHARDGEN_CACHE`` (a first job on a new node):

- ``bf16``: ``python -m jobs.generate`` with default settings (lossless);
- ``fp8``: the same with ``fp8=true``;
- ``fp8-compiled`` (only with ``--compiled``): ``fp8=true compile=true``;
- ``sage``, ``fp8-sage`` (named in ``--ways``): ``sdpa_backend=sage`` (SageAttention), alone and with fp8;
- ``attention8``, ``fp8-attention8`` (named in ``--ways``): ``sdpa_backend=fp8`` (shardgen's 8-bit attention), alone
  and with fp8; ``fa3``, ``fp8-fa3``: ``sdpa_backend=fa3_fp8`` (FlashAttention-3's float8 kernel), alone and with
  fp8; ``fp8-fa3-compiled``: ``fp8=true sdpa_backend=fa3_fp8 compile=true``; ``fast``: ``speed=fast``.

Each way's whole-process wall time (interpreter start, model build, planning, any compilation, the last commit),
its steady s/sample from the job's compile summary line, and for each lossy way ``jobs.compare`` against ``bf16``:
per-sample PSNR and SSIM, median and worst. On dummy weights these measure numerical error, not image quality.
Results: ``summary.json`` and one log per process under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_runs import parse_job, projected_seed, seed_loop, timed  # noqa: E402

WAYS = {"bf16": [], "fp8": ["fp8=true"], "fp8-compiled": ["fp8=true", "compile=true"],
        "sage": ["sdpa_backend=sage"], "fp8-sage": ["fp8=true", "sdpa_backend=sage"],
        "attention8": ["sdpa_backend=fp8"], "fp8-attention8": ["fp8=true", "sdpa_backend=fp8"],
        "fa3": ["sdpa_backend=fa3_fp8"], "fp8-fa3": ["fp8=true", "sdpa_backend=fa3_fp8"],
        "fp8-fa3-compiled": ["fp8=true", "sdpa_backend=fa3_fp8", "compile=true"],
        "fast": ["speed=fast"]}


def fidelity(run_dir: Path, reference: Path) -> dict:
    """jobs.compare's summary of ``run_dir`` against ``reference``."""
    from shardgen.dataio.rundir import RunDir
    from shardgen.quality.compare import compare_runs

    try:
        s = compare_runs(RunDir(run_dir), RunDir(reference)).summary()
    except Exception as e:  # noqa: BLE001 - a figure missing, the speed figures stay
        return {"compare_error": f"{type(e).__name__}: {e}"[:300]}
    return {"psnr_db": s["psnr_db"], "ssim": s["ssim"], "compared": s["compared"]}


def earlier_seed(summary: Path, model: str, steps: int, n: int) -> dict:
    """The seed loop's figures in an earlier call's ``summary.json``, projected to ``n`` prompts; SystemExit with what
    to change when that file holds none of the same model and steps."""
    try:
        earlier = json.loads(summary.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--seed-from {summary}: not a readable summary.json ({type(e).__name__}: {e})") from None
    seed = earlier.get("seed") if isinstance(earlier, dict) else None
    if not (isinstance(seed, dict) and seed.get("images_per_hour")):
        raise SystemExit(f"--seed-from {summary}: it has no measured seed loop; run this call with --seed-n 8")
    if (earlier.get("model"), earlier.get("steps")) != (model, steps):
        raise SystemExit(f"--seed-from {summary}: its seed loop is {earlier.get('model')} at {earlier.get('steps')} "
                         f"steps, this call {model} at {steps}")
    return projected_seed(seed, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--weights", default="dummy", help="model.weights (dummy: random weights, no download)")
    ap.add_argument("--compiled", action="store_true", help="also fp8=true compile=true")
    ap.add_argument("--ways", default=None, help="comma-separated ways (default bf16,fp8[,fp8-compiled]; none: the "
                    "seed loop alone)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra job overrides (every way)")
    ap.add_argument("--seed-n", type=int, default=0, help="also the seed loop on this many prompts (its steady rate, "
                    "and its whole process projected to --n): each way's x_seed_whole and steady_x_seed")
    ap.add_argument("--seed-from", default=None, metavar="SUMMARY", help="the seed loop of an earlier call's "
                    "summary.json (on the same machine, for the same model and steps) instead of running it again: its "
                    "steady rate, its whole process projected to --n")
    ap.add_argument("--seed-offload", action="store_true", help="the seed loop under diffusers' "
                    "enable_model_cpu_offload (its pipeline in RAM: a GPU it does not fit, FLUX.2-dev on 80 GB)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from shardgen.bench.main import bench_prompts

    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in bench_prompts(a.n)), encoding="utf-8")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    job = [sys.executable, "-m", "jobs.generate", f"model={a.model}", f"model.weights={a.weights}", "prompts=txt",
           f"prompts.path={prompts}", f"steps={a.steps}", "progress=false", *a.overrides]
    ways = [w for w in a.ways.split(",") if w != "none"] if a.ways else \
        ["bf16", "fp8"] + (["fp8-compiled"] if a.compiled else [])
    res: dict = {"model": a.model, "steps": a.steps, "n": a.n, "argv": sys.argv}
    if a.seed_from:
        res["seed"] = dict(earlier_seed(Path(a.seed_from), a.model, a.steps, a.n), source=str(a.seed_from))
    elif a.seed_n:
        shutil.rmtree(out / "seed", ignore_errors=True)
        shutil.rmtree(out / "seed-cache", ignore_errors=True)
        res["seed"] = seed_loop(out, a.model, a.steps, a.seed_n, a.n, env, weights=a.weights, overrides=a.overrides,
                                offload=a.seed_offload)
    for way in ways:
        for d in (f"run-{way}", f"cache-{way}"):
            shutil.rmtree(out / d, ignore_errors=True)
        wall, rc, log = timed(job + [f"run_dir={out / ('run-' + way)}", *WAYS[way]], out / f"{way}.log",
                              dict(env, SHARDGEN_CACHE=str(out / f"cache-{way}")))
        r = dict(parse_job(log), rc=rc, wall_s=round(wall, 1), n=a.n, images_per_hour=round(3600 * a.n / wall))
        if rc != 0:
            r["tail"] = log[-1500:]
        if way != "bf16" and res.get("bf16", {}).get("rc") == 0:  # at once: a call cut short keeps it
            r.update(fidelity(out / f"run-{way}", out / "run-bf16"))
        res[way] = r
        (out / "summary.json").write_text(json.dumps(res, indent=1))  # a run cut short keeps what it measured
    seed = res.get("seed") or {}
    for way in ways:
        r = res[way]
        if r.get("rc") != 0:
            continue
        if way != "bf16" and res.get("bf16", {}).get("rc") == 0 and "psnr_db" not in r:  # ran before bf16
            r.update(fidelity(out / f"run-{way}", out / "run-bf16"))
        if way != "bf16" and res.get("bf16", {}).get("rc") == 0:
            r["x_bf16_whole"] = round(res["bf16"]["wall_s"] / r["wall_s"], 3)
        if seed.get("seed_whole_s"):
            r["x_seed_whole"] = round(seed["seed_whole_s"] / r["wall_s"], 3)
        steady = r.get("steady_s_per_sample") or r.get("eager_s_per_sample")
        if seed.get("images_per_hour") and steady:
            r["steady_x_seed"] = round(3600 / steady / seed["images_per_hour"], 3)
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "argv"}, indent=1))


if __name__ == "__main__":
    main()
