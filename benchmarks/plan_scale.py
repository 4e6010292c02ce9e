"""How planning scales: time and plan size for N prompts, and a no-op resume of a finished run.

Generates a txt prompt file of N short prompts (~20 bytes a line) under --tmp, plans it with the
real ``build_plan`` (the file's SHA-256, which a new run computes once, is timed apart), then
marks every shard done (a stats file per shard, as a finished run has) and times
``jobs.generate``'s ``run(cfg)`` on it: the no-op resume a requeued job or a repeated command pays.

    python benchmarks/plan_scale.py --n 1000000            # ~20 MB of prompts
    python benchmarks/plan_scale.py --n 100000000 --no-resume   # ~2 GB: check `df -h /tmp` first
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


def write_prompts(path: Path, n: int) -> None:
    """``n`` lines like "a photo of thing 1234" (about 20 bytes each); seq | sed where there is one."""
    import subprocess

    if shutil.which("seq") and shutil.which("sed"):
        with open(path, "wb") as f:
            seq = subprocess.Popen(["seq", "0", str(n - 1)], stdout=subprocess.PIPE)
            subprocess.run(["sed", "s/^/a photo of thing /"], stdin=seq.stdout, stdout=f, check=True)
            seq.wait()
        return
    chunk = 1_000_000
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, chunk):
            f.write("".join(f"a photo of thing {i}\n" for i in range(start, min(n, start + chunk))))


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mark_done(plan) -> None:
    """A stats file per shard: the run looks finished to every reader (ledger, status, resume)."""
    from shardgen.dataio.rundir import atomic_write_json

    plan.run.create()
    now = time.time()
    for shard in range(plan.num_shards):
        n = len(plan.shard_range(shard))
        atomic_write_json(plan.run.shard_stats(shard), dict(
            shard=shard, count=n, ok=n, failed=0, rejected=0, failures_by_reason={}, failed_samples=[],
            tar_bytes=0, started=now, finished=now, wall_s=0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="prompts")
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the prompt file and the run go")
    ap.add_argument("--no-resume", action="store_true", help="skip the no-op resume measurement")
    ap.add_argument("--prompts", default=None, help="an existing txt prompt file of --n lines (kept)")
    ap.add_argument("--keep", action="store_true", help="keep the prompt file and the run")
    args = ap.parse_args()

    from shardgen.dataio.plan import PromptSource, build_plan, file_sha256
    from shardgen.dataio.rundir import RunDir

    work = Path(tempfile.mkdtemp(prefix="plan_scale-", dir=args.tmp))
    prompts = Path(args.prompts) if args.prompts else work / "prompts.txt"
    t = time.perf_counter()
    if not args.prompts:
        write_prompts(prompts, args.n)
    size = prompts.stat().st_size
    print(f"prompt file: {args.n:,} prompts, {size / 1e6:,.1f} MB, written in {time.perf_counter() - t:.1f} s")
    try:
        t = time.perf_counter()
        file_sha256(prompts)
        hash_s = time.perf_counter() - t
        run = RunDir(work / "run")
        t, cpu = time.perf_counter(), time.process_time()
        plan = build_plan(run, PromptSource(str(prompts), "txt"), samples_per_shard=args.samples_per_shard,
                          run_seed=0)
        plan_s, plan_cpu_s = time.perf_counter() - t, time.process_time() - cpu
        figures = dict(prompts=args.n, prompt_mb=round(size / 1e6, 1), shards=plan.num_shards,
                       plan_s=round(plan_s, 2), plan_cpu_s=round(plan_cpu_s, 2), hash_s=round(hash_s, 2),
                       plan_kb=round(dir_bytes(run.plan_dir) / 1e3, 1), cpus=os.cpu_count(),
                       load_avg_1m=round(os.getloadavg()[0], 1))
        print(f"plan: {plan_s:.2f} s ({plan_cpu_s:.2f} s of CPU), {figures['plan_kb']:,} kB in plan/ "
              f"({plan.num_shards:,} shards); the prompt file's SHA-256 (once per new run): {hash_s:.2f} s")
        if not args.no_resume:
            figures["noop_resume_s"] = round(noop_resume(run, prompts, args.samples_per_shard, plan), 2)
            print(f"no-op resume of the finished run (run(cfg), imports excluded): {figures['noop_resume_s']:.2f} s")
        print(json.dumps(figures))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def noop_resume(run, prompts: Path, samples_per_shard: int, plan) -> float:
    """Seconds of the second ``run(cfg)`` on the finished run (the first one also writes the
    fingerprint and hashes the prompt file, as a new run's first launch does)."""
    from hydra import compose, initialize_config_dir

    from jobs.generate import run as generate
    from shardgen.config.schema import register_configs

    register_configs()
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=[
            f"run_dir={run.root}", f"prompts.path={prompts}", "prompts.format=txt",
            f"samples_per_shard={samples_per_shard}", "progress=false"])
    os.environ.setdefault("SHARDGEN_CACHE", str(run.root.parent / "cache"))
    mark_done(plan)
    generate(cfg)  # first launch: writes the fingerprint, hashes the prompt file, finds the finished plan
    t = time.perf_counter()
    result = generate(cfg)
    elapsed = time.perf_counter() - t
    assert result.complete and result.generated_here == 0, result
    return elapsed


if __name__ == "__main__":
    main()
