"""Write a run's report: one self-contained HTML page (counts, throughput per replica, failures by
reason, truncation, signal histograms, contact sheet). Exit 1 when a committed shard is damaged: the
page is still written for what is readable and names the shards (stderr too) and the fix.

    python -m jobs.report RUN_DIR [--out RUN_DIR/report.html] [--force]
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardgen.cli import run_program
from shardgen.tools import check_tool_output, write_report
from shardgen.tools.entry import run_tool, tool_parser
from shardgen.tools.report import check_report_out
from shardgen.tools.runfiles import REPAIR_HINT, share_output

MAX_LINES = 20  # damaged shards named on stderr (the page names them all)


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.report", __doc__)
    ap.add_argument("--out", default=None, help="the HTML file (default RUN_DIR/report.html)")
    ap.add_argument("--force", action="store_true",
                    help="replace --out even when it exists and is not a report this tool wrote")
    return run_tool(ap, argv, report)


def report(args, plan) -> int:
    """Write the report of ``plan``'s run; 0, or 1 when it found damaged shards (named on stderr)."""
    out = Path(args.out) if args.out else plan.run.report_path
    check_tool_output(out, plan.run)  # before the report is built
    if not args.force:
        check_report_out(out, plan.run)  # a user's file given as --out is never replaced unasked
    damaged = write_report(plan, out)
    print(f"wrote {share_output(plan.run, out)}")
    if not damaged:
        return 0
    # a script that only looks at the exit status must notice too: 1, as jobs.verify gives for defects
    print(f"{args.run_dir}: {len(damaged)} damaged shard(s); the report leaves out what of them could not be read",
          file=sys.stderr)
    for shard, why in sorted(damaged.items())[:MAX_LINES]:
        print(f"  DAMAGED shards/{plan.run.shard_file(shard).name}: {why}", file=sys.stderr)
    if len(damaged) > MAX_LINES:
        print(f"  ... and {len(damaged) - MAX_LINES} more (listed in {out})", file=sys.stderr)
    print(f"To repair: {REPAIR_HINT.format(root=args.run_dir)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    run_program(main, "jobs.report")
