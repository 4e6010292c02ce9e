"""The command line every operator tool of jobs/ starts from: its parser (the description and the run directory
argument), the run's plan loaded for it, and what can go wrong said in one line with exit status 2
(``tool_errors``), so that a tool's module holds only its own options and what it does.

    def main(argv=None) -> int:
        ap = tool_parser("python -m jobs.report", __doc__)
        ap.add_argument("--out", default=None, help="...")
        return run_tool(ap, argv, report)          # report(args, plan) -> exit status
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from shardgen.dataio.resume import plan_for_tool
from shardgen.dataio.rundir import run_dir_arg
from shardgen.tools.runfiles import tool_errors

NO_PLAN = "not a shardgen run directory (no plan/plan.json)"


def tool_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A tool's parser: ``doc`` (its module docstring) as the description, and the run directory argument."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    return ap


def run_tool(parser: argparse.ArgumentParser, argv: list[str] | None, body: Callable[..., int], *,
             plan: str | None = NO_PLAN, check: Callable[[Any], None] | None = None) -> int:
    """Parse ``argv``, run ``check(args)`` (refusals that need no file), load the run's plan (``plan``: the line
    when it has none; None: the tool reads no plan) and return ``body(args, plan)`` (``body(args)`` without a plan).
    A user error, a damaged or missing plan, an OS error: one line on stderr, exit status 2."""

    @tool_errors
    def main() -> int:
        args = parser.parse_args(argv)
        if check is not None:
            check(args)
        if plan is None:
            return body(args)
        return body(args, plan_for_tool(args.run_dir, plan))

    return main()
