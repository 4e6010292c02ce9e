"""Planning scans: a prompt file's rows validated once and cut into shards, without keeping them.

txt files go through a numpy block scan (newlines, UTF-8, a first-byte test for blank lines) with the
per-line reader only for a block that may hold a bad line; other formats through the reader. Both
start at any row (an extension plans only the rows appended since) and offer long prompts to the
truncation check (``prompts.on_truncation``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from shardgen.dataio import prompts as P
from shardgen.dataio.truncation import TruncationCheck

if TYPE_CHECKING:  # a type only: plan.py imports this module
    from shardgen.dataio.plan import PromptSource

log = logging.getLogger("shardgen.plan")
_BLOCK = 16 << 20   # txt planning reads the file in blocks of this many bytes


def truncation_outcome(source: PromptSource, check: TruncationCheck | None) -> np.ndarray | None:
    """Warn about or refuse the truncated prompts; with on_truncation=skip, their indices (to reject)."""
    message = check.report(source.path) if check else None
    if message is None:
        return None
    if check.policy == "error":
        raise P.PromptFileError(f"{message}. Shorten them, or set prompts.on_truncation=warn to generate them "
                                "truncated (flagged in each sample's json), or skip to record them as rejects")
    if check.policy == "skip":
        log.warning("%s: recorded as rejects (prompts.on_truncation=skip)", message)
        return np.sort(np.frombuffer(check.truncated, dtype=np.int64))
    log.warning("%s: generated from their first tokens and flagged \"truncated\": true in their json and index "
                "(prompts.on_truncation=skip or error refuses them)", message)
    return None


def scan_rows(source: PromptSource, per_shard: int, check: TruncationCheck | None = None, first_row: int = 0
               ) -> tuple[int, int, np.ndarray]:
    """Any format: every row through the reader (those before ``first_row`` planned already); shard starts
    from the rows' lines (parquet: row numbers)."""
    rows = P.read_prompts(source.path, format=source.format, field=source.field, seed_field=source.seed_field,
                          on_bad_row=source.on_bad_row)
    n = rejects = 0
    first_lines = []
    try:
        for row in rows:
            if source.limit is not None and row.index >= source.limit:
                break
            if row.index < first_row:
                continue
            if (row.index - first_row) % per_shard == 0:
                first_lines.append(row.line)
            rejects += row.reject is not None
            if check and row.reject is None and len(row.prompt.encode("utf-8")) > check.min_bytes:
                check.offer(row.index, row.line, row.prompt)
                if check.stop:
                    break
            n += 1
    except P.PromptFileError as e:
        if "has no rows" not in str(e):
            raise
    lines = np.asarray(first_lines, dtype=np.int64)
    if source.format == "parquet":
        return n, rejects, np.stack([lines - 1, lines], axis=1) if n else np.zeros((0, 2), np.int64)
    return n, rejects, np.stack([_line_offsets(source.path, lines), lines], axis=1)


def _line_offsets(path: str, lines: np.ndarray) -> np.ndarray:
    """Byte offset where each (1-based, increasing) line of ``lines`` starts."""
    out = np.zeros(len(lines), dtype=np.int64)
    if not len(lines):
        return out
    base = newlines = 0  # bytes and newlines before the current block
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            # line L starts after newline number L-1 (1-based)
            want = (lines >= newlines + 2) & (lines <= newlines + len(nl) + 1)
            out[want] = base + nl[lines[want] - 2 - newlines] + 1
            base, newlines = base + len(block), newlines + len(nl)
    return out


def scan_txt(source: PromptSource, per_shard: int, check: TruncationCheck | None = None, offset: int = 0,
              first_row: int = 0) -> tuple[int, int, np.ndarray]:
    """txt, fast: whole blocks checked with numpy (UTF-8, no empty or blank line); a block where
    a line may be bad goes through the exact per-line reader, for the same rejects and messages.

    Work per block is a newline search over its bytes plus a look at each line's first byte, so 10M
    captions of 200 bytes plan in seconds; memory is one reused block buffer and its line positions."""
    limit = source.limit if source.limit is not None else 1 << 62
    starts, rows, rejects, base, carry = [], first_row, 0, offset, 0
    buf = bytearray(_BLOCK)
    with open(source.path, "rb", buffering=0) as f:
        f.seek(offset)
        while rows < limit:
            if carry == len(buf):  # a line longer than the buffer: grow it
                buf = buf + bytearray(len(buf))
            got = f.readinto(memoryview(buf)[carry:])
            size = carry + got
            arr = np.frombuffer(buf, np.uint8, size)
            ends = np.flatnonzero(arr == 10) + 1
            if not got and size and (not len(ends) or ends[-1] != size):
                ends = np.append(ends, size)  # the last line may lack a newline
            if not len(ends):
                if not got:
                    break
                carry = size  # no whole line yet: read on
                continue
            ends = ends[:limit - rows]
            line_starts = np.empty_like(ends)
            line_starts[0], line_starts[1:] = 0, ends[:-1]
            first = rows  # index of the block's first row
            js = np.arange(-(first - first_row) % per_shard, len(ends), per_shard)  # the block's rows starting a shard
            starts.append(np.stack([base + line_starts[js], first + js + 1], axis=1))
            view = memoryview(buf)[:size]
            rejects += _check_block(source, view, arr, line_starts, ends, first, base == 0)
            if check:
                _offer_long_lines(check, view, line_starts, ends, first)
                if check.stop:
                    break
            rows += len(ends)
            end = int(ends[-1])
            base += end
            del arr, view  # the buffer is written to again below: no view of it may outlive the block
            carry = size - end
            buf[:carry] = buf[end:size]
            if not got:
                break
    return rows - first_row, rejects, np.concatenate(starts).astype(np.int64) if starts else np.zeros((0, 2), np.int64)


def _check_block(source: PromptSource, block: memoryview, arr: np.ndarray, line_starts: np.ndarray,
                 ends: np.ndarray, first: int, at_file_start: bool) -> int:
    """Rejects in the whole lines ``line_starts..ends`` of a block (raises on a bad line unless
    on_bad_row=skip). A prompt has a byte that is certainly not whitespace (33..126); a line without
    one may be blank. Most lines start with one, so only the others are searched."""
    end = int(ends[-1])
    solid_first = (arr[line_starts] - np.uint8(33)) < 94  # uint8 wraps: 33..126 -> 0..93
    suspect = False
    if not solid_first.all():
        lines = np.flatnonzero(~solid_first)
        solid = (arr[:end] - np.uint8(33)) < 94
        suspect = not np.maximum.reduceat(solid, line_starts)[lines].all()
    clean = arr[:end].max() < 128 or _utf8(block[:end])
    if clean and not suspect and not (at_file_start and block[:3] == P._BOM):
        return 0
    rejects = 0
    for i, (s, e) in enumerate(zip(line_starts.tolist(), ends.tolist())):
        raw = bytes(block[s:e])
        if at_file_start and i == 0 and raw.startswith(P._BOM):
            raw = raw[len(P._BOM):]
        row = P._emit(source.path, first + i, first + i + 1, source.on_bad_row, P._parse_txt, raw)
        rejects += row.reject is not None
    return rejects


def _offer_long_lines(check: TruncationCheck, block: memoryview, line_starts: np.ndarray, ends: np.ndarray,
                      first: int) -> None:
    for j in np.flatnonzero(ends - line_starts - 1 > check.min_bytes).tolist():
        if check.stop:
            return
        try:
            prompt = P._strip_eol(bytes(block[line_starts[j]:ends[j]])).decode("utf-8").lstrip("\ufeff")
        except UnicodeDecodeError:
            continue  # a reject, not a prompt
        if prompt.strip():
            check.offer(first + j, first + j + 1, prompt)


def _utf8(block) -> bool:
    try:
        str(block, "utf-8")
        return True
    except UnicodeDecodeError:
        return False
