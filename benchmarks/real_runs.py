"""Whole runs as a user launches them, side by side with the diffusers guide's loop.

    python benchmarks/real_runs.py --model flux_dev --steps 28 --n 48 --seed-n 8 --out $OUT/flux_dev

One process per line, in this order, on one prompt file of captions of 1 to 200 words
(``shardgen.bench.main.bench_prompts``: a count that need not divide by the batch):

1. ``seed``: ``python -m jobs.bench --baseline-only`` on the first ``--seed-n`` prompts: the guide's
   eager loop (one prompt per call, the job's generation arguments, PNG saved): images/hour, steady;
2. ``eager``: ``python -m jobs.generate ... compile=false``;
   ``ungraphed``: the same with ``cuda_graphs=false`` (every transformer call launched from Python);
3. ``cold``: ``python -m jobs.generate ...`` with default settings (``compile: auto``) on a fresh
   ``$SHARDGEN_CACHE`` (its compile cache and compile records empty): a first job on a new node;
4. ``compiled-cold``: ``compile=true`` on another fresh cache: what compiling on the main thread costs and gives
   here, and a cache that has compiled this model (as a long first job leaves it: a short default job on a
   fresh cache stays eager and compiles nothing);
5. ``warm``: default settings again, on the cache ``compiled-cold`` filled: a second job or node on a cache only
   ``compile=true`` jobs have used (no eager speed recorded: the job times two eager batches before deciding);
6. ``requeued``: default settings once more, on the same cache after ``warm``: a requeued job or the next job of
   the same run, which finds the eager speed and the compile figures ``warm`` recorded and decides
   before its first batch.

``--skip`` leaves ways out; a later call with the same ``--out`` runs the rest (e.g. ``warm`` alone, on the cache
an earlier call's ``compiled-cold`` left) and merges its figures into the same ``summary.json``.

Whole-run figures are the prompt count over the process's wall time (interpreter start, model build,
planning, compilation, the last commit: everything the user waits for), against the seed loop's steady
rate, so they understate shardgen, and against the seed loop's whole process for the same prompt count
(``seed_whole_s``: its process time with its ``--seed-n`` prompts at its steady rate replaced by ``--n``
prompts at that rate: the same interpreter start and model build); the steady figure is the job's median batch once compiled (from its
``compile=auto`` summary line). Results: ``summary.json`` and one log per process under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(cmd: list[str], log: Path, env: dict) -> tuple[float, int, str]:
    """(wall seconds, exit status, output) of ``cmd`` run to completion, its output streamed to ``log`` (what a
    way printed survives a benchmark cut short by a time limit)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    print(f"  {log.stem}: rc {proc.returncode}, {wall:.1f} s", flush=True)
    return wall, proc.returncode, log.read_text()


def parse_job(out: str) -> dict:
    """The job's own figures from its log: compile decision, batch timings, graphs."""
    res = {}
    if m := re.search(r"compile=auto: (compiling|staying eager) \((.*)\)", out):
        res["decision"], res["reason"] = m.group(1), m.group(2)
    if m := re.search(r"(\d+) eager batches, ([\d.]+) s/sample", out):
        res["eager_batches"], res["eager_s_per_sample"] = int(m.group(1)), float(m.group(2))
    if m := re.search(r"(\d+) compiled batches, first ([\d.]+) s/sample(?:, steady ([\d.]+) s/sample)?", out):
        res["compiled_batches"], res["first_compiled_s_per_sample"] = int(m.group(1)), float(m.group(2))
        res["steady_s_per_sample"] = float(m.group(3)) if m.group(3) else None
    if m := re.search(r"compiled graphs in this process: (\d+)(?: \((.*)\))?", out):
        res["graphs"] = int(m.group(1))
        if m.group(2):
            res["compile_cache"] = m.group(2)
    if m := re.search(r": (\d+) (?:images|videos), (\d+) failed", out):
        res["ok"], res["failed"] = int(m.group(1)), int(m.group(2))
    return res


def seed_loop(out: Path, model: str, steps: int, seed_n: int, n: int, env: dict, weights: str = "dummy",
              device: str = "cuda", size: str | None = None, overrides: list[str] = (), offload: bool = False) -> dict:
    """The seed loop (``jobs.bench --baseline-only``: the guide's ``pipe(prompt).images[0].save()`` per prompt) on
    the first ``seed_n`` prompts, one process on a fresh cache: its whole-process time, steady images/hour, and
    ``seed_whole_s``, the same process with ``n`` prompts at its steady rate. Its images stay under
    ``out/seed/work`` (``psnr_vs_seed``). ``offload``: the loop under diffusers' enable_model_cpu_offload (a pipeline
    larger than the GPU)."""
    seed_env = dict(env, SHARDGEN_CACHE=str(out / "seed-cache"))
    wall, rc, log = timed([sys.executable, "-m", "jobs.bench", "--model", model, "--steps", str(steps),
                           "--n", str(seed_n), "--weights", weights, "--baseline-only", "--device", device,
                           "--out", str(out / "seed"), "--workdir", str(out / "seed" / "work"),
                           *(["--size", size] if size else []), *sum((["--set", o] for o in overrides), []),
                           *(["--baseline-offload"] if offload else [])],
                          out / "seed.log", seed_env)
    base = json.loads((out / "seed" / "bench.json").read_text()).get("baseline", {}) if rc == 0 else {}
    return projected_seed({"rc": rc, "process_s": wall, "images_per_hour": base.get("images_per_hour"),
                           "n": base.get("n")}, n)


def projected_seed(seed: dict, n: int) -> dict:
    """``seed`` (``seed_loop``'s figures, perhaps of another call with another ``n``) with ``seed_whole_s`` for
    ``n`` prompts: the same process making ``n`` prompts, its own prompts' time plus the rest at its steady rate."""
    out = {k: v for k, v in seed.items() if k != "seed_whole_s"}
    if seed.get("images_per_hour") and seed.get("n") and seed.get("process_s"):
        out["seed_whole_s"] = seed["process_s"] + (n - seed["n"]) * 3600 / seed["images_per_hour"]
    return out


def psnr_vs_seed(run_dir: Path, seed_dir: Path, n: int) -> dict:
    """PSNR of the job's samples against the seed loop's images of the same prompts and seeds (the first ``n``
    rows): the job's output is the seed loop's up to bf16 noise, whatever ran (eager, compiled, fused)."""
    if not seed_dir.is_dir() or not run_dir.is_dir():
        return {}
    from shardgen.bench import measure as M

    try:
        stats = M.psnr_stats(M.shard_images(run_dir), M.read_outputs(seed_dir, n))
    except Exception as e:  # noqa: BLE001 - a figure missing, the run's own figures stay
        return {"psnr_error": f"{type(e).__name__}: {e}"[:300]}
    return {"psnr_vs_seed": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in stats.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--n", type=int, default=48, help="prompts per job (default 48)")
    ap.add_argument("--seed-n", type=int, default=8, help="prompts of the seed loop (its steady rate)")
    ap.add_argument("--fill-n", type=int, default=None,
                    help="prompts of compiled-cold (default --n): fewer fill the cache warm runs on in less device time "
                         "(its whole-run figure is then for those prompts)")
    ap.add_argument("--size", default=None, help="HEIGHTxWIDTH (default: the model's own)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="dummy", help="model.weights (dummy: random weights, no download)")
    ap.add_argument("--skip", default="",
                    help="comma-separated ways to leave out: seed,eager,ungraphed,cold,compiled-cold,warm,requeued "
                         "(default: none)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra job overrides (both ways)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from shardgen.bench.main import bench_prompts

    out = Path(a.out).absolute()
    if out.is_dir() and any(out.iterdir()) and not (out / "prompts.txt").is_file():
        raise SystemExit(f"--out {out}: not empty and not an earlier real_runs.py output; give a new directory "
                         "(a rerun deletes the run-*/, cache*/ and seed*/ subdirectories of the ways it runs)")
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    # way -> (overrides, compile cache): "cold" and "compiled-cold" each start from an empty cache; "warm" reuses
    # the one "compiled-cold" filled (its compiled artifacts and compile records), as a requeued job would
    ways = {"eager": (["compile=false"], "cache-eager"),
            "ungraphed": (["compile=false", "cuda_graphs=false"], "cache-ungraphed"), "cold": ([], "cache"),
            "compiled-cold": (["compile=true"], "cache-compiled"), "warm": ([], "cache-compiled"),
            "requeued": ([], "cache-compiled")}
    # this script's own outputs, for the ways this call runs: each way's run dir, and its cache unless it reuses one
    fresh = {way: [f"run-{way}"] + ([cache] if way not in ("warm", "requeued") else []) for way, (_, cache) in ways.items()}
    fresh["seed"] = ["seed", "seed-cache"]
    for way, dirs in fresh.items():
        if way not in skip:
            for d in dirs:
                shutil.rmtree(out / d, ignore_errors=True)
    if not {"warm", "requeued"} <= skip and "compiled-cold" in skip and not (out / "cache-compiled").is_dir():
        raise SystemExit("warm runs on the cache compiled-cold filled: run compiled-cold first (same --out)")
    prompts = out / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in bench_prompts(a.n)), encoding="utf-8")
    fill_n = min(a.fill_n or a.n, a.n)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    size = []
    if a.size:
        h, _, w = a.size.partition("x")
        size = [f"height={h}", f"width={w or h}"]
    job = [sys.executable, "-m", "jobs.generate", f"model={a.model}", f"model.weights={a.weights}", "prompts=txt",
           f"prompts.path={prompts}", f"steps={a.steps}", f"device={a.device}", "progress=false", *size, *a.overrides]
    old_res = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    same = old_res.get("model") == a.model and old_res.get("steps") == a.steps and old_res.get("n") == a.n
    res: dict = {**(old_res if same else {}), "model": a.model, "steps": a.steps, "n": a.n, "argv": sys.argv}
    if "seed" not in skip:
        res["seed"] = seed_loop(out, a.model, a.steps, a.seed_n, a.n, env, weights=a.weights, device=a.device,
                                size=a.size, overrides=a.overrides)
    for way, (extra, cache_name) in ways.items():
        if way in skip:
            continue
        way_env = dict(env, SHARDGEN_CACHE=str(out / cache_name))
        n = fill_n if way == "compiled-cold" else a.n
        limit = [f"prompts.limit={n}"] if n < a.n else []
        wall, rc, log = timed(job + [f"run_dir={out / ('run-' + way)}", *extra, *limit], out / f"{way}.log", way_env)
        r = dict(parse_job(log), rc=rc, wall_s=wall, n=n, images_per_hour=3600 * n / wall)
        r.update(psnr_vs_seed(out / f"run-{way}", out / "seed" / "work" / "baseline", a.seed_n))
        res[way] = r
        (out / "summary.json").write_text(json.dumps(res, indent=1))  # a run cut short keeps what it measured
    seed = (res.get("seed") or {}).get("images_per_hour")
    seed_whole = (res.get("seed") or {}).get("seed_whole_s")
    for way in ways:
        r = res.get(way)
        if r and seed_whole and r.get("n", a.n) == a.n:
            r["x_seed_whole"] = seed_whole / r["wall_s"]
        if r and seed:
            r["x_seed_loop"] = r["images_per_hour"] / seed
            if r.get("steady_s_per_sample"):
                r["steady_x_seed_loop"] = 3600 / r["steady_s_per_sample"] / seed
        if r and res.get("eager") and r.get("n", a.n) == res["eager"].get("n", a.n):
            r["x_eager_job"] = res["eager"]["wall_s"] / r["wall_s"]
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "argv"}, indent=1))


if __name__ == "__main__":
    main()
