"""How long does the generation loop wait on image encoding and tar writing?

Runs the real ``jobs.generate`` path on the tiny model with 1024x1024 PNG output (CPU by default)
and prints the writer's busy time and the loop's wait on it, as fractions of wall time.

    python benchmarks/writer_overlap.py [--n 16] [--steps 1] [--batch 4] [--format png] [--threads 2] [--shard 4]

``--shard N`` sets ``samples_per_shard`` (default: the planner's choice); shards of one batch each, as a short
run gets, make the loop hand over a shard's last batch and its commit at every batch.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from shardgen.config.store import register_configs
from shardgen.run.runner import RunResult

CONF = Path(__file__).resolve().parent.parent / "conf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--format", default="png")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shard", type=int, default=0, help="samples_per_shard (0: the planner's choice)")
    args = ap.parse_args()
    register_configs()
    run_dir = Path(tempfile.mkdtemp(prefix="shardgen-bench-"))
    overrides = [f"run_dir={run_dir}", f"prompts.limit={args.n}", f"steps={args.steps}", f"batch_size={args.batch}",
                 f"height={args.size}", f"width={args.size}", f"image_format={args.format}", "progress=false",
                 f"writer_threads={args.threads}", f"device={args.device}"]
    if args.shard:
        overrides.append(f"samples_per_shard={args.shard}")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=overrides)
    from shardgen.run import runner

    captured = {}
    orig = runner.ReplicaWorker.run

    def spy(self):  # keep the worker to read its sink's timers after the run
        captured["worker"] = self
        return orig(self)

    runner.ReplicaWorker.run = spy
    t0 = time.perf_counter()
    result: RunResult = runner.run_rank(cfg)
    wall = time.perf_counter() - t0
    w = captured["worker"]
    loop_wall = w.gen_s + w.sink.wait_s
    print(f"{args.n} images {args.size}x{args.size} {args.format}, tiny model, {args.steps} steps, batch {args.batch}, "
          f"{args.threads} encoder threads, device {args.device}, "
          f"{args.shard or 'planned'} samples a shard")
    print(f"  job wall            {wall:8.2f} s (model load and planning included)")
    print(f"  generation          {w.gen_s:8.2f} s")
    print(f"  writer busy         {w.sink.write_s:8.2f} s  (encode + tar append + fsync + checkpoint, overlapped)")
    print(f"  loop waited         {w.sink.wait_s:8.2f} s  = {100 * w.sink.wait_s / loop_wall:.1f}% of the loop's wall time")
    print(f"  tar bytes           {sum(p.stat().st_size for p in (run_dir / 'shards').glob('*.tar')) / 2**20:8.1f} MiB")
    assert result.ok == args.n
    shutil.rmtree(run_dir)


if __name__ == "__main__":
    main()
