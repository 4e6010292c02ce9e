"""A replica's start-up and ``jobs.status`` on a large run, timed (the targets of docs/scaling.md: start-up within
5 s, status within 2 s on a 100k-shard run).

Builds the fixture once (``--shards`` one-sample shards, ``--prefill`` of them committed: hard links of one real
shard with their own stats, benchmarks/sim_cluster.py's ``prefill``), unless ``DIR`` holds it already; then times,
``--rounds`` times each, in this process: a launch's start-up (``load_plan`` + ``repair_run_dir``: what
``prepare_run`` does before generating) and ``jobs.status`` (``main([DIR])``, its stdout discarded). The first
call of each on a fresh fixture builds the caches (``shards_checked.npy``, ``stats_cache.npz``); the later ones
are what every other launch and status call costs. Each figure comes with the 1-min load average
(``/proc/loadavg``): the machine is shared.

    PYTHONPATH=$PWD nice -n 10 python benchmarks/startup_status.py /tmp/run100k --shards 100000 --prefill 0.9
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import time
from pathlib import Path


def _sim():
    spec = importlib.util.spec_from_file_location("sim_cluster", Path(__file__).with_name("sim_cluster.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fixture(root: Path, shards: int, prefill: float) -> float:
    """Build the run at ``root`` unless it is there; the seconds it took (0 when it was there)."""
    from shardgen.dataio.prompts import load_plan

    if (root / "plan" / "plan.json").exists():
        return 0.0
    sim, t0 = _sim(), time.perf_counter()
    run = sim.make_plan(root, shards, 1)
    sim.prefill(run, load_plan(run), prefill)
    return time.perf_counter() - t0


def timings(root: Path, rounds: int) -> list[dict]:
    """One row per call: what, seconds, load average when it ended."""
    from jobs.status import main as status_main
    from shardgen.dataio.prompts import load_plan
    from shardgen.dataio.resume import repair_run_dir
    from shardgen.dataio.rundir import RunDir

    def startup():
        repair_run_dir(load_plan(RunDir(root)), 2.0)

    def status():
        with contextlib.redirect_stdout(io.StringIO()):
            status_main([str(root)])

    rows = []
    for i in range(rounds):
        for what, fn in (("start-up", startup), ("jobs.status", status)):
            t0 = time.perf_counter()
            fn()
            rows.append(dict(what=what, call=i + 1, s=round(time.perf_counter() - t0, 2), load=os.getloadavg()[0]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the run directory (built there when it holds no plan)")
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--prefill", type=float, default=0.9)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args(argv)
    root = Path(a.dir)
    built = fixture(root, a.shards, a.prefill)
    if built:
        print(json.dumps(dict(fixture_built_s=round(built, 1), shards=a.shards, prefill=a.prefill)), flush=True)
    timings(root, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
