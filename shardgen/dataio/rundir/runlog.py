"""Run history kept in the run directory: per-rank log files, shard commit events, launches.

- ``logs/rank<R>.log``: every shardgen log line of global rank R, all launches appended (datatrove
  keeps a log per task; here a rank of a requeued job continues its file).
- ``logs/events.<host>.<pid>.jsonl``: one line per committed shard (time, replica, shard,
  samples, wall_s): the report's throughput over time per replica. One file per writer process,
  so no two processes append to the same file.
- ``launches.jsonl``: the summary of every launch, appended; ``summary.json`` stays the last one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from shardgen.dataio.rundir.fileio import append_line, open_append, read_regular
from shardgen.dataio.rundir.layout import RunDir, is_run_dir
from shardgen.dataio.rundir.liveness import host_name
from shardgen.dataio.rundir.remote import redact_urls

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# control characters (C0 but newline and tab, DEL, C1) and the bidirectional overrides that reorder a line on screen
_TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escape_terminal(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``): a run directory on shared storage is
    someone else's input, and an escape sequence from a log line or a claim would retitle or clear the terminal."""
    return _TERMINAL_UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                else f"\\u{ord(m.group()):04x}", text)


class EscapeControl(logging.Filter):
    """A handler's filter that shows a line's control characters as escapes (``escape_terminal``): a launch's lines
    quote run files (a claim's holder, attention.json's why), and a terminal would obey an escape sequence in them."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        safe = escape_terminal(text)
        if safe != text:
            record.msg, record.args = safe, None
        return True


def escape_log_lines() -> None:
    """Put ``EscapeControl`` on every handler of the root and "shardgen" loggers (the console's, the rank log's)."""
    for logger in (logging.getLogger(), logging.getLogger("shardgen")):
        for handler in logger.handlers:
            if not any(isinstance(f, EscapeControl) for f in handler.filters):
                handler.addFilter(EscapeControl())


class PublicFormatter(logging.Formatter):
    """Log lines as written into a run: every URL without its credentials or query values (``redact_urls``)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_urls(super().format(record))


MAX_HELD_LINES = 10_000  # lines kept in memory until the run directory is accepted (the oldest go first)


class RankLogHandler(logging.FileHandler):
    """A rank's log file. Lines are held in memory until ``start_writing()`` (the run directory was checked and
    planned), then written: a launch refused before that (a foreign run_dir, a bad prompt row) writes nothing."""

    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8", delay=True)
        self._held: list[logging.LogRecord] | None = []

    def emit(self, record: logging.LogRecord) -> None:
        if self._held is None:
            super().emit(record)
            return
        self._held.append(record)
        del self._held[:-MAX_HELD_LINES]

    @property
    def holding(self) -> bool:
        """Whether lines are still held (``start_writing`` not called yet)."""
        return self._held is not None

    def start_writing(self) -> None:
        """Write the held lines, and every later one as it comes."""
        held, self._held = self._held or [], None
        for record in held:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """A line the log file cannot take (a full disk, a read-only run directory): one line on stderr, the first
        time, instead of logging's traceback for every record (the console still gets them all)."""
        if not getattr(self, "_warned", False):
            self._warned = True
            error = sys.exc_info()[1]
            print(f"shardgen: cannot write {self.baseFilename} ({error}); its lines go to the console only",
                  file=sys.stderr)

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return os.fdopen(open_append(self.baseFilename), "a", encoding=self.encoding or "utf-8", errors=self.errors)


def attach_rank_log(run_dir: str | os.PathLike, rank: int) -> RankLogHandler:
    """Send the "shardgen" loggers of this process to ``logs/rank<R>.log`` too (held until ``start_writing()``);
    returns the handler."""
    path = RunDir.at(run_dir).rank_log_path(rank)
    handler = RankLogHandler(path)
    handler.setFormatter(PublicFormatter(_FORMAT))
    handler.setLevel(logging.INFO)
    logger = logging.getLogger("shardgen")
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


def log_to_file_only(handler: logging.Handler, error: BaseException) -> None:
    """Write the error that ends a rank into its log file only (the console gets it from the entry point),
    so the run directory keeps why each launch stopped (jobs.status shows the last one)."""
    logs = Path(handler.baseFilename).parent
    if not logs.is_dir() or logs.is_symlink():  # a launch refused before the run had logs (or for a linked logs/)
        return
    if isinstance(handler, RankLogHandler) and handler.holding:  # stopped before the run directory was accepted
        if not is_run_dir(Path(handler.baseFilename).parent.parent):
            return  # not a shardgen run (a foreign directory with a logs/ of its own): nothing is written into it
        handler.start_writing()  # an existing run refused this launch (a changed prompt file...): say why in it
    handler.handle(logging.LogRecord("shardgen", logging.ERROR, __file__, 0, "stopped: %s: %s",
                                     (type(error).__name__, str(error).splitlines()[0] if str(error) else ""), None))


def detach_rank_log(handler: logging.Handler) -> None:
    """Stop writing the rank's log file (end of ``run_rank``)."""
    logging.getLogger("shardgen").removeHandler(handler)
    handler.close()


def _append_line(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    append_line(path, json.dumps(record, sort_keys=True))  # one write of one line, never through a symlink


def record_commit(run: RunDir, replica: int, stats: dict) -> None:
    """Note a committed shard for the report and jobs.status's rates (called on the writer after the stats are
    written): in the run's store, so that a run kept in a bucket shows every machine's commits wherever it is read
    (there a read and a conditional replace of this process's own file, which no other writer touches)."""
    record = dict(
        t=stats.get("finished", time.time()), replica=replica, shard=stats["shard"], samples=stats["count"],
        ok=stats["ok"], failed=stats["failed"], rejected=stats["rejected"], wall_s=stats.get("wall_s"),
        host=host_name(), pid=os.getpid(), job=os.environ.get("SLURM_JOB_ID"))  # which launch: replicas of two
    # launches on one run share their numbers
    path = run.events_path(host_name(), os.getpid())
    if run.store:
        run.files.append(path, json.dumps(record, sort_keys=True))
    else:
        _append_line(path, record)


def record_launch(run: RunDir, summary: dict) -> None:
    """Append this launch's summary to ``launches.jsonl`` (in the run's store)."""
    if not run.store:
        run.root.mkdir(parents=True, exist_ok=True)
    run.files.append(run.launches_path, json.dumps(dict(summary, ended=time.time()), sort_keys=True))


def read_jsonl(paths) -> list[dict]:
    """The records of JSON-lines files (a torn last line, from a kill, is skipped)."""
    return [rec for path in paths for rec in parse_jsonl(read_regular(path))]  # bounded, never a FIFO or a device


def read_run_jsonl(run: RunDir, path: Path) -> list[dict]:
    """The records of the run's JSON-lines file at ``path`` (``read_jsonl``), from the run's store; [] when it
    does not exist."""
    return parse_jsonl(run.files.read(path) or b"")


def parse_jsonl(data: bytes) -> list[dict]:
    """The records of JSON lines (a torn last line, from a kill, is skipped)."""
    out = []
    for line in data.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out
