"""Audit a run directory; exit 1 on any defect (``--repair``: make damaged shards sound or absent). A run still
in progress is checked as far as it is committed: its other shards are listed as in progress, not as defects.

    python -m jobs.verify RUN_DIR [--no-decode] [--repair]
"""

from __future__ import annotations

import argparse
import sys

from shardgen.dataio.resume import load_plan_checked
from shardgen.dataio.rundir import RunDir, run_dir_arg
from shardgen.dataio.tools import count_arg, repair_run, tool_errors, verify_run
from shardgen.errors import UserError


@tool_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    ap.add_argument("--no-decode", action="store_true", help="skip decoding every image (faster)")
    ap.add_argument("--repair", action="store_true",
                    help="rewrite stats from sound tars; remove shards whose samples are wrong (generate makes them again)")
    ap.add_argument("--max-lines", type=count_arg(0), default=20, help="defects to print")
    args = ap.parse_args(argv)
    try:
        plan = load_plan_checked(RunDir.at(args.run_dir))
    except UserError as e:
        print(f"{args.run_dir}: {e}", file=sys.stderr)
        return 2
    if plan is None:
        print(f"{args.run_dir}: not a shardgen run directory (no plan/plan.json)", file=sys.stderr)
        return 2
    rep = verify_run(plan, decode=not args.no_decode)
    status = ", ".join(f"{v} {k}" for k, v in sorted(rep.status.items()))
    print(f"{args.run_dir}: {rep.shards_checked}/{plan.num_shards} shards, {rep.samples}/{plan.num_rows} samples ({status})")
    for line in rep.defects[: args.max_lines]:
        print("  DEFECT", line)
    if len(rep.defects) > args.max_lines:
        print(f"  ... and {len(rep.defects) - args.max_lines} more")
    for line in rep.unfinished[: args.max_lines]:
        print("  UNFINISHED", line)
    if len(rep.unfinished) > args.max_lines:
        print(f"  ... and {len(rep.unfinished) - args.max_lines} more")
    if rep.earlier_settings:
        print(f"  NOTE     {sum(rep.earlier_settings.values())} samples were made with settings the run had before "
              f"allow_fingerprint_change ({', '.join(f'{n} with {s}' for s, n in rep.earlier_settings.items())}; "
              "fingerprint_changes.jsonl): kept, --repair leaves them. To make them again with the current "
              "settings, delete their shards' .tar and .stats.json and re-run the generate command")
    if rep.ok:
        print("OK: every prompt index exactly once, every tar readable and unchanged, every sample as planned, "
              "counts match")
        return 0
    if rep.sound:
        print(f"OK so far: the run is unfinished ({len(rep.unfinished)} of {plan.num_shards} shards not committed: "
              f"{rep.in_progress} in progress, {len(rep.unfinished) - rep.in_progress} not started); the committed "
              "shards are sound. The generate command continues it")
        if args.repair:
            for line in repair_run(plan, rep):  # an interrupted commit's tar: finished now
                print("  REPAIRED", line)
        return 0
    print(f"FAILED: {len(rep.defects)} defects")
    if args.repair:
        for line in repair_run(plan, rep):
            print("  REPAIRED", line)
        print(f"Now re-run the generate command (e.g. python -m jobs.generate run_dir={args.run_dir} ...) "
              "with the run's settings to complete it.")
    elif rep.bad_shards:
        print(f"To repair: python -m jobs.verify {args.run_dir} --repair, then re-run the generate command")
    return 1


if __name__ == "__main__":
    sys.exit(main())
