"""The tail of a run against the number of shards per replica, simulated (benchmarks/sim_cluster.py).

The same work (``--work`` samples per replica, ``--sample-s`` seconds each) is cut into k shards per replica for
each k of ``--per-replica``, as the planner's ``SHARDS_PER_REPLICA`` = k would cut it (shardgen/dataio/shards/
sizing.py: about k x replicas shards). Replicas start spread over ``--stagger`` shard times of the coarsest
cut (SLURM jobs do not start together) and each fake batch takes its time +- ``--jitter`` (GPUs and prompts
differ). Reported per k, as the median over ``--seeds`` runs: the run's length against a perfectly balanced one,
the tail (from the first replica with nothing left to do to the last commit) in seconds and in shard times, the
replicas' idle share (GPU time lost), and the metadata operations per sample (the cost of smaller shards).

    PYTHONPATH=$PWD nice -n 10 python benchmarks/tail_sweep.py --replicas 32 --procs 2 --seeds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path


def _sim():
    spec = importlib.util.spec_from_file_location("sim_cluster", Path(__file__).with_name("sim_cluster.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sweep(replicas: int, procs: int, work: int, sample_s: float, per_replica: list[int], seeds: int,
          stagger: float, jitter: float) -> list[dict]:
    """One row per k: the medians over the seeds' runs."""
    sim, rows = _sim(), []
    coarsest = work // min(per_replica) * sample_s  # a shard's time at the smallest k
    for k in per_replica:
        per_shard = work // k
        runs = []
        for seed in range(seeds):
            with tempfile.TemporaryDirectory(prefix="tailsweep-") as tmp:
                fig = sim.simulate(Path(tmp) / "run", replicas, k * replicas, per_shard=per_shard, batch=1,
                                   gen_s=sample_s, seconds=20 * work * sample_s, lease_s=30 * coarsest,
                                   heartbeat_s=coarsest, poll_s=coarsest / 8, seed=seed, procs=procs,
                                   stagger_s=stagger * coarsest, jitter=jitter)
            assert fig["complete"] and fig["duplicated_samples"] == 0, fig
            runs.append(fig)
        shard_s = per_shard * sample_s
        ideal = work * sample_s + stagger * coarsest / 2  # balanced: the mean start delay, then the work
        med = lambda key: statistics.median(f[key] for f in runs)  # noqa: E731
        rows.append(dict(per_replica=k, shards=k * replicas, samples_per_shard=per_shard, shard_s=shard_s,
                         run_s=med("run_s"), over_ideal=round(med("run_s") / ideal - 1, 3), tail_s=med("tail_s"),
                         tail_shards=round(med("tail_s") / shard_s, 2), idle_share=med("tail_idle_share"),
                         ops_per_sample=round(statistics.median(f["ops_per_shard_working"] for f in runs) / per_shard, 1),
                         load=round(statistics.median(f["load"] for f in runs), 1), takeovers=sum(f["takeovers"] for f in runs)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--work", type=int, default=16, help="samples per replica (divisible by every k)")
    ap.add_argument("--sample-s", type=float, default=1.0, help="a fake sample's time (one sample a batch)")
    ap.add_argument("--per-replica", default="4,8,16", help="shards per replica to compare")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--stagger", type=float, default=1.0, help="replicas start within this many coarsest shards")
    ap.add_argument("--jitter", type=float, default=0.2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = sweep(a.replicas, a.procs, a.work, a.sample_s, [int(k) for k in a.per_replica.split(",")], a.seeds,
                 a.stagger, a.jitter)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
