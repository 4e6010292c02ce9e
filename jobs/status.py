"""Show a run's progress: shard states, rate and ETA (also before the first shard commits), each replica's
rate, what each claim holder is doing, the last error in the rank logs, failures by reason, images per shape
(width x height [x frames]) when rows set their own size (prompts.row_settings).

    python -m jobs.status RUN_DIR [--shards] [--json | --prometheus] [--watch [SECONDS]]
"""

from __future__ import annotations

import json
import sys
import time

from shardgen.cli import run_program
from shardgen.dataio.prompts import shape_legend
from shardgen.dataio.resume import run_lease_s
from shardgen.dataio.rundir import FUTURE_TOLERANCE_S
from shardgen.tools import run_metrics, run_status
from shardgen.errors import UserError
from shardgen.tools.entry import plan_for_tool, run_tool, tool_parser


MAX_REPLICA_LINES = 16


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fmt_age(age: float | None) -> str:
    if age is not None and age < -FUTURE_TOLERANCE_S:
        return f"{_fmt_s(-age)} in the future (clock skew between hosts)"
    return f"{_fmt_s(age)} ago"


def _rate_line(st: dict) -> str | None:
    if st["rate"] is None:
        return None
    rate = f"{st['rate']:.2f} samples/s over {_fmt_s(st['elapsed_s'])}"
    if st["state"] == "complete":
        return f"  rate     {rate}, up to its finish"
    if st["state"] in ("stopped", "damaged"):
        return f"  rate     {rate} (until it stopped); no ETA: no live claim, nothing is running. Re-run the " \
               "generate command to continue"
    return f"  rate     {rate} (committed and checkpointed samples); ETA {_fmt_s(st['eta_s'])}"


def print_status(st: dict, run_dir: str, all_claims: bool) -> None:
    """The status as text."""
    sh = st["shards"]
    pct = 100.0 * st["samples_done"] / max(1, st["samples_total"])
    print(f"run {st['run_dir']}")
    print(f"  samples  {st['samples_done']}/{st['samples_total']} ({pct:.1f}%), {st['samples_committed']} in committed "
          f"shards, {st['rejected_in_plan']} rejected rows in the plan")
    print(f"  shards   {sh['done']} done, {sh['running']} running, {sh['stalled']} stalled (claim expired or holder "
          f"dead; taken over by the next replica), {sh['pending']} pending, of {sh['total']}")
    if up := st.get("uploads"):
        behind = up["committed"] - up["uploaded"]
        print(f"  uploads  {up['uploaded']} of {up['committed']} committed shards in {up['uri']}"
              + (f" ({behind} being uploaded, or left by a killed launch: the next launch uploads them)" if behind
                 else ""))
    if sh["damaged"]:
        print(f"  damaged  {sh['damaged']} shards with unreadable stats: the next launch repairs them "
              f"(or python -m jobs.verify {run_dir} --repair)")
    if sh.get("lost"):
        names = ", ".join(f"{x:06d}" for x in st["lost_shards"]) + (" ..." if sh["lost"] > len(st["lost_shards"]) else "")
        print(f"  lost     {sh['lost']} committed shard(s) whose shard file is gone ({names}): the next launch of the "
              f"generate command makes them again (python -m jobs.verify {run_dir} says more)")
    if sh.get("resized"):
        names = ", ".join(f"{x:06d}" for x in st["resized_shards"]) + (" ..." if sh["resized"] > len(st["resized_shards"]) else "")
        print(f"  damaged  {sh['resized']} committed shard(s) whose tar is not the size its stats record ({names}): "
              f"changed after their commit; python -m jobs.verify {run_dir} --repair removes them and the next "
              "launch of the generate command makes them again")
    if line := _rate_line(st):
        print(line)
    shown = st["replicas"][:MAX_REPLICA_LINES]  # the most recently active first
    for r in shown:
        rate = "?" if r["rate"] is None else f"{r['rate']:.2f}"
        launch = f" ({r['launch']})" if r.get("launch") else ""
        print(f"  replica  {r['replica']}{launch}: {r['samples']} samples, {rate} samples/s")
    if len(st["replicas"]) > len(shown):
        print(f"  replica  ... {len(st['replicas']) - len(shown)} more, active earlier (--json lists every one)")
    res = st["results"]
    print(f"  results  {res['ok']} ok, {res['failed']} failed, {res['rejected']} rejected (committed shards)")
    if res.get("truncated"):
        print(f"  truncated {res['truncated']} prompts longer than a text encoder keeps, generated from their first "
              "tokens (\"truncated\": true in their json and index)")
    for reason, n in list(st["failures_by_reason"].items())[:10]:
        print(f"    {n:>8}  {reason}")
    if st["shapes"] and (st["row_settings"] or len(st["shapes"]) > 1):
        print("  shapes   " + ", ".join(f"{n} at {shape}" for shape, n in st["shapes"].items())
              + f" (images in committed shards, {shape_legend(st['shapes'])})")
    if st["claims"]:
        print("  claims")
        for c in st["claims"] if all_claims else st["claims"][:10]:
            doing = f"{c['samples']}/{c['rows']} samples"
            if c["last_batch_age_s"] is not None:
                doing += f", last batch durable {_fmt_s(c['last_batch_age_s'])} ago"
            print(f"    shard {c['shard']:06d} {c['state']:8s} {doing}; heartbeat {_fmt_age(c['heartbeat_age_s'])} "
                  f"by {c['host'] or '?'} pid {c['pid'] or '?'} job {c['job'] or '-'} replica {c['replica']}")
    if err := st["last_error"]:
        print(f"  last error  rank {err['rank']} at {err['time']} ({err['level']}, {err['logger']}): {err['message']}")
    if (warn := st["last_warning"]) and st["state"] != "complete":  # a finished run's warnings are in its counts
        print(f"  last warning  rank {warn['rank']} at {warn['time']} ({warn['logger']}): {warn['message']}")
    state = {"complete": "COMPLETE", "running": "in progress / resumable",
             "stopped": "stopped (no live claim) / resumable: re-run the generate command",
             "not started": "not started / resumable",
             "damaged": "DAMAGED: committed shards are lost (above) / resumable: re-run the generate command"}[st["state"]]
    print(f"  state    {state}")


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.status", __doc__)
    ap.add_argument("--shards", action="store_true",
                    help="a line for every claimed shard (running or stalled), not only the first 10; shards nobody "
                         "has claimed yet are counted, not listed")
    form = ap.add_mutually_exclusive_group()  # one output format on stdout
    form.add_argument("--json", action="store_true", help="the status as one JSON object on stdout")
    form.add_argument("--prometheus", action="store_true",
                    help="the run's figures and every rank's counters (metrics/*.prom) in Prometheus' text format")
    ap.add_argument("--watch", nargs="?", type=float, const=WATCH_S, metavar="SECONDS",
                    help=f"show the status again every SECONDS (default {WATCH_S:g}) until the run is complete or "
                         "Ctrl-C; on a terminal each view replaces the last")
    return run_tool(ap, argv, status, plan="not a shardgen run directory yet (no plan/plan.json)",
                    check=_check_watch)


WATCH_S = 5.0


def _check_watch(args) -> None:
    if args.watch is not None and not args.watch > 0:
        raise UserError(f"--watch {args.watch:g}: give a number of seconds above 0")


def status(args, plan) -> int:
    """Print the status of ``plan``'s run as asked; with ``--watch``, again every few seconds until it is complete."""
    if args.watch is None:
        show(args, plan)
        return 0
    clear = sys.stdout.isatty()
    try:
        while True:
            if clear:
                sys.stdout.write("\033[H\033[2J")  # the next view replaces this one, as watch(1) does
            elif args.json or args.prometheus:
                pass  # one document per view, one after another
            else:
                print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
            st = show(args, plan)
            sys.stdout.flush()
            if st["state"] == "complete":
                return 0
            time.sleep(args.watch)
            plan = plan_for_tool(args.run_dir, "not a shardgen run directory yet (no plan/plan.json)")  # appended rows
    except KeyboardInterrupt:
        return 0


def show(args, plan) -> dict:
    """Print the status of ``plan``'s run once, as asked; the status."""
    st = run_status(plan, run_lease_s(plan.run))
    if args.prometheus:
        sys.stdout.write(run_metrics(st, plan).decode())
    elif args.json:
        print(json.dumps(st, sort_keys=True) if args.watch is not None else json.dumps(st, indent=1, sort_keys=True))
    else:
        print_status(st, args.run_dir, args.shards)
    return st


if __name__ == "__main__":
    run_program(main, "jobs.status")
