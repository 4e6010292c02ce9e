"""Streaming prompt-file readers: txt, jsonl, csv, tsv and parquet files in, ``PromptRow``s out.

Text formats are read and decoded line by line from bytes, so memory stays constant in the
number of rows (files may hold 100M prompts) and every problem, a non-UTF-8 byte included,
is reported as ``<path>:<line>: <what is wrong>. <what to change>``.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator
from shardgen.dataio.prompts.rowsettings import BadSetting, RowRules
from shardgen.dataio.prompts.samplejson import split_reserved
from shardgen.dataio.rundir.remote import StorageError, identity, is_url, open_input, open_remote
from shardgen.errors import UserError
from shardgen.pick import pick

PROJECT_ROOT = Path(__file__).resolve().parents[3]
FORMATS = ("txt", "jsonl", "csv", "tsv", "parquet")
ON_BAD_ROW = ("error", "skip")
_EXTENSIONS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv",
               ".parquet": "parquet"}
BOM = b"\xef\xbb\xbf"
_MAX_SEED = 2**63 - 1  # sample_seed() promises seeds that fit 63 bits
_SEED_TEXT = re.compile(r"[0-9]{1,19}")  # csv/tsv seeds: plain digits only, so " 1", "+1", "1_0" are rejected
MAX_INT_BITS = 1023  # a row's integers stay within a float's range: every JSON reader can hold them
_PARQUET_BATCH = 4096
_SKIP_HINT = "Fix the row, or set prompts.on_bad_row=skip to record such rows as rejects and go on"
MAX_PROMPT_CHARS = 100_000  # prompts.max_prompt_chars' default: far beyond any text encoder's window
_MAX_DEPTH = 64  # nesting of a row's values; deeper is surely not a prompt row (and would blow the stack)


@dataclass(frozen=True)
class PromptRow:
    """One data row of a prompt file, good or rejected.

    ``line`` is where the row starts: the 1-based line number for txt and jsonl; for csv/tsv
    the line of the file where the record starts (the header is line 1, and a quoted csv
    field may span lines); for parquet, which has no lines, the 1-based row number
    (``index + 1``). Rejected rows (only with ``on_bad_row="skip"``) have ``prompt=None``,
    ``seed=None``, ``extra={}`` and ``reject`` set to the reason.
    """

    index: int
    line: int
    prompt: str | None
    seed: int | None = None
    extra: dict = dc_field(default_factory=dict)
    reject: str | None = None
    settings: dict = dc_field(default_factory=dict)
    """Generation settings the row sets (``prompts.row_settings``; rowsettings.py), checked and resolved."""


class PromptFileError(UserError, ValueError):
    """A prompt file that cannot be read as asked; the message names the file (and line) and the fix."""


class _BadRow(Exception):
    """Internal: the row at hand is bad; ``str(exc)`` is the reason shown to the user."""


@dataclass(frozen=True)
class PromptSource:
    """The prompt file and how to read it (``prompts.*`` of the config)."""

    path: str
    format: str = "auto"
    field: str = "prompt"
    seed_field: str = "seed"
    on_bad_row: str = "error"
    limit: int | None = None
    max_chars: int | None = None  # longer prompts are bad rows (None in plans made before the limit existed)
    row_rules: dict | None = None  # prompts.row_settings: RowRules.as_json() (None: no row sets a setting)

    @classmethod
    def from_cfg(cls, prompts: Any, path: str | os.PathLike, rules: RowRules | None = None) -> "PromptSource":
        """From a PromptsConfig and the resolved path of its file; ``rules``: how rows' settings are checked
        (None, or no names: the rows set none)."""
        fmt = detect_format(str(path), prompts.format)
        if rules is not None and rules.names and fmt == "txt":
            raise fail(str(path), 0, "prompts.row_settings needs a prompt file with fields (jsonl, csv, tsv or "
                       "parquet), and a txt line is only a prompt", "Use prompts.row_settings=[] for a txt file")
        # field, seed_field, on_bad_row, limit: the prompts.* keys of the same name (shardgen/pick.py)
        return pick(cls, prompts, path=str(path), format=fmt, max_chars=prompts.get("max_prompt_chars"),
                    row_rules=rules.as_json() if rules is not None and rules.names else None)

    @property
    def rules(self) -> RowRules | None:
        """The row settings' rules (None: the rows set none)."""
        return RowRules(**self.row_rules, base_dir=str(Path(self.path).parent)) if self.row_rules else None

    def as_json(self) -> dict:
        """For plan.json; without ``row_rules`` when there are none, so such plans stay as they were."""
        return {k: v for k, v in self.__dict__.items() if k != "row_rules" or v is not None}


def fail(path: str, line: int, what: str, fix: str) -> PromptFileError:
    """The one-line error for ``path`` (at ``line`` when not 0): what is wrong, then what to change."""
    where = f"{path}:{line}" if line else path
    return PromptFileError(f"{where}: {what}. {fix}")


# ---------------------------------------------------------------- public API

def detect_format(path: str, format: str = "auto") -> str:
    """The prompt format of ``path``: ``format`` itself unless "auto", else from the extension."""
    path = os.fspath(path)
    if format != "auto":
        if format in FORMATS:
            return format
        raise fail(path, 0, f"prompts.format={format!r} is not a known format",
                   f"Use prompts.format=auto or one of: {', '.join(FORMATS)}")
    ext = os.path.splitext(path)[1].lower()
    if ext in _EXTENSIONS:
        return _EXTENSIONS[ext]
    fix = f"Name the file {', '.join(_EXTENSIONS)}, or set prompts.format=<one of {', '.join(FORMATS)}>"
    if ext == ".json":  # the usual near miss: a .json file that is really one object per line
        fix += " (prompts.format=jsonl if it holds one JSON object per line)"
    raise fail(path, 0, f"cannot tell the prompt format from the extension {ext or '(none)'!r}", fix)


def check_prompt_source(path: str, format: str = "auto", field: str = "prompt") -> None:
    """Cheap up-front check: the file is a readable non-empty file of a known format, and for
    csv/tsv/parquet its header has the column ``field``. Raises PromptFileError otherwise."""
    path = os.fspath(path)
    _check_file(path)
    fmt = detect_format(path, format)
    if fmt == "parquet":
        _check_columns(path, parquet_file(path).schema_arrow.names, field, fmt)
    elif fmt in ("csv", "tsv"):
        with open_input(path) as f:
            _read_header(path, _table_reader(_text_lines(f, {}), fmt), fmt, field, {})


def read_prompts(path: str, *, format: str = "auto", field: str = "prompt", seed_field: str = "seed",
                 on_bad_row: str = "error", max_chars: int | None = None,
                 rules: RowRules | None = None) -> Iterator[PromptRow]:
    """Stream the rows of a prompt file, one ``PromptRow`` per data row, in file order.

    ``field`` names the prompt column (csv/tsv/parquet) or key (jsonl); ``seed_field`` an
    optional per-row seed (an integer in [0, 2**63)); other columns go to ``extra``.
    A bad row raises PromptFileError naming path and line (``on_bad_row="error"``) or is
    yielded with ``prompt=None`` and its ``reject`` reason (``"skip"``); a prompt longer than
    ``max_chars`` characters is a bad row; ``rules``: the fields read as the row's generation settings (a bad
    value is a bad row). Arguments and the file's existence are checked at call
    time; an empty file raises when iterated.
    """
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row={on_bad_row!r}: use one of {', '.join(ON_BAD_ROW)}")
    path = os.fspath(path)
    _check_file(path)
    fmt = detect_format(path, format)
    return _require_rows(path, _rows(path, fmt, field, seed_field, on_bad_row, max_chars, rules))


# ---------------------------------------------------------------- shared plumbing

def _check_file(path: str) -> None:
    if is_url(path):
        _check_remote(path)
        return
    p = Path(path)
    if not p.exists():
        raise fail(path, 0, "the prompt file does not exist",
                   f"Check prompts.path (a relative path is taken from {os.getcwd()})")
    if p.is_dir():
        raise fail(path, 0, "is a directory, not a prompt file", "Set prompts.path to a file")
    if not p.is_file():
        raise fail(path, 0, "is not a regular file", "Set prompts.path to a regular file")
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise fail(path, 0, f"cannot be read ({e.strerror})", "Check the file's permissions") from None
    if p.stat().st_size == 0:
        raise fail(path, 0, "the prompt file is empty (0 bytes)",
                   "Add prompts, or point prompts.path at the right file")


def _check_remote(url: str) -> None:
    """A remote prompt file exists and is not empty (one metadata request; StorageError naming the URL when the
    bucket, the object or the permission is missing)."""
    if identity(url)["size"] == 0:
        raise fail(url, 0, "the prompt file is empty (0 bytes)", "Add prompts, or point prompts.path at the right file")


def _require_rows(path: str, rows: Iterable[PromptRow]) -> Iterator[PromptRow]:
    n = 0
    for n, row in enumerate(rows, 1):
        yield row
    if n == 0:
        raise fail(path, 0, "the prompt file has no rows (only a header, or only a byte-order mark)",
                   "Add prompts, or point prompts.path at the right file")


def _rows(path: str, fmt: str, field: str, seed_field: str, on_bad_row: str,
          max_chars: int | None, rules: RowRules | None) -> Iterator[PromptRow]:
    if fmt == "parquet":
        yield from _read_parquet(path, field, seed_field, on_bad_row, max_chars, rules)
        return
    with open_input(path) as f:
        if fmt == "txt":
            yield from _read_txt(path, f, on_bad_row, max_chars)
        elif fmt == "jsonl":
            yield from _read_jsonl(path, f, field, seed_field, on_bad_row, max_chars, rules)
        else:
            yield from read_table(path, f, fmt, field, seed_field, on_bad_row, max_chars, rules)


def too_long(n: int, max_chars: int) -> str:
    """The reason of a prompt over the length limit."""
    return f"the prompt is {n} characters long, over prompts.max_prompt_chars={max_chars}"


def emit(path: str, index: int, line: int, on_bad_row: str, parse: Callable, *args: Any,
         max_chars: int | None = None) -> PromptRow:
    """The row ``parse(*args)`` makes, or, when it raises _BadRow (or the prompt is longer than ``max_chars``:
    checked before anything tokenizes it), an error or a reject."""
    try:
        prompt, seed, extra, *settings = parse(*args)  # readers of rows with fields add the row's settings
        if max_chars is not None and len(prompt) > max_chars:
            raise _BadRow(too_long(len(prompt), max_chars))
        negative = settings[0].get("negative_prompt") if settings else None
        if max_chars is not None and negative is not None and len(negative) > max_chars:  # tokenized like the prompt
            raise _BadRow(too_long(len(negative), max_chars).replace("the prompt", "the negative_prompt", 1))
    except (_BadRow, BadSetting) as e:
        if on_bad_row == "error":
            raise fail(path, line, str(e), _SKIP_HINT) from None
        return PromptRow(index, line, None, None, {}, str(e))
    return PromptRow(index, line, prompt, seed, extra, None, settings[0] if settings else {})


LINE_SLACK = 1 << 20  # a row's bytes beyond its prompt's: other fields, quoting


def max_line_bytes(max_chars: int | None) -> int:
    """The longest line a row with a prompt of ``max_chars`` characters can need (12 bytes a character: a JSON
    escaped surrogate pair), with room for other fields; a longer line is a bad row, skipped unread."""
    return 12 * (max_chars or MAX_PROMPT_CHARS) + LINE_SLACK


class LongLine(bytes):
    """A line longer than ``max_line_bytes``, in place of its bytes: they are skipped, never held in memory."""

    size: int
    limit: int

    def __bool__(self) -> bool:  # a line, though its bytes are not kept: not the end of the file
        return True

    def reason(self) -> str:
        return (f"the line is {self.size} bytes long, over prompts.max_prompt_chars={(self.limit - LINE_SLACK) // 12} "
                f"(a row of at most {self.limit} bytes)")


def read_line(f: BinaryIO, max_bytes: int) -> bytes:
    """The next line of ``f`` (b"" at its end), or a LongLine when it holds more than ``max_bytes``: memory stays
    bounded whatever the file (a file that lost its newlines is one line of gigabytes)."""
    raw = f.readline(max_bytes + 1)
    if len(raw) <= max_bytes or raw.endswith(b"\n"):
        return raw
    size = len(raw)
    while chunk := f.readline(1 << 20):
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
    long = LongLine()
    long.size, long.limit = size, max_bytes
    return long


def _lines(f: BinaryIO | Iterable[bytes], max_bytes: int | None) -> Iterator[bytes]:
    if max_bytes is None or not hasattr(f, "readline"):
        yield from f
        return
    while raw := read_line(f, max_bytes):
        yield raw


def raw_lines(f: BinaryIO | Iterable[bytes], max_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes with terminator); a leading UTF-8 BOM is removed; a line over
    ``max_bytes`` comes as a LongLine."""
    for lineno, raw in enumerate(_lines(f, max_bytes), 1):
        if lineno == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
            if not raw:  # the file is only a BOM: no rows at all
                return
        yield lineno, raw


def _decode(raw: bytes) -> str:
    if isinstance(raw, LongLine):
        raise _BadRow(raw.reason())
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadRow(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line; "
                      "is the file saved as UTF-8?)") from None


def strip_eol(raw: bytes) -> bytes:
    """``raw`` without its line terminator (\\n or \\r\\n)."""
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw


def _check_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise _BadRow(f"the prompt is not a string (got {_json_type(prompt)})")
    if not prompt.strip():
        raise _BadRow("empty prompt" if not prompt else "the prompt is only whitespace")
    return prompt


def _seed_value(value: Any, seed_field: str) -> int | None:
    """A jsonl/parquet seed: null means none; else an int (bool excluded) in [0, 2**63)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SEED:
        raise _BadRow(f"{seed_field}={value!r} is not a seed (an integer from 0 to 2**63-1)")
    return value


def _seed_text(text: str, seed_field: str) -> int | None:
    """A csv/tsv seed cell: empty means none (csv has no null)."""
    if text == "":
        return None
    if not _SEED_TEXT.fullmatch(text):
        raise _BadRow(f"{seed_field}={text[:40]!r} is not a seed (an integer from 0 to 2**63-1)")
    return _seed_value(int(text), seed_field)


def _json_type(value: Any) -> str:
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
             list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _check_columns(path: str, columns: list[str], field: str, fmt: str) -> None:
    dup = next((c for i, c in enumerate(columns) if c in columns[:i]), None)
    if dup is not None:
        raise fail(path, 1, f"the header has the column {dup!r} twice", "Give every column a distinct name")
    if field in columns:
        return
    fix = "Set prompts.field=<one of them>"
    close = [c for c in columns if c.lower() == field.lower()]
    if close:
        fix += f", e.g. prompts.field={close[0]}"
    if len(columns) == 1 and fmt != "tsv" and "\t" in columns[0]:
        fix += "; the header looks tab-separated: set prompts.format=tsv"
    if len(columns) == 1 and fmt == "tsv" and "," in columns[0]:
        fix += "; the header looks comma-separated: set prompts.format=csv"
    raise fail(path, 1, f"no column {field!r} (prompts.field); the columns are {columns}", fix)


# ---------------------------------------------------------------- txt and jsonl

def _read_txt(path: str, f: BinaryIO, on_bad_row: str, max_chars: int | None = None) -> Iterator[PromptRow]:
    for index, (line, raw) in enumerate(raw_lines(f, max_line_bytes(max_chars))):
        yield emit(path, index, line, on_bad_row, parse_txt, raw, max_chars=max_chars)


def parse_txt(raw: bytes) -> tuple[str, None, dict]:
    """One txt line (terminator included) as (prompt, no seed, no fields); raises _BadRow."""
    # Only the terminator goes: the prompt must equal the file's text byte for byte.
    return _check_prompt(_decode(strip_eol(raw))), None, {}


def _read_jsonl(path: str, f: BinaryIO, field: str, seed_field: str, on_bad_row: str,
                max_chars: int | None = None, rules: RowRules | None = None) -> Iterator[PromptRow]:
    for index, (line, raw) in enumerate(raw_lines(f, max_line_bytes(max_chars))):
        yield emit(path, index, line, on_bad_row, parse_jsonl, raw, field, seed_field, rules, max_chars=max_chars)


def parse_jsonl(raw: bytes, field: str, seed_field: str,
                rules: RowRules | None = None) -> tuple[str, int | None, dict, dict]:
    """One jsonl line as (prompt, seed, the other fields, its settings); raises _BadRow or BadSetting."""
    text = _decode(raw)
    if not text.strip():
        raise _BadRow("blank line (every jsonl line must be one JSON object)")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise _BadRow(f"malformed JSON ({e.msg} at column {e.colno})") from None
    except ValueError:  # Python's limit on the digits of an integer it converts (4300)
        raise _BadRow("a number with thousands of digits: too large for any JSON reader (write it as a string)") \
            from None
    except RecursionError:
        raise _BadRow(f"JSON nested too deeply (more than {_MAX_DEPTH} levels)") from None
    if not isinstance(obj, dict):
        raise _BadRow(f"not a JSON object (got {_json_type(obj)})")
    _check_values(obj)
    return _parse_record(obj, field, seed_field, rules)


def _no_constant(name: str):
    raise _BadRow(f"{name} is not standard JSON (use null, or a number)")


def _check_values(obj: Any) -> None:
    """Every string of the row is valid Unicode (no lone surrogates such as "\\ud800") and nesting stays
    within _MAX_DEPTH, so the row can be written as standard UTF-8 JSON later; iterative, never recursing."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise _BadRow(f"JSON nested too deeply (more than {_MAX_DEPTH} levels)")
        if isinstance(value, dict):
            stack += [(k, depth) for k in value] + [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise _BadRow(f"invalid Unicode: a lone surrogate \\u{ord(value[e.start]):04x} in {value[:40]!r}") \
                    from None
        elif isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            raise _BadRow(f"{value} is not a JSON number (standard JSON has no NaN or Infinity)")
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise _BadRow(f"an integer of {value.bit_length()} bits is beyond a number's range (about 1.8e308, "
                          f"{MAX_INT_BITS} bits): write it as a string")


def _parse_record(rec: dict, field: str, seed_field: str,
                  rules: RowRules | None = None) -> tuple[str, int | None, dict, dict]:
    """A jsonl object or parquet row: the prompt, the seed, the rest as extra, the row's settings."""
    if field not in rec:
        raise _BadRow(f"no field {field!r} (prompts.field); the fields are {list(rec)}")
    extra = dict(rec)
    prompt = _check_prompt(extra.pop(field))
    seed = _seed_value(extra.pop(seed_field, None), seed_field)
    settings = rules.parse(extra) if rules else {}
    return prompt, seed, split_reserved(extra), settings


# ---------------------------------------------------------------- csv and tsv

def _text_lines(f: BinaryIO, bad: dict[int, str], max_bytes: int | None = None) -> Iterator[str]:
    """Decoded lines for the csv module, one per physical line so its ``line_num`` is the
    file's line number; a line that is not UTF-8 is passed on replaced and noted in ``bad``,
    because the csv module's iterator protocol has no way to reject a single line."""
    for lineno, raw in raw_lines(f, max_bytes):
        try:
            yield _decode(raw)
        except _BadRow as e:
            bad[lineno] = str(e)
            yield "\n" if isinstance(raw, LongLine) else raw.decode("utf-8", "replace")


def _table_reader(lines: Iterator[str], fmt: str):
    if fmt == "tsv":  # no quoting at all: quotes inside prompts (e.g. PartiPrompts' "PEACE") stay literal
        return csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE, strict=True)
    # strict: malformed quoting is a bad row rather than silently altered text
    return csv.reader(lines, strict=True)


def _pop_bad(bad: dict[int, str], start: int, last: int) -> str | None:
    """The first non-UTF-8 reason among the record's lines ``start..last``, forgetting them all."""
    lines = sorted(n for n in bad if n <= last)
    reasons = [bad.pop(n) for n in lines]
    if not reasons:
        return None
    # a multi-line csv record is reported at its start: say which of its lines is bad
    return reasons[0] if lines[0] == start else f"line {lines[0]} is {reasons[0]}"


def _read_header(path: str, reader, fmt: str, field: str, bad: dict[int, str]) -> list[str]:
    try:
        header = next(reader)
    except StopIteration:
        raise fail(path, 0, "the prompt file is empty", "Add a header line and prompts") from None
    except csv.Error as e:
        raise fail(path, 1, f"malformed {fmt} header ({e})", "Fix the header line") from None
    reason = _pop_bad(bad, 1, reader.line_num)
    if reason:
        raise fail(path, 1, f"the header is {reason}", "Save the file as UTF-8")
    _check_columns(path, header, field, fmt)
    return header


def read_table(path: str, f: BinaryIO, fmt: str, field: str, seed_field: str,
               on_bad_row: str, max_chars: int | None = None, rules: RowRules | None = None) -> Iterator[PromptRow]:
    """The rows of a csv/tsv file ``f`` (header first), each a PromptRow (or a reject per ``on_bad_row``)."""
    bad: dict[int, str] = {}
    reader = _table_reader(_text_lines(f, bad, max_line_bytes(max_chars)), fmt)
    header = _read_header(path, reader, fmt, field, bad)
    index = 0
    while True:
        start = reader.line_num + 1  # a csv record may span lines: report where it starts
        try:
            cells, reason = next(reader), None
        except StopIteration:
            return
        except csv.Error as e:
            cells, reason = None, f"malformed {fmt} ({e})"
        reason = _pop_bad(bad, start, reader.line_num) or reason
        yield emit(path, index, start, on_bad_row, _parse_cells, cells, reason, header, field, seed_field, rules,
                   max_chars=max_chars)
        index += 1


def _parse_cells(cells: list[str] | None, reason: str | None, header: list[str], field: str,
                 seed_field: str, rules: RowRules | None = None) -> tuple[str, int | None, dict, dict]:
    if reason:
        raise _BadRow(reason)
    if len(cells) != len(header):
        n = len(cells)
        raise _BadRow(f"the row has {n} column{'' if n == 1 else 's'}, the header has {len(header)}")
    extra = dict(zip(header, cells))
    prompt = _check_prompt(extra.pop(field))
    seed = _seed_text(extra.pop(seed_field), seed_field) if seed_field in extra else None
    settings = rules.parse(extra, text=True) if rules else {}
    return prompt, seed, split_reserved(extra), settings


# ---------------------------------------------------------------- parquet

def _parquet_module(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise fail(path, 0, "reading parquet prompt files needs pyarrow, which is not installed",
                   "Run: pip install pyarrow (or pip install 'shardgen[parquet]')") from None
    return pq


def parquet_file(path: str):
    """``path`` opened as a pyarrow ParquetFile, or a PromptFileError saying it is not one."""
    pq = _parquet_module(path)
    try:
        return pq.ParquetFile(open_remote(path) if is_url(path) else path)
    except StorageError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError/...; all mean "not readable as parquet"
        raise fail(path, 0, f"is not a readable parquet file ({e})",
                   "Check the file, or set prompts.format= to its real format") from None


def _parquet_records(path: str, pf) -> Iterator[dict]:
    batches = pf.iter_batches(batch_size=_PARQUET_BATCH)  # streaming: one batch in memory at a time
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # a corrupt page half-way: name the file, not a pyarrow internal
            raise fail(path, 0, f"cannot be read as parquet ({e})", "Check the file") from None
        try:
            yield from batch.to_pylist()
        except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8: find the rows, one by one
            yield from _rows_one_by_one(batch)


def _rows_one_by_one(batch) -> Iterator[dict | _BadRow]:
    """The rows of ``batch``; a row that does not decode as a _BadRow in its place (its row number is kept)."""
    for i in range(batch.num_rows):
        try:
            yield batch.slice(i, 1).to_pylist()[0]
        except UnicodeDecodeError as e:
            yield _BadRow(f"a string that is not valid UTF-8 (byte 0x{e.object[e.start]:02x}; is the file's text "
                          "UTF-8?)")


def _read_parquet(path: str, field: str, seed_field: str, on_bad_row: str,
                  max_chars: int | None = None, rules: RowRules | None = None) -> Iterator[PromptRow]:
    pf = parquet_file(path)
    _check_columns(path, pf.schema_arrow.names, field, "parquet")
    for index, rec in enumerate(_parquet_records(path, pf)):
        # parquet has no lines: ``line`` is the 1-based row number
        yield emit(path, index, index + 1, on_bad_row, parse_parquet, rec, field, seed_field, rules,
                   max_chars=max_chars)


def parse_parquet(rec: dict, field: str, seed_field: str,
                  rules: RowRules | None = None) -> tuple[str, int | None, dict, dict]:
    """One parquet record as (prompt, seed, the other fields made JSON-able, its settings); raises _BadRow or
    BadSetting."""
    if isinstance(rec, _BadRow):
        raise rec
    # NaN: unset; an input image keeps its bytes (a binary column, or datasets' {"bytes", "path"} struct)
    rec = {k: _jsonable(v) if k in (rules.names if rules else ()) and k != "image" else v for k, v in rec.items()}
    prompt, seed, extra, settings = _parse_record(rec, field, seed_field, rules)
    extra = {k: _jsonable(v) for k, v in extra.items()}
    _check_values(extra)
    return prompt, seed, extra, settings


def _jsonable(value: Any) -> Any:
    """Parquet values as JSON values: extras are written into the plan as JSON."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None  # a missing value in a float column (pandas writes NaN): JSON has no NaN
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "isoformat"):  # dates, times, timestamps
        return value.isoformat()
    return str(value)  # decimals, bytes, durations: a readable string beats a crash


def prompt_file_path(text: str) -> Path | str:
    """The prompt file ``prompts.path`` names; a relative path is taken from the current directory, else from the
    project (so the shipped examples/prompts.txt works from anywhere); a URL (``s3://bucket/captions.parquet``) as
    it is."""
    if is_url(text):
        return text
    path = Path(os.path.expanduser(text))
    if not path.is_absolute() and not path.exists() and (PROJECT_ROOT / path).exists():
        return PROJECT_ROOT / path
    return path.absolute()
