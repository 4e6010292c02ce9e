"""Audit a run directory; exit 1 on any defect.

    python -m jobs.verify RUN_DIR [--no-decode]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardgen.dataio.plan import load_plan
from shardgen.dataio.rundir import RunDir, run_dir_arg
from shardgen.dataio.verify import verify_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.verify", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    ap.add_argument("--no-decode", action="store_true", help="skip decoding every image (faster)")
    ap.add_argument("--max-lines", type=int, default=20, help="defects to print")
    args = ap.parse_args(argv)
    plan = load_plan(RunDir(Path(args.run_dir).absolute()))
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
    print("OK: every prompt index exactly once, every tar readable, counts match" if rep.ok
          else f"FAILED: {len(rep.defects)} defects")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
