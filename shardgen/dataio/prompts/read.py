"""Streaming prompt-file reading: a file of any registered format (formats.py: txt, jsonl, csv, tsv, parquet, each
its own module) in, ``PromptRow``s out; what the formats share (the rows, the errors, lines, seeds, fields).

Text formats are read and decoded line by line from bytes, so memory stays constant in the
number of rows (files may hold 100M prompts) and every problem, a non-UTF-8 byte included,
is reported as ``<path>:<line>: <what is wrong>. <what to change>``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator
from shardgen.dataio.prompts.formats import prompt_format, prompt_formats
from shardgen.dataio.prompts.rowsettings import BadSetting, RowRules
from shardgen.dataio.prompts.samplejson import split_reserved
from shardgen.dataio.rundir.remote import info, is_url, public_url
from shardgen.errors import UserError
from shardgen.pick import pick

PROJECT_ROOT = Path(__file__).resolve().parents[3]
ON_BAD_ROW = ("error", "skip")
BOM = b"\xef\xbb\xbf"
DEFAULT_SEED_FIELD = "seed"  # prompts.seed_field's default: a file without this column has no row seeds
MAX_SEED = 2**63 - 1  # sample_seed() promises seeds that fit 63 bits (a row's seed and the run's seed alike)
MAX_INT_BITS = 1023  # a row's integers stay within a float's range: every JSON reader can hold them
_SKIP_HINT = "Fix the row, or set prompts.on_bad_row=skip to record such rows as rejects and go on"
MAX_PROMPT_CHARS = 100_000  # prompts.max_prompt_chars' default: far beyond any text encoder's window
MAX_DEPTH = 64  # nesting of a row's values; deeper is surely not a prompt row (and would blow the stack)


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


class BadRow(UserError):
    """The row at hand is bad; ``str(exc)`` is the reason shown to the user (``emit`` makes it a PromptFileError
    naming the file and line, or a reject with ``on_bad_row=skip``)."""


@dataclass(frozen=True)
class PromptSource:
    """The prompt file and how to read it (``prompts.*`` of the config)."""

    path: str
    format: str = "auto"
    field: str = "prompt"
    seed_field: str = DEFAULT_SEED_FIELD
    on_bad_row: str = "error"
    limit: int | None = None
    max_chars: int | None = None  # longer prompts are bad rows (None in plans made before the limit existed)
    row_rules: dict | None = None  # prompts.row_settings: RowRules.as_json() (None: no row sets a setting)

    @classmethod
    def from_cfg(cls, prompts: Any, path: str | os.PathLike, rules: RowRules | None = None) -> "PromptSource":
        """From a PromptsConfig and the resolved path of its file; ``rules``: how rows' settings are checked
        (None, or no names: the rows set none)."""
        fmt = detect_format(str(path), prompts.format)
        if rules is not None and rules.names and not prompt_format(fmt).fields:
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
        """For plan.json; without ``row_rules`` when there are none, so such plans stay as they were; a URL as
        ``public_url`` writes it (a presigned URL's signature stays out of the run)."""
        out = {k: v for k, v in self.__dict__.items() if k != "row_rules" or v is not None}
        return out | ({"path": public_url(out["path"])} if isinstance(out.get("path"), str) else {})


@dataclass(frozen=True)
class ReadRequest:
    """What a format's reader is asked (``read_prompts``' arguments, checked)."""

    path: str
    field: str = "prompt"
    seed_field: str = DEFAULT_SEED_FIELD
    on_bad_row: str = "error"
    max_chars: int | None = None
    rules: RowRules | None = None


def fail(path: str, line: int, what: str, fix: str) -> PromptFileError:
    """The one-line error for ``path`` (at ``line`` when not 0): what is wrong, then what to change."""
    where = f"{path}:{line}" if line else path
    return PromptFileError(f"{where}: {what}. {fix}")


# ---------------------------------------------------------------- public API

def detect_format(path: str, format: str = "auto") -> str:
    """The prompt format of ``path``: ``format`` itself unless "auto", else from the extension."""
    path = os.fspath(path)
    formats = prompt_formats()
    if format != "auto":
        if format in formats:
            return format
        raise fail(path, 0, f"prompts.format={format!r} is not a known format",
                   f"Use prompts.format=auto or one of: {', '.join(formats)}")
    name = path.split("?", 1)[0].split("#", 1)[0] if is_url(path) else path  # a URL's query is not its name
    ext = os.path.splitext(name)[1].lower()
    by_extension = {e: f.name for f in formats.values() for e in f.extensions}
    if ext in by_extension:
        return by_extension[ext]
    fix = f"Name the file {', '.join(by_extension)}, or set prompts.format=<one of {', '.join(formats)}>"
    if ext == ".json":  # the usual near miss: a .json file that is really one object per line
        fix += " (prompts.format=jsonl if it holds one JSON object per line)"
    raise fail(path, 0, f"cannot tell the prompt format from the extension {ext or '(none)'!r}", fix)


def check_prompt_source(path: str, format: str = "auto", field: str = "prompt") -> None:
    """Cheap up-front check: the file is a readable non-empty file of a known format, and for
    csv/tsv/parquet its header has the column ``field``. Raises PromptFileError otherwise."""
    path = os.fspath(path)
    _check_file(path)
    prompt_format(detect_format(path, format)).check(path, field)


def read_prompts(path: str, *, format: str = "auto", field: str = "prompt", seed_field: str = DEFAULT_SEED_FIELD,
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
    fmt = prompt_format(detect_format(path, format))
    return _require_rows(path, fmt.read(ReadRequest(path, field, seed_field, on_bad_row, max_chars, rules)))


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
    meta = info(url)
    if meta.get("type") == "directory":  # a bucket or a prefix: fsspec lists it as a folder of size 0
        raise fail(url, 0, "is a bucket or folder (a prefix of objects), not a prompt file",
                   "Set prompts.path to the object's full URL")
    if int(meta.get("size") or 0) == 0:
        raise fail(url, 0, "the prompt file is empty (0 bytes)", "Add prompts, or point prompts.path at the right file")


def _require_rows(path: str, rows: Iterable[PromptRow]) -> Iterator[PromptRow]:
    n = 0
    for n, row in enumerate(rows, 1):
        yield row
    if n == 0:
        raise fail(path, 0, "the prompt file has no rows (only a header, or only a byte-order mark)",
                   "Add prompts, or point prompts.path at the right file")


def too_long(n: int, max_chars: int) -> str:
    """The reason of a prompt over the length limit."""
    return f"the prompt is {n} characters long, over prompts.max_prompt_chars={max_chars}"


def emit(path: str, index: int, line: int, on_bad_row: str, parse: Callable, *args: Any,
         max_chars: int | None = None) -> PromptRow:
    """The row ``parse(*args)`` makes, or, when it raises BadRow (or the prompt is longer than ``max_chars``:
    checked before anything tokenizes it), an error or a reject."""
    try:
        prompt, seed, extra, *settings = parse(*args)  # readers of rows with fields add the row's settings
        if max_chars is not None and len(prompt) > max_chars:
            raise BadRow(too_long(len(prompt), max_chars))
        negative = settings[0].get("negative_prompt") if settings else None
        if max_chars is not None and negative is not None and len(negative) > max_chars:  # tokenized like the prompt
            raise BadRow(too_long(len(negative), max_chars).replace("the prompt", "the negative_prompt", 1))
    except (BadRow, BadSetting) as e:
        if on_bad_row == "error":
            raise fail(path, line, str(e), _SKIP_HINT) from None
        return PromptRow(index, line, None, None, {}, str(e))
    return PromptRow(index, line, prompt, seed, extra, None, settings[0] if settings else {})


LINE_SLACK = 1 << 20  # a row's bytes beyond its prompt's: other fields, quoting


def line_rows_at(src: Any, data: BinaryIO, offset: int, line: int, index: int, count: int, parse: Callable,
                 *args: Any) -> Iterator[PromptRow]:
    """``count`` rows of a one-row-a-line format (txt, jsonl) from ``data``, positioned at byte ``offset`` where row
    ``index`` starts on ``line``; ``parse(raw, *args)`` reads one line."""
    for i in range(count):
        raw = read_line(data, max_line_bytes(src.max_chars))
        if offset == 0 and i == 0 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        yield emit(src.path, index + i, line + i, src.on_bad_row, parse, raw, *args, max_chars=src.max_chars)


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


def decode_line(raw: bytes) -> str:
    if isinstance(raw, LongLine):
        raise BadRow(raw.reason())
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRow(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line; "
                      "is the file saved as UTF-8?)") from None


def strip_eol(raw: bytes) -> bytes:
    """``raw`` without its line terminator (\\n or \\r\\n)."""
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw


def check_prompt(prompt: Any) -> str:
    """``prompt`` when it is a string a text encoder can take whole; BadRow saying why not."""
    if not isinstance(prompt, str):
        raise BadRow(f"the prompt is not a string (got {json_type(prompt)})")
    if not prompt.strip():
        raise BadRow("empty prompt" if not prompt else "the prompt is only whitespace")
    if "\x00" in prompt:  # never text: a UTF-16 file read as UTF-8 has one every other byte
        raise BadRow("the prompt holds a NUL byte (is the file UTF-16? save it as UTF-8)")
    return prompt


def seed_value(value: Any, seed_field: str) -> int | None:
    """A jsonl/parquet seed: null means none; else an int (bool excluded) in [0, 2**63)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and 0 <= value <= 2**53:
        value = int(value)  # pandas stores an integer column that has a null as float64 (a float holds these exactly)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        more = (" (a float holds integers exactly only up to 2**53: store seeds as integers, e.g. pandas' Int64 "
                "dtype)" if isinstance(value, float) and value.is_integer() else "")
        raise BadRow(f"{seed_field}={value!r} is not a seed (an integer from 0 to 2**63-1){more}")
    return value


def json_type(value: Any) -> str:
    names = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
             list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def check_columns(path: str, columns: list[str], field: str, hint: str = "", seed_field: str | None = None) -> None:
    """PromptFileError unless ``columns`` (a header) are distinct and name ``field``, and ``seed_field`` when it is
    not the default (a file without the default seed column simply has no row seeds; one named on purpose must
    be there, or its seeds would be ignored silently); ``hint`` is added to the fix (a table format's guess at the
    file's real separator)."""
    dup = next((c for i, c in enumerate(columns) if c in columns[:i]), None)
    if dup is not None:
        raise fail(path, 1, f"the header has the column {dup!r} twice", "Give every column a distinct name")
    if field in columns:
        if seed_field not in (None, DEFAULT_SEED_FIELD) and seed_field not in columns:
            raise fail(path, 1, f"no column {seed_field!r} (prompts.seed_field); the columns are {columns}",
                       f"Set prompts.seed_field=<one of them>, or leave it at {DEFAULT_SEED_FIELD!r} (then rows "
                       f"without that column take seeds from the run's seed)")
        return
    fix = "Set prompts.field=<one of them>"
    guess = guess_field(columns, field)
    if guess:
        fix += f", e.g. prompts.field={guess}"
    raise fail(path, 1, f"no column {field!r} (prompts.field); the columns are {columns}", fix + hint)


CAPTION_NAMES = ("prompt", "caption", "text", "prompts", "captions", "description", "alt", "alt_text", "title")


def guess_field(names: list[str], field: str, texts: list[str] | None = None) -> str | None:
    """The column or field most likely to hold the prompts: one named like ``field`` but for case, then one with a
    common caption name, then the only one of ``texts`` (the fields whose value is a string); None without one."""
    close = [c for c in names if str(c).lower() == field.lower()]
    if close:
        return close[0]
    for common in CAPTION_NAMES:
        found = [c for c in names if str(c).lower() == common]
        if found:
            return found[0]
    return texts[0] if texts is not None and len(texts) == 1 else None


def guess_prompt_field(path: str, format: str = "auto", field: str = "prompt") -> str | None:
    """The field or column holding the prompts when ``field`` is not one of the file's first row (jsonl) or header
    (csv/tsv, parquet) and exactly one of them has a common caption name (``caption``, ``text``, ...); None
    otherwise, or when the file cannot be read here (the launch's own checks then name the problem), or is a URL
    (whose reads are counted and kept to what planning needs)."""
    if is_url(path):
        return None
    try:
        names = _first_names(path, detect_format(path, format))
    except Exception:  # unreadable, not the format it says: left to the checks that name the problem
        return None
    if names is None or field in names:
        return None
    found = [n for n in names if isinstance(n, str) and n.lower() in CAPTION_NAMES and n != field]
    return found[0] if len(found) == 1 else None


def _first_names(path: str, fmt: str) -> list[str] | None:
    """The fields of a jsonl file's first row, or a csv/tsv/parquet file's columns (read from its first line or
    its footer); None for formats without fields."""
    if fmt == "parquet":
        from shardgen.dataio.prompts.parquet import parquet_file

        return list(parquet_file(path).schema_arrow.names)
    if fmt not in ("jsonl", "csv", "tsv"):
        return None
    from shardgen.dataio.rundir.remote import open_input

    with open_input(path) as f:
        line = f.readline(1 << 20)
        while fmt == "jsonl" and line.strip() == b"" and line:
            line = f.readline(1 << 20)
    text = line.removeprefix(BOM).decode("utf-8")
    if fmt == "jsonl":
        import json

        obj = json.loads(text)
        return list(obj) if isinstance(obj, dict) else None
    import csv

    return next(csv.reader([text.rstrip("\r\n")], delimiter="," if fmt == "csv" else "\t"), None)


def check_values(obj: Any) -> None:
    """Every string of the row is valid Unicode (no lone surrogates such as "\\ud800") and nesting stays
    within MAX_DEPTH, so the row can be written as standard UTF-8 JSON later; iterative, never recursing."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRow(f"JSON nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(value, dict):
            stack += [(k, depth) for k in value] + [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRow(f"invalid Unicode: a lone surrogate \\u{ord(value[e.start]):04x} in {value[:40]!r}") \
                    from None
        elif isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            raise BadRow(f"{value} is not a JSON number (standard JSON has no NaN or Infinity)")
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise BadRow(f"an integer of {value.bit_length()} bits is beyond a number's range (about 1.8e308, "
                          f"{MAX_INT_BITS} bits): write it as a string")


def parse_record(rec: dict, field: str, seed_field: str,
                  rules: RowRules | None = None) -> tuple[str, int | None, dict, dict]:
    """A jsonl object or parquet row: the prompt, the seed, the rest as extra, the row's settings."""
    if field not in rec:
        guess = guess_field(list(rec), field, [k for k, v in rec.items() if isinstance(v, str)])
        other = ": if another field holds the prompt, set prompts.field=<it>" + \
            (f", e.g. prompts.field={guess}" if guess else "")
        raise BadRow(f"no field {field!r} (prompts.field); the fields are {list(rec)}{other}")
    extra = dict(rec)
    prompt = check_prompt(extra.pop(field))
    seed = seed_value(extra.pop(seed_field, None), seed_field)
    settings = rules.parse(extra) if rules else {}
    return prompt, seed, split_reserved(extra), settings


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
