"""Prompt formats, one registry: each format (txt.py, jsonl.py, table.py for csv and tsv, parquet.py) is a module
registering a ``PromptFormat``: its name and extensions, its reader, how a shard's rows are read back, and what
planning asks of it (whether its rows are lines of the file, whether a header line precedes them, whether its rows
can be counted without reading them). read.py, plan.py and planscan.py ask the format, never its name, so a new
format is one module (listed in ``BUILTIN``, or registered by its own import) plus a YAML in conf/prompts/.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

# imported when a format is first looked up (each registers itself)
BUILTIN = ("shardgen.dataio.prompts.txt", "shardgen.dataio.prompts.jsonl", "shardgen.dataio.prompts.table",
           "shardgen.dataio.prompts.parquet")


@dataclass(frozen=True)
class PromptFormat:
    """One prompt format (``prompts.format``) as the readers and the planner see it."""

    name: str
    extensions: tuple[str, ...]
    """File extensions (lowercase, with the dot) that ``prompts.format=auto`` reads as this format."""
    read: Callable[[Any], Iterator[Any]]
    """``read(request)`` (a read.ReadRequest): every ``PromptRow`` of the file, in order (bad rows raise or become
    rejects per ``on_bad_row``)."""
    rows_at: Callable[[Any, BinaryIO | None, int, int, int, int, bytes | None], Iterator[Any]]
    """``rows_at(src, data, offset, line, index, count, head)``: ``count`` rows from row ``index`` starting at byte
    ``offset`` (a row number for formats without lines) and ``line``, read from ``data`` (positioned there; None for
    formats without lines); ``head``: the file's bytes before its first row, when the shard's bytes were read."""
    check: Callable[[str, str], None] = lambda path, field: None
    """A cheap check before planning, ``check(path, field)``: the header names ``field`` (PromptFileError)."""
    fields: bool = True
    """Rows have named fields (a row can set its own settings: prompts.row_settings)."""
    header: bool = False
    """A header line precedes the rows; every shard's digest covers it (csv, tsv)."""
    lines: bool = True
    """Rows are lines of the file: planned as byte offsets, hashed as bytes, extended by appending. False: rows are
    numbered (parquet): planned from the rows read, hashed row by row, never appended to."""
    count_rows: Callable[[str], int] | None = None
    """The number of rows without reading them (parquet's footer); None: counted from the lines."""
    scan: Callable[..., Any] | None = None
    """A planning scan of its own (txt's block scan), called as planscan.scan_rows is; None: rows through ``read``."""


_REGISTRY: dict[str, PromptFormat] = {}


def register_format(fmt: PromptFormat) -> PromptFormat:
    """Add (or replace) a prompt format under its name; returns it."""
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a prompt format (a test's toy one)."""
    _REGISTRY.pop(name, None)


def prompt_formats() -> dict[str, PromptFormat]:
    """Every registered format by name: the built-in ones in ``BUILTIN``'s order (whichever module was imported
    first), then the others in the order they were registered."""
    for module in BUILTIN:
        importlib.import_module(module)
    rank = {module: i for i, module in enumerate(BUILTIN)}
    ordered = sorted(_REGISTRY.values(), key=lambda f: rank.get(f.read.__module__, len(BUILTIN)))  # stable
    return {f.name: f for f in ordered}


def prompt_format(name: str) -> PromptFormat:
    """The format called ``name`` (a KeyError when none is: ``detect_format`` has refused unknown names)."""
    return prompt_formats()[name]
