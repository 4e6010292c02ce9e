"""``prompts.format=csv`` and ``tsv``: a header line naming the columns, then one record a row (a quoted csv field may
span lines; tsv has no quoting). The header is hashed with every shard's rows (``header``), so a shard read back
is parsed exactly as planned."""

from __future__ import annotations

import csv
import re
from typing import BinaryIO, Iterator

from shardgen.dataio.prompts.formats import PromptFormat, register_format
from shardgen.dataio.prompts.read import (BadRow, LongLine, PromptRow, PromptSource, ReadRequest, check_columns,
                                          check_prompt, decode_line, emit, fail, max_line_bytes, raw_lines,
                                          seed_value)
from shardgen.dataio.prompts.rowsettings import RowRules
from shardgen.dataio.prompts.samplejson import split_reserved
from shardgen.dataio.rundir.remote import open_input

_SEED_TEXT = re.compile(r"[0-9]{1,19}")  # csv/tsv seeds: plain digits only, so " 1", "+1", "1_0" are rejected
DIALECTS = {
    # strict: malformed quoting is a bad row rather than silently altered text
    "csv": dict(strict=True),
    # no quoting at all: quotes inside prompts (e.g. PartiPrompts' "PEACE") stay literal
    "tsv": dict(delimiter="\t", quoting=csv.QUOTE_NONE, strict=True),
}


def _separator_hint(columns: list[str], fmt: str) -> str:
    """A one-column header that holds the other separator: the file is probably of the other table format."""
    if len(columns) == 1 and fmt != "tsv" and "\t" in columns[0]:
        return "; the header looks tab-separated: set prompts.format=tsv"
    if len(columns) == 1 and fmt == "tsv" and "," in columns[0]:
        return "; the header looks comma-separated: set prompts.format=csv"
    return ""


def _seed_text(text: str, seed_field: str) -> int | None:
    """A csv/tsv seed cell: empty means none (csv has no null)."""
    if text == "":
        return None
    if not _SEED_TEXT.fullmatch(text):
        raise BadRow(f"{seed_field}={text[:40]!r} is not a seed (an integer from 0 to 2**63-1)")
    return seed_value(int(text), seed_field)


def _text_lines(f: BinaryIO, bad: dict[int, str], max_bytes: int | None = None) -> Iterator[str]:
    """Decoded lines for the csv module, one per physical line so its ``line_num`` is the
    file's line number; a line that is not UTF-8 is passed on replaced and noted in ``bad``,
    because the csv module's iterator protocol has no way to reject a single line."""
    for lineno, raw in raw_lines(f, max_bytes):
        try:
            yield decode_line(raw)
        except BadRow as e:
            bad[lineno] = str(e)
            yield "\n" if isinstance(raw, LongLine) else raw.decode("utf-8", "replace")


def _table_reader(lines: Iterator[str], fmt: str):
    return csv.reader(lines, **DIALECTS[fmt])


def _pop_bad(bad: dict[int, str], start: int, last: int) -> str | None:
    """The first non-UTF-8 reason among the record's lines ``start..last``, forgetting them all."""
    lines = sorted(n for n in bad if n <= last)
    reasons = [bad.pop(n) for n in lines]
    if not reasons:
        return None
    # a multi-line csv record is reported at its start: say which of its lines is bad
    return reasons[0] if lines[0] == start else f"line {lines[0]} is {reasons[0]}"


def _read_header(path: str, reader, fmt: str, field: str, bad: dict[int, str], seed_field: str | None = None) -> list[str]:
    try:
        header = next(reader)
    except StopIteration:
        raise fail(path, 0, "the prompt file is empty", "Add a header line and prompts") from None
    except csv.Error as e:
        raise fail(path, 1, f"malformed {fmt} header ({e})", "Fix the header line") from None
    reason = _pop_bad(bad, 1, reader.line_num)
    if reason:
        raise fail(path, 1, f"the header is {reason}", "Save the file as UTF-8")
    check_columns(path, header, field, _separator_hint(header, fmt), seed_field)
    return header


def read_table(path: str, f: BinaryIO, fmt: str, field: str, seed_field: str,
               on_bad_row: str, max_chars: int | None = None, rules: RowRules | None = None) -> Iterator[PromptRow]:
    """The rows of a csv/tsv file ``f`` (header first), each a PromptRow (or a reject per ``on_bad_row``)."""
    bad: dict[int, str] = {}
    reader = _table_reader(_text_lines(f, bad, max_line_bytes(max_chars)), fmt)
    header = _read_header(path, reader, fmt, field, bad, seed_field)
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
        raise BadRow(reason)
    if len(cells) != len(header):
        n = len(cells)
        raise BadRow(f"the row has {n} column{'' if n == 1 else 's'}, the header has {len(header)}")
    extra = dict(zip(header, cells))
    prompt = check_prompt(extra.pop(field))
    seed = _seed_text(extra.pop(seed_field), seed_field) if seed_field in extra else None
    settings = rules.parse(extra, text=True) if rules else {}
    return prompt, seed, split_reserved(extra), settings


def check_header(fmt: str):
    """The format's check: the header line parses and names the prompt column."""

    def check(path: str, field: str) -> None:
        with open_input(path) as f:
            _read_header(path, _table_reader(_text_lines(f, {}), fmt), fmt, field, {})

    return check


class _HeaderThen:
    """A header line, then the lines of a file: what the bounded line reader (``read_line``) reads."""

    def __init__(self, header: bytes, f: BinaryIO):
        self._header, self._f = header, f

    def readline(self, size: int = -1) -> bytes:
        if self._header is not None:
            header, self._header = self._header, None
            return header
        return self._f.readline(size)


def rows_at(fmt: str):
    """The format's ``rows_at``: records from ``data``'s position, through the reader given the header line then
    the rest."""
    import io
    from itertools import islice

    def read_back(src: PromptSource, data, offset: int, line: int, index: int, count: int,
                  head: bytes | None) -> Iterator[PromptRow]:
        if head is not None:
            header = next(raw_lines(io.BytesIO(head)))[1]
        else:
            with open_input(src.path) as h:
                header = next(raw_lines(h))[1]
        # the reader numbers the header line 1 and this shard's first record line 2
        for r in islice(read_table(src.path, _HeaderThen(header, data), fmt, src.field, src.seed_field,
                                   src.on_bad_row, src.max_chars, src.rules), count):
            yield PromptRow(r.index + index, r.line + line - 2, r.prompt, r.seed, r.extra, r.reject, r.settings)

    return read_back


def reader(fmt: str):
    """The format's reader: the whole file, header first."""

    def read(req: ReadRequest) -> Iterator[PromptRow]:
        with open_input(req.path) as f:
            yield from read_table(req.path, f, fmt, req.field, req.seed_field, req.on_bad_row, req.max_chars,
                                  req.rules)

    return read


for _name in DIALECTS:
    register_format(PromptFormat(_name, (f".{_name}",), reader(_name), rows_at(_name), check=check_header(_name),
                                 header=True))
