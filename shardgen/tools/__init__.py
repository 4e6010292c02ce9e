"""Dataset and operator tools over a finished or running run: verify, report, status, signals after
the fact, near-duplicates; runfiles.py has what the tools share (reading a run's files, their errors), entry.py
the command line every jobs/ tool starts from (its arguments, the plan, one-line errors).

Used by jobs/ (verify, report, status, signals, dedup, preview); above shardgen/dataio/, whose rooms it reads.
"""

from typing import TYPE_CHECKING

from shardgen.dataio import lazy_names

if TYPE_CHECKING:
    from .dedup import near_duplicate_groups
    from .report import write_report
    from .runfiles import (check_tool_output, committed_members, count_arg, read_index_columns, safe_write,
                           tool_errors)
    from .signals_after import add_signals, signal_functions
    from .status import run_metrics, run_status
    from .verify import read_shard_members, repair_run, verify_run

__all__ = ["add_signals", "check_tool_output", "committed_members", "count_arg", "near_duplicate_groups",
           "read_index_columns", "read_shard_members", "repair_run", "run_metrics", "run_status", "safe_write",
           "signal_functions", "tool_errors",
           "verify_run", "write_report"]
__getattr__ = lazy_names(__name__, __all__)  # each name imported from its module on first use
