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
import contextlib
import fnmatch
import functools
import json
import os
import stat
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from shardgen.dataio.rundir.fileio import atomic_write_bytes, open_regular, read_regular
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.runlog import escape_terminal
from shardgen.dataio.rundir.storage import RunDirError, storage_error
from shardgen.errors import UserError

REPAIR_HINT = "python -m jobs.verify {root} --repair, then re-run the generate command"
NUMBER = (int, float)


class _EscapingStream:
    """A text stream that escapes control characters (``escape_terminal``) in everything written to it."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(escape_terminal(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def terminal_safe_output() -> Iterator[None]:
    """Within the block, what is printed on stdout and stderr has its control characters escaped."""
    out, err = sys.stdout, sys.stderr
    # a stream closed when the process started is None: print() then writes nothing, as it would unwrapped
    sys.stdout, sys.stderr = (None if s is None else _EscapingStream(s) for s in (out, err))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


def tool_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a tool's ``main``: a user error or an OS error (a read-only or missing directory, a permission)
    is printed as one line on stderr and the tool returns 2, never a traceback. Everything the tool prints has its
    control characters escaped (``escape_terminal``): what it shows comes from the run directory."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> int:
        try:
            with terminal_safe_output():
                try:
                    return main(*args, **kwargs)
                except UserError as e:
                    print(f"error: {e}", file=sys.stderr)
                except BrokenPipeError:
                    raise
                except Exception as e:
                    if full := storage_error(e):  # a full disk, also where a library raised it wrapped
                        print(f"error: {full}", file=sys.stderr)
                    elif isinstance(e, OSError):
                        where = f"{e.filename}: " if e.filename else ""
                        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
                    else:
                        raise
                return 2
        except BrokenPipeError:  # the reader stopped reading (`| head`): stop quietly, as Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
            return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the closed pipe

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


def _real(path: Path) -> str:
    """``path`` with its directory resolved and its last name kept (a link there is replaced, not followed)."""
    path = Path(os.path.abspath(path))
    return os.path.join(os.path.realpath(path.parent), path.name)


def check_tool_output(path: Path, run: RunDir) -> None:
    """RunDirError when ``path`` is inside ``run``'s directory and not one of the tools' own outputs
    (``RunDir.tool_outputs``): a tool's --out never replaces a shard, the plan or any other run file."""
    out, root = _real(path), os.path.realpath(run.root)
    if os.path.commonpath([out, root]) != root:
        return
    if out in {_real(p) for p in run.tool_outputs}:
        return
    names = ", ".join(p.name for p in run.tool_outputs)
    raise RunDirError(f"--out {path} is inside the run directory {run.root}, whose files are the run's own (only "
                      f"{names} there are tools' outputs); choose a path outside it")


def refuse_foreign_out(out: Path, own: Path, marker: bytes, tool: str) -> None:
    """RunDirError when ``out`` exists and is not a file ``tool`` wrote (its first 4 KiB hold ``marker``): a user's
    file, a symlink, a FIFO is never replaced by a tool's output unasked (--force replaces it). The run's own output
    ``own``, a new path and a directory (``safe_write`` refuses it) pass. Reads at most the head, without following a
    link or blocking on a FIFO."""
    out = Path(out)
    if Path(os.path.abspath(out)) == Path(os.path.abspath(own)):
        return  # the run's own output (check_tool_output): replaced whatever is there
    try:
        mode = out.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        return
    what = "a symlink" if stat.S_ISLNK(mode) else "not a regular file" if not stat.S_ISREG(mode) else None
    if what is None:
        with open_regular(out, follow=False) as f:
            if marker in f.read(4096):
                return  # this tool's earlier output: replaced, as a re-run is expected to
        what = f"not a file {tool} wrote"
    raise RunDirError(f"--out {out} exists and is {what}; it is left as it is. Choose another path, or add --force "
                      "to replace it")


def safe_write(path: Path, data: bytes | Iterable[bytes], run: RunDir) -> None:
    """Write a tool's output file whole (bytes, or chunks written as they come; temp file + rename: a symlink at
    ``path`` is replaced, never followed);
    RunDirError naming the path when it is one of ``run``'s own files (``check_tool_output``) or cannot be written
    (a read-only or missing directory, a directory there)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise RunDirError(f"{path} is a directory; give a file name")
    check_tool_output(path, run)
    if run.store and path.parent == run.root:  # a bucket run's folder on this machine: none yet on a fresh one
        run.root.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write_bytes(path, data)
    except UserError:
        raise
    except OSError as e:
        raise RunDirError(f"cannot write {path} ({e.strerror or e}); choose another --out or a writable "
                          "directory") from None


def share_output(run: RunDir, out: Path) -> str:
    """Where a tool's output file ``out`` (just written) is, for the tool's "wrote ..." line. For a run kept in a
    bucket, the run's own output (``RunDir.tool_outputs``, the default --out) is also put in the bucket beside the
    run's files, so that every machine of the run finds it where one finds it in a run directory:
    "URL (and on this machine: PATH)"; any other ``out`` is only its path."""
    if not run.store or _real(out) not in {_real(p) for p in run.tool_outputs}:
        return str(out)
    from shardgen.dataio.rundir.remote import call, filesystem, retrying

    url = run.files.where(out)
    fs, key = filesystem(url)
    if out.is_symlink() or not out.is_file():  # the tool has just written it whole (safe_write): never a link's target
        raise RunDirError(f"{out} is not a regular file (replaced since it was written?); run the tool again")
    size = out.stat().st_size  # streamed from the file: a whole run's compare_samples.jsonl can pass 1 GiB
    retrying(f"uploading {out.name}", url, lambda: call(fs, "put_file", str(out), key, size=size))
    return f"{url} (and on this machine: {out})"


def read_records(paths: Iterable[Path], fields: dict[str, type | tuple]) -> list[dict]:
    """The records of JSON-lines log files that have ``fields`` of those types; other lines (torn by a kill,
    not UTF-8, not an object, other types) and unreadable files are skipped: logs are history, not state."""
    out = []
    for path in paths:
        path = Path(path)
        if path.is_symlink() or not path.is_file():
            continue
        try:
            data = read_regular(path, follow=False)
        except OSError:
            continue
        out += parse_records(data, fields)
    return out


def parse_records(data: bytes, fields: dict[str, type | tuple]) -> list[dict]:
    """The JSON lines of ``data`` that are objects with ``fields`` of those types (``read_records``)."""
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
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
    """The shard commit events (``logs/events.*.jsonl``, in the run's store) with a time, a replica and a sample
    count."""
    fields = {"t": NUMBER, "replica": (int, str), "samples": int}
    if not run.store:
        return read_records(run.events_paths(), fields)
    records = []
    for name in sorted(run.files.names(run.logs_dir)):
        if fnmatch.fnmatch(name, run.EVENTS_GLOB):
            try:
                records += parse_records(run.files.read(run.logs_dir / name) or b"", fields)
            except OSError:  # unreadable: history, not state (``read_records``)
                continue
    return records


def launch_of(who: dict) -> tuple:
    """Which launch a commit event or a claim's holder comes from: (host, pid, SLURM job). Replica numbers start at
    0 in every launch, so a replica is named by its number and its launch together."""
    return who.get("host"), who.get("pid"), who.get("job")


def launch_label(host: Any, pid: Any, job: Any) -> str | None:
    """``on HOST pid PID job JOB`` (what is known of it), None when nothing is."""
    text = " ".join(f"{k} {v}" for k, v in (("on", host), ("pid", pid), ("job", job)) if v not in (None, ""))
    return text or None


def read_launches(run: RunDir) -> list[dict]:
    """Every launch's summary (``launches.jsonl``); fields other than ``ended`` may be absent or odd."""
    fields = {"ended": NUMBER}
    if not run.store:
        return read_records([run.launches_path], fields)
    try:
        return parse_records(run.files.read(run.launches_path) or b"", fields)
    except OSError:  # unreadable: history, not state (``read_records``)
        return []


def read_index_columns(run: RunDir, columns: list[str], where: str | None = None) -> dict[str, list]:
    """The committed index's ``columns`` over every shard, as lists (``where``: only rows where that column is
    set); the index of a shard whose local files were deleted once uploaded (keep_local=false) is read from the
    bucket. RunDirError naming a damaged index and the fix."""
    from shardgen.dataio.shards.index import index_path, read_index_table

    out: dict[str, list] = {c: [] for c in columns}
    for shard in sorted(run.listed_shards(run.shards_dir, ".parquet") | run.listed_shards(run.uploads_dir, ".json")):
        path = index_path(run, shard)
        if path.is_symlink():
            continue
        try:
            table = read_index_table(run, shard, columns)
        except UserError:  # the bucket's copy: unreachable, or not the bytes uploaded
            raise
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, KeyError...: all mean a damaged file
            raise RunDirError(f"{path} is damaged ({type(e).__name__}: {str(e)[:200]}); "
                              + REPAIR_HINT.format(root=run.name)) from None
        cols = {c: table.column(c).to_pylist() for c in columns}
        keep = range(table.num_rows) if where is None else [i for i, v in enumerate(cols[where]) if v is not None]
        for c in columns:
            out[c] += [cols[c][i] for i in keep]
    return out


def read_members_checked(path: Path, container: str = "tar") -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes} of a committed shard file in ``container``; RunDirError naming it when it is not
    readable."""
    from shardgen.dataio.shards.container import read_shard_members

    path = Path(path)
    if path.is_symlink():
        raise RunDirError(f"{path} is a symlink; run files must be regular files. {REPAIR_HINT.format(root=path.parent.parent)}")
    try:
        return read_shard_members(path, container)
    except Exception as e:  # tarfile.ReadError, EOFError, ValueError (a member twice), OSError...
        raise RunDirError(f"{path} is damaged ({type(e).__name__}: {str(e)[:200]}); "
                          + REPAIR_HINT.format(root=path.parent.parent)) from None


def committed_members(run: RunDir) -> Iterable[tuple[str, dict[str, bytes]]]:
    """(key, members) of every readable committed shard file in shard order (``committed_shard_members``): for the
    tools that only show samples (preview, the report's contact sheet)."""
    for _, key, members in committed_shard_members(run):
        yield key, members


def committed_shard_members(run: RunDir, damaged: dict[int, str] | None = None
                            ) -> Iterable[tuple[int, str, dict[str, bytes]]]:
    """(shard, key, members) of every readable committed shard file in shard order, local or (keep_local=false,
    uploaded) read back from the bucket one shard at a time as the caller asks; a damaged one is skipped (jobs.verify
    names it), and recorded in ``damaged`` (shard -> why) when the caller keeps one."""
    from shardgen.dataio.shards.container import read_shard_members
    from shardgen.dataio.shards.upload import committed_tar

    for shard in sorted(run.listed_shards(run.shards_dir, f".{run.container}") | run.listed_shards(run.uploads_dir, ".json")):
        try:
            tar = committed_tar(run, shard)
            members = (read_members_checked(tar, run.container) if isinstance(tar, Path)
                       else read_shard_members(tar, run.container))
        except (RunDirError, tarfile.TarError, EOFError, ValueError) as e:
            if damaged is not None:
                damaged.setdefault(shard, str(e))
            continue
        for key, mem in sorted(members.items()):
            yield shard, key, mem
