"""Write a run's report: one self-contained HTML page (counts, throughput per replica, failures by
reason, truncation, signal histograms, contact sheet).

    python -m jobs.report RUN_DIR [--out RUN_DIR/report.html]
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardgen.tools import check_tool_output, write_report
from shardgen.tools.entry import run_tool, tool_parser


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.report", __doc__)
    ap.add_argument("--out", default=None, help="the HTML file (default RUN_DIR/report.html)")
    return run_tool(ap, argv, report)


def report(args, plan) -> int:
    """Write the report of ``plan``'s run."""
    out = Path(args.out) if args.out else plan.run.report_path
    check_tool_output(out, plan.run)  # before the report is built
    write_report(plan, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
