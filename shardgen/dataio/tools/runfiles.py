"""The operator tools' access to a run directory: one reader per kind of run file, each returning typed
records or raising RunDirError naming the file; one ``safe_write`` for every file a tool writes; and
``tool_errors``, which turns what a user or a damaged file can cause into one line and exit status 2.

A run directory is untrusted input (see shardgen/dataio/rundir/layout.py): any file may be missing, empty,
garbage, truncated, from another version or a symlink. Logs (``logs/events.*.jsonl``, ``launches.jsonl``)
are history: an odd line is skipped. Files the answer depends on (the plan, a shard's index or tar) are
refused naming the file and the fix.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

from shardgen.dataio.rundir.layout import RunDir, RunDirError, atomic_write_bytes
from shardgen.errors import UserError

REPAIR_HINT = "python -m jobs.verify {root} --repair, then re-run the generate command"
NUMBER = (int, float)


def tool_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a tool's ``main``: a user error or an OS error (a read-only or missing directory, a permission)
    is printed as one line on stderr and the tool returns 2, never a traceback."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2

    return wrapped


def count_arg(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (an argument error otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def safe_write(path: Path, data: bytes) -> None:
    """Write a tool's output file whole (temp file + rename: a symlink at ``path`` is replaced, never followed);
    RunDirError naming the path when it cannot be written (a read-only or missing directory, a directory there)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise RunDirError(f"{path} is a directory; give a file name")
    try:
        atomic_write_bytes(path, data)
    except UserError:
        raise
    except OSError as e:
        raise RunDirError(f"cannot write {path} ({e.strerror or e}); choose another --out or a writable "
                          "directory") from None


def read_records(paths: Iterable[Path], fields: dict[str, type | tuple]) -> list[dict]:
    """The records of JSON-lines log files that have ``fields`` of those types; other lines (torn by a kill,
    not UTF-8, not an object, other types) and unreadable files are skipped: logs are history, not state."""
    out = []
    for path in paths:
        path = Path(path)
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8", "replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line, parse_constant=_no_constant)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict) and all(_typed(rec.get(k), t) for k, t in fields.items()):
                out.append(rec)
    return out


def _no_constant(name: str):
    raise ValueError(name)


def _typed(value: Any, typ: type | tuple) -> bool:
    return isinstance(value, typ) and not isinstance(value, bool) or (typ is bool and isinstance(value, bool))


def read_events(run: RunDir) -> list[dict]:
    """The shard commit events (``logs/events.*.jsonl``) with a time, a replica and a sample count."""
    return read_records(run.events_paths(), {"t": NUMBER, "replica": (int, str), "samples": int})


def read_launches(run: RunDir) -> list[dict]:
    """Every launch's summary (``launches.jsonl``); fields other than ``ended`` may be absent or odd."""
    return read_records([run.launches_path], {"ended": NUMBER})


def read_index_columns(run: RunDir, columns: list[str], where: str | None = None) -> dict[str, list]:
    """The committed index's ``columns`` over every shard, as lists (``where``: only rows where that column is
    set); RunDirError naming a damaged shards/*.parquet and the fix."""
    import pyarrow.parquet as pq

    out: dict[str, list] = {c: [] for c in columns}
    for path in sorted(run.shards_dir.glob("*.parquet")) if run.shards_dir.is_dir() else []:
        if path.is_symlink():
            continue
        try:
            table = pq.read_table(path, columns=columns)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, KeyError...: all mean a damaged file
            raise RunDirError(f"{path} is damaged ({type(e).__name__}: {str(e)[:200]}); "
                              + REPAIR_HINT.format(root=run.root)) from None
        cols = {c: table.column(c).to_pylist() for c in columns}
        keep = range(table.num_rows) if where is None else [i for i, v in enumerate(cols[where]) if v is not None]
        for c in columns:
            out[c] += [cols[c][i] for i in keep]
    return out


def read_tar_members(path: Path) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes} of a committed tar; RunDirError naming it when it is not a readable tar."""
    from shardgen.dataio.tools.verify import read_shard_members

    path = Path(path)
    if path.is_symlink():
        raise RunDirError(f"{path} is a symlink; run files must be regular files. {REPAIR_HINT.format(root=path.parent.parent)}")
    try:
        return read_shard_members(path)
    except Exception as e:  # tarfile.ReadError, EOFError, ValueError (a member twice), OSError...
        raise RunDirError(f"{path} is damaged ({type(e).__name__}: {str(e)[:200]}); "
                          + REPAIR_HINT.format(root=path.parent.parent)) from None


def committed_members(run: RunDir) -> Iterable[tuple[str, dict[str, bytes]]]:
    """(key, members) of every readable committed tar in shard order; damaged tars are skipped (jobs.verify
    names them): for the tools that only show samples (preview, the report's contact sheet)."""
    for tar in sorted(run.shards_dir.glob("*.tar")) if run.shards_dir.is_dir() else []:
        try:
            members = read_tar_members(tar)
        except RunDirError:
            continue
        yield from sorted(members.items())
