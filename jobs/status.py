"""Show a run's progress: shard states, claims and their age, rate, ETA, failures by reason.

    python -m jobs.status RUN_DIR [--shards]
"""

from __future__ import annotations

import argparse
import sys
import time

from shardgen.dataio.claims import FUTURE_TOLERANCE_S
from shardgen.dataio.ledger import read_ledger, run_lease_s
from shardgen.dataio.repair import plan_for_tool
from shardgen.dataio.rundir import run_dir_arg


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fmt_age(age: float | None) -> str:
    if age is not None and age < -FUTURE_TOLERANCE_S:
        return f"{_fmt_s(-age)} in the future (clock skew between hosts)"
    return f"{_fmt_s(age)} ago"


def _print_rate(led, plan, done: int) -> None:
    finished = [s.stats for s in led.shards if s.stats and isinstance(s.stats.get("started"), (int, float))]
    if not finished:
        return
    t0 = min(s["started"] for s in finished)
    end = led.finished_at() or time.time()  # a finished run's rate is measured up to its finish, not to now
    elapsed = max(1e-9, end - t0)
    rate = done / elapsed
    eta = (plan.num_rows - done) / rate if rate > 0 and done < plan.num_rows else 0
    span = f"in {_fmt_s(elapsed)}, up to its finish" if led.finished_at() else f"since the first shard started " \
        f"({_fmt_s(elapsed)} ago)"
    print(f"  rate     {rate:.2f} samples/s {span}; ETA {_fmt_s(eta)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.status", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    ap.add_argument("--shards", action="store_true", help="one line per unfinished shard")
    args = ap.parse_args(argv)
    plan = plan_for_tool(args.run_dir, "not a shardgen run directory yet (no plan/plan.json)")
    if isinstance(plan, str):  # a damaged or missing plan: the line says which file and what to do
        print(plan, file=sys.stderr)
        return 2
    run = plan.run
    led = read_ledger(plan, run_lease_s(run))
    done = led.done_samples
    pct = 100.0 * done / max(1, plan.num_rows)
    print(f"run {run.root}")
    print(f"  samples  {done}/{plan.num_rows} ({pct:.1f}%), {plan.num_rejects} rejected rows in the plan")
    stalled = led.count("stalled") + led.count("dead")
    print(f"  shards   {led.count('done')} done, {led.count('running') + led.count('future')} running, {stalled} stalled "
          f"(claim expired or holder dead; taken over by the next replica), {led.count('pending')} pending, of "
          f"{plan.num_shards}")
    if led.count("damaged"):
        print(f"  damaged  {led.count('damaged')} shards with unreadable stats: the next launch repairs them "
              f"(or python -m jobs.verify {args.run_dir} --repair)")
    _print_rate(led, plan, done)
    totals = led.totals()
    print(f"  results  {totals['ok']} ok, {totals['failed']} failed, {totals['rejected']} rejected (committed shards)")
    for reason, n in led.failures_by_reason.most_common(10):
        print(f"    {n:>8}  {reason}")
    active = [s for s in led.shards if s.state in ("running", "future", "stalled", "dead")]
    if active:
        print("  claims")
        for s in active if args.shards else active[:10]:
            h = s.holder or {}
            print(f"    shard {s.shard:06d} {s.state:8s} {s.samples}/{s.rows} heartbeat {_fmt_age(s.claim_age_s)} "
                  f"by {h.get('host', '?')} pid {h.get('pid', '?')} job {h.get('job') or '-'} replica {h.get('replica', '?')}")
    print("  state    " + ("COMPLETE" if led.count("done") == plan.num_shards else "in progress / resumable"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
