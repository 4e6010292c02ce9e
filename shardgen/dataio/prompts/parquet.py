"""``prompts.format=parquet``: a table of named columns read batch by batch (local, or remote by ranged reads). Its
rows have no lines: a row's ``line`` is its 1-based number, shards start at row numbers, each shard's digest hashes
its rows as read, a remote file with an ETag is planned from its footer alone, and the file is never appended to."""

from __future__ import annotations

from typing import Any, Iterator

from shardgen.dataio.prompts.formats import PromptFormat, register_format
from shardgen.dataio.prompts.read import (BadRow, PromptRow, PromptSource, ReadRequest, check_columns, check_values,
                                          emit, fail, parse_record)
from shardgen.dataio.prompts.rowsettings import RowRules
from shardgen.dataio.rundir.remote import StorageError, is_url, open_remote

_PARQUET_BATCH = 4096


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


def _rows_one_by_one(batch) -> Iterator[dict | BadRow]:
    """The rows of ``batch``; a row that does not decode as a BadRow in its place (its row number is kept)."""
    for i in range(batch.num_rows):
        try:
            yield batch.slice(i, 1).to_pylist()[0]
        except UnicodeDecodeError as e:
            yield BadRow(f"a string that is not valid UTF-8 (byte 0x{e.object[e.start]:02x}; is the file's text "
                          "UTF-8?)")


def _read_parquet(path: str, field: str, seed_field: str, on_bad_row: str,
                  max_chars: int | None = None, rules: RowRules | None = None) -> Iterator[PromptRow]:
    pf = parquet_file(path)
    check_columns(path, pf.schema_arrow.names, field, seed_field=seed_field)
    for index, rec in enumerate(_parquet_records(path, pf)):
        # parquet has no lines: ``line`` is the 1-based row number
        yield emit(path, index, index + 1, on_bad_row, parse_parquet, rec, field, seed_field, rules,
                   max_chars=max_chars)


def parse_parquet(rec: dict, field: str, seed_field: str,
                  rules: RowRules | None = None) -> tuple[str, int | None, dict, dict]:
    """One parquet record as (prompt, seed, the other fields made JSON-able, its settings); raises BadRow or
    BadSetting."""
    if isinstance(rec, BadRow):
        raise rec
    # NaN: unset; an input image keeps its bytes (a binary column, or datasets' {"bytes", "path"} struct)
    rec = {k: _jsonable(v) if k in (rules.names if rules else ()) and k != "image" else v for k, v in rec.items()}
    prompt, seed, extra, settings = parse_record(rec, field, seed_field, rules)
    extra = {k: _jsonable(v) for k, v in extra.items()}
    check_values(extra)
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


def parquet_rows_at(src: PromptSource, index: int, count: int) -> Iterator[PromptRow]:
    """``count`` rows of a parquet prompt file from row ``index`` (only the row groups that hold them are read)."""
    pf = parquet_file(src.path)
    row_groups, first, pos = [], 0, 0  # the row groups that hold rows index..index+count-1
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if pos + n > index and pos < index + count:
            first = pos if not row_groups else first
            row_groups.append(g)
        pos += n
    table = pf.read_row_groups(row_groups).slice(index - first, count)
    for i, rec in enumerate(table.to_pylist()):
        yield emit(src.path, index + i, index + i + 1, src.on_bad_row, parse_parquet, rec, src.field,
                   src.seed_field, src.rules, max_chars=src.max_chars)


def _rows_at(src, data, offset: int, line: int, index: int, count: int, head: bytes | None) -> Iterator[PromptRow]:
    return parquet_rows_at(src, index, count)


def _check(path: str, field: str) -> None:
    check_columns(path, parquet_file(path).schema_arrow.names, field)


def _read(req: ReadRequest) -> Iterator[PromptRow]:
    return _read_parquet(req.path, req.field, req.seed_field, req.on_bad_row, req.max_chars, req.rules)


register_format(PromptFormat("parquet", (".parquet",), _read, _rows_at, check=_check, lines=False,
                             count_rows=lambda path: parquet_file(path).metadata.num_rows))
