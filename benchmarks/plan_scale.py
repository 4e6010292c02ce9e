"""How planning scales: time and plan size for N prompts, and a no-op resume of a finished run.

Generates a txt prompt file of N short prompts (~20 bytes a line) under --tmp, plans it with the
real ``build_plan`` (the file's SHA-256, which a new run computes once, is timed apart), then
marks every shard done (a stats file per shard, as a finished run has) and times
``jobs.generate``'s ``run(cfg)`` on it: the no-op resume a requeued job or a repeated command pays.

    python benchmarks/plan_scale.py --n 1000000            # ~20 MB of prompts
    python benchmarks/plan_scale.py --n 100000000 --no-resume   # ~2 GB: check `df -h /tmp` first

``--captions`` writes caption-like prompts instead (100-300 characters, a uniform mix, ~200 bytes a
line), and ``--launch`` times what a new run's first launch does before any weight is read
(``prepare_run``: check the file, hash it, write the fingerprint, choose the shard size, plan,
check the run directory) with the default settings plus ``--set KEY=VALUE`` overrides, and the
process's peak memory above what it held before:

    python benchmarks/plan_scale.py --captions --n 10000000 --launch                # 2 GB of captions
    python benchmarks/plan_scale.py --captions --n 1000000 --launch --set prompts.on_truncation=error
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


WORDS = ("a photo of an old wooden house by a quiet lake at dawn with mist over the water and tall pine trees "
         "behind it soft golden light warm tones cinematic wide angle lens shallow depth of field highly detailed "
         "portrait woman man child dog cat red blue green yellow city street night rain neon reflections market "
         "crowded busy vintage car bicycle mountain snow river bridge stone castle garden flowers spring autumn "
         "leaves oil painting watercolor sketch charcoal drawing studio lighting dramatic shadows film grain 35mm "
         "kodak portra aerial view drone shot close-up macro texture glass metal fabric velvet silk smiling "
         "looking at the camera wearing a hat holding an umbrella sitting on a bench reading a book").split()


def write_captions(path: Path, n: int, lo: int = 100, hi: int = 300, seed: int = 0) -> None:
    """``n`` caption-like lines of ``lo``..``hi`` characters (uniform mix of lengths), words drawn at
    random, each line ending with its number so no two are alike (tokenizer caches do not help)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = []  # 65536 distinct caption bodies; line i = body i % 65536 + ", shot i", cut to its length
    words = np.array(WORDS)
    for _ in range(1 << 16):
        pool.append(" ".join(words[rng.integers(0, len(words), 60)]))
    lengths = rng.integers(lo, hi + 1, n)
    chunk = 1_000_000
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, chunk):
            out = []
            for i in range(start, min(n, start + chunk)):
                tail = f", shot {i}"
                out.append(pool[i & 0xFFFF][:lengths[i] - len(tail)] + tail + "\n")
            f.write("".join(out))


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
    ap.add_argument("--captions", action="store_true", help="caption-like prompts of 100-300 characters")
    ap.add_argument("--launch", action="store_true", help="time a first launch's prepare_run with default settings")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (--launch)")
    args = ap.parse_args()

    from shardgen.dataio.prompts import PromptSource, build_plan, file_sha256
    from shardgen.dataio.rundir import RunDir

    work = Path(tempfile.mkdtemp(prefix="plan_scale-", dir=args.tmp))
    prompts = Path(args.prompts) if args.prompts else work / "prompts.txt"
    t = time.perf_counter()
    if not args.prompts:
        (write_captions if args.captions else write_prompts)(prompts, args.n)
    size = prompts.stat().st_size
    print(f"prompt file: {args.n:,} prompts, {size / 1e6:,.1f} MB, written in {time.perf_counter() - t:.1f} s")
    try:
        if args.launch:
            print(json.dumps(first_launch(work / "run", prompts, args.set)))
            return
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


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def first_launch(run_dir: Path, prompts: Path, overrides: list[str]) -> dict:
    """Wall and CPU seconds, and peak memory growth, of ``prepare_run`` on a new run (default settings
    plus ``overrides``); a refusal (e.g. on_truncation=error) is timed too and its message shown."""
    import resource

    from shardgen.run.runner import prepare_run

    cfg = _compose([f"run_dir={run_dir}", f"prompts.path={prompts}", *overrides])
    os.environ.setdefault("SHARDGEN_CACHE", str(run_dir.parent / "cache"))
    rss0 = _rss_mb()
    t, cpu = time.perf_counter(), time.process_time()
    try:
        plan, refused = prepare_run(cfg), None
    except Exception as e:  # the refusal is the measured outcome
        plan, refused = None, f"{type(e).__name__}: {str(e)[:160]}"
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = dict(overrides=overrides, prompt_mb=round(prompts.stat().st_size / 1e6, 1), launch_s=round(wall, 2),
               launch_cpu_s=round(cpu, 2), peak_mb_above_start=round(max(0.0, peak - rss0), 1), cpus=os.cpu_count(),
               load_avg_1m=round(os.getloadavg()[0], 1))
    if plan is not None:
        out.update(rows=plan.num_rows, shards=plan.num_shards, samples_per_shard=plan.samples_per_shard,
                   plan_kb=round(dir_bytes(plan.run.plan_dir) / 1e3, 1))
    return dict(out, refused=refused) if refused else out


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from shardgen.config.store import register_configs

    register_configs()
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="generate", overrides=overrides)


def noop_resume(run, prompts: Path, samples_per_shard: int, plan) -> float:
    """Seconds of the second ``run(cfg)`` on the finished run (the first one also writes the
    fingerprint and hashes the prompt file, as a new run's first launch does)."""
    from jobs.generate import run as generate

    cfg = _compose([f"run_dir={run.root}", f"prompts.path={prompts}", "prompts.format=txt",
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
