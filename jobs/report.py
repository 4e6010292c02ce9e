"""Write a run's report: one self-contained HTML page (counts, throughput per replica, failures by
reason, truncation, signal histograms, contact sheet).

    python -m jobs.report RUN_DIR [--out RUN_DIR/report.html]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardgen.dataio.plan import load_plan
from shardgen.dataio.report import write_report
from shardgen.dataio.rundir import RunDir, run_dir_arg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    ap.add_argument("--out", default=None, help="the HTML file (default RUN_DIR/report.html)")
    args = ap.parse_args(argv)
    run = RunDir(Path(args.run_dir).absolute())
    plan = load_plan(run)
    if plan is None:
        print(f"{args.run_dir}: not a shardgen run directory (no plan/plan.json)", file=sys.stderr)
        return 2
    out = write_report(plan, Path(args.out) if args.out else run.root / "report.html")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
