"""``prompts.format=jsonl``: one JSON object a line (``.jsonl``, ``.ndjson``): the prompt under ``prompts.field``, an
optional seed, the other fields kept (and read as the row's settings with prompts.row_settings)."""

from __future__ import annotations

import json
from typing import Iterator

from shardgen.dataio.prompts.formats import PromptFormat, register_format
from shardgen.dataio.prompts.read import (MAX_DEPTH, BadRow, PromptRow, ReadRequest, check_values, decode_line, emit,
                                          json_type, line_rows_at, max_line_bytes, parse_record, raw_lines)
from shardgen.dataio.prompts.rowsettings import RowRules
from shardgen.dataio.rundir.remote import open_input


def read_jsonl(req: ReadRequest) -> Iterator[PromptRow]:
    """Every line of the file as a row."""
    with open_input(req.path) as f:
        for index, (line, raw) in enumerate(raw_lines(f, max_line_bytes(req.max_chars))):
            yield emit(req.path, index, line, req.on_bad_row, parse_jsonl, raw, req.field, req.seed_field, req.rules,
                       max_chars=req.max_chars)


def parse_jsonl(raw: bytes, field: str, seed_field: str,
                rules: RowRules | None = None) -> tuple[str, int | None, dict, dict]:
    """One jsonl line as (prompt, seed, the other fields, its settings); raises BadRow or BadSetting."""
    text = decode_line(raw)
    if not text.strip():
        raise BadRow("blank line (every jsonl line must be one JSON object)")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise BadRow(f"malformed JSON ({e.msg} at column {e.colno})") from None
    except ValueError:  # Python's limit on the digits of an integer it converts (4300)
        raise BadRow("a number with thousands of digits: too large for any JSON reader (write it as a string)") \
            from None
    except RecursionError:
        raise BadRow(f"JSON nested too deeply (more than {MAX_DEPTH} levels)") from None
    if not isinstance(obj, dict):
        raise BadRow(f"not a JSON object (got {json_type(obj)})")
    check_values(obj)
    return parse_record(obj, field, seed_field, rules)


def _no_constant(name: str):
    raise BadRow(f"{name} is not standard JSON (use null, or a number)")


def _rows_at(src, data, offset: int, line: int, index: int, count: int, head: bytes | None) -> Iterator[PromptRow]:
    return line_rows_at(src, data, offset, line, index, count, parse_jsonl, src.field, src.seed_field, src.rules)


register_format(PromptFormat("jsonl", (".jsonl", ".ndjson"), read_jsonl, _rows_at))
