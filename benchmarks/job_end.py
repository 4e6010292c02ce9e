"""What a job's end reads on a big run: the old whole-run ledger (every committed shard's stats) against
the status ledger a job's end now reads (only stats committed since the last reader), timed and with metadata
operations counted as in sim_cluster.py. Run it on a run directory a simulation left (``sim_cluster.py --dir``):

    python benchmarks/job_end.py RUN_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sim_cluster import COUNTER  # noqa: E402
from shardgen.dataio.prompts.plan import load_plan  # noqa: E402
from shardgen.dataio.resume.ledger import read_ledger, read_status_ledger  # noqa: E402
from shardgen.dataio.rundir.layout import RunDir  # noqa: E402


def timed(label: str, fn) -> None:
    ops0, t0 = COUNTER.total(), time.perf_counter()
    led = fn()
    done = led.count("done")
    print(f"{label}: {time.perf_counter() - t0:.2f} s, {COUNTER.total() - ops0} metadata operations, "
          f"{done} shards done", flush=True)


def main() -> None:
    run = RunDir(Path(sys.argv[1]))
    plan = load_plan(run)
    print(f"{run.root}: {plan.num_shards} shards")
    COUNTER.install()
    try:
        timed("read_ledger (a job's end before)", lambda: read_ledger(plan))
        run.stats_cache_path.unlink(missing_ok=True)
        timed("read_status_ledger, no cache yet (the run's first reader)", lambda: read_status_ledger(plan))
        timed("read_status_ledger, cache (a job's end now)", lambda: read_status_ledger(plan))
    finally:
        COUNTER.uninstall()


if __name__ == "__main__":
    main()
