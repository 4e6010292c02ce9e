"""Write a run's report: one self-contained HTML page (counts, throughput per replica, failures by
reason, truncation, signal histograms, contact sheet).

    python -m jobs.report RUN_DIR [--out RUN_DIR/report.html]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardgen.dataio.resume import plan_for_tool
from shardgen.dataio.rundir import run_dir_arg
from shardgen.dataio.tools import check_tool_output, tool_errors, write_report


@tool_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    ap.add_argument("--out", default=None, help="the HTML file (default RUN_DIR/report.html)")
    args = ap.parse_args(argv)
    plan = plan_for_tool(args.run_dir)
    if isinstance(plan, str):  # a damaged or missing plan: the line says which file and what to do
        print(plan, file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else plan.run.report_path
    check_tool_output(out, plan.run)  # before the report is built
    write_report(plan, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
