"""Prompts in and planning: the prompt file's readers, the plan (shards, seeds, keys) and its scans.

read.py (``PromptSource``, ``PromptRow``, what the readers share), formats.py (the prompt formats' registry;
one module each: txt.py, jsonl.py, table.py for csv and tsv, parquet.py), plan.py (the plan:
``build_plan``, ``load_plan``, ``Plan.rows``), planscan.py (the planning scans, the shard digests, reading
a shard's rows back), truncation.py (prompts longer than the text encoder's window), rowsettings.py (per-row generation settings,
``prompts.row_settings``), samplejson.py (the
keys shardgen reserves in a sample's json). Imports only the rundir room.
"""

from typing import TYPE_CHECKING

from shardgen.dataio import lazy_names

if TYPE_CHECKING:
    from .plan import Plan, PlannedRow, build_plan, estimate_rows, file_sha256, idle_warning, load_plan, sample_seed
    from .formats import PromptFormat, prompt_format, prompt_formats, register_format
    from .read import (DEFAULT_SEED_FIELD, MAX_PROMPT_CHARS, MAX_SEED, PromptSource, check_prompt_source, detect_format,
                       prompt_file_path)
    from .rowsettings import (MAX_SIDE, ROW_SETTINGS, RowRules, Shape, count_shapes, rules_from_cfg, shape_label,
                              shape_legend, unknown_names)
    from .truncation import TruncationCheck, checks_while_planning, planning_windows

__all__ = ["DEFAULT_SEED_FIELD", "MAX_PROMPT_CHARS", "MAX_SEED", "MAX_SIDE", "Plan", "PlannedRow", "PromptFormat", "PromptSource",
           "ROW_SETTINGS", "RowRules", "Shape", "TruncationCheck", "build_plan", "check_prompt_source", "checks_while_planning", "count_shapes",
           "detect_format", "estimate_rows", "file_sha256", "idle_warning", "load_plan", "planning_windows",
           "prompt_file_path", "prompt_format", "prompt_formats", "register_format", "rules_from_cfg", "sample_seed",
           "shape_label", "shape_legend", "unknown_names"]
__getattr__ = lazy_names(__name__, __all__)  # each name imported from its module on first use
