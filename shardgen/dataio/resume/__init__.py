"""A run across launches: its fingerprint, the ledger of what is done, repair of what a killed job
left, and extending the plan when prompts were appended.

fingerprint.py, ledger.py, repair.py, extend.py. They read the plan and the shards, so this room sits
above prompts and shards; it imports nothing from tools.
"""

from typing import TYPE_CHECKING

from shardgen.dataio import lazy_names

if TYPE_CHECKING:
    from .extend import extend_if_appended
    from .fingerprint import (FingerprintMismatch, check_or_write_fingerprint, check_settings_unchanged,
                              compute_fingerprint, diff_fingerprints, holds_no_samples, prompt_file_hash,
                              read_fingerprint, remember_prompt_hash, remove_dead_launch_markers, run_settings,
                              start_generating, stop_generating)
    from .ledger import read_ledger, read_status_ledger, run_lease_s
    from .repair import (checked_rows, load_plan_checked, load_plan_or_discard, plan_for_tool, read_shard_stats,
                         record_plan_digests, repair_run_dir)

__all__ = ["FingerprintMismatch", "check_or_write_fingerprint", "check_settings_unchanged", "checked_rows",
           "compute_fingerprint", "diff_fingerprints", "extend_if_appended", "holds_no_samples", "load_plan_checked",
           "load_plan_or_discard", "plan_for_tool", "prompt_file_hash", "read_fingerprint", "read_ledger",
           "read_shard_stats", "read_status_ledger", "record_plan_digests", "remember_prompt_hash",
           "remove_dead_launch_markers", "repair_run_dir",
           "run_lease_s", "run_settings", "start_generating", "stop_generating"]
__getattr__ = lazy_names(__name__, __all__)  # each name imported from its module on first use
