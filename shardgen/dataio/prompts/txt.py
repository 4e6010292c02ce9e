"""``prompts.format=txt``: one prompt a line, nothing else (no fields, no seeds, no row settings). Planned by a block
scan of its own (``scan_txt``: numpy over whole blocks, the exact reader only where a line may be bad)."""

from __future__ import annotations

import os
from typing import BinaryIO, Iterator

import numpy as np

from shardgen.dataio.prompts.formats import PromptFormat, register_format
from shardgen.dataio.prompts.read import (BOM, BadRow, LongLine, PromptRow, PromptSource, ReadRequest, check_prompt,
                                          decode_line, emit, line_rows_at, max_line_bytes, raw_lines, strip_eol)
from shardgen.dataio.prompts.truncation import TruncationCheck
from shardgen.dataio.rundir.remote import open_input

_BLOCK = 16 << 20  # planning reads the file in blocks of this many bytes


def parse_txt(raw: bytes) -> tuple[str, None, dict]:
    """One txt line (terminator included) as (prompt, no seed, no fields); raises BadRow."""
    # Only the terminator goes: the prompt must equal the file's text byte for byte.
    prompt = check_prompt(decode_line(strip_eol(raw)))
    if "\r" in prompt:  # a line ends at \n (or \r\n): a CR left inside is a line ending of another system
        raise BadRow("the line holds a carriage return (CR): a file with CR-only line endings holds many prompts "
                     "on one line. Convert its line endings to LF (\\n)")
    if prompt.startswith("\ufeff"):  # the file's own BOM is removed before: this one came with a file joined on
        raise BadRow("the line starts with a byte-order mark (U+FEFF), in the middle of the file: two files joined "
                     "together? Remove it")
    return prompt, None, {}


def read_txt(req: ReadRequest) -> Iterator[PromptRow]:
    """Every line of the file as a row."""
    with open_input(req.path) as f:
        for index, (line, raw) in enumerate(raw_lines(f, max_line_bytes(req.max_chars))):
            yield emit(req.path, index, line, req.on_bad_row, parse_txt, raw, max_chars=req.max_chars)


def _rows_at(src, data, offset: int, line: int, index: int, count: int, head: bytes | None) -> Iterator[PromptRow]:
    return line_rows_at(src, data, offset, line, index, count, parse_txt)


def scan_txt(source: PromptSource, per_shard: int, check: TruncationCheck | None = None, offset: int = 0,
              first_row: int = 0) -> tuple[int, int, np.ndarray, int, None]:
    """txt, fast: whole blocks checked with numpy (UTF-8, no empty or blank line); a block where
    a line may be bad goes through the exact per-line reader, for the same rejects and messages.

    Work per block is a newline search over its bytes plus a look at each line's first byte, so 10M
    captions of 200 bytes plan in seconds; memory is one reused block buffer and its line positions.
    Returns (rows, rejects, starts, the byte where the last planned row ends, None: no digests yet)."""
    limit = source.limit if source.limit is not None else 1 << 62
    starts, rows, rejects, base, carry = [], first_row, 0, offset, 0
    buf = bytearray(_BLOCK)
    max_line = max_line_bytes(source.max_chars)
    with open_input(source.path, buffering=0) as f:
        f.seek(offset)
        while rows < limit:
            if carry == len(buf) and carry > max_line:  # a line longer than any row: a bad row, skipped unread
                if (rows - first_row) % per_shard == 0:
                    starts.append(np.array([[base, rows + 1]], np.int64))
                size = _skip_long_line(source, f, carry, max_line, rows)
                rejects, rows, base, carry = rejects + 1, rows + 1, base + size, 0
                continue
            if carry == len(buf):  # a line longer than the buffer (but not than a row may be): grow it
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
                _offer_long_lines(check, view, line_starts, ends, first, source.max_chars)
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
    starts = np.concatenate(starts).astype(np.int64) if starts else np.zeros((0, 2), np.int64)
    return rows - first_row, rejects, starts, base, None


def _skip_long_line(source: PromptSource, f: BinaryIO, held: int, max_line: int, row: int) -> int:
    """Read past the rest of a line of which ``held`` bytes are in the buffer: its reject (an error unless
    on_bad_row=skip, as the per-line reader gives it); the line's length."""
    size = held
    while chunk := f.read(1 << 20):  # up to the newline, in bounded chunks: only the length is kept
        if (nl := chunk.find(b"\n")) >= 0:
            size += nl + 1
            f.seek(nl + 1 - len(chunk), os.SEEK_CUR)  # the next line is read from its start
            break
        size += len(chunk)
    long = LongLine()
    long.size, long.limit = size, max_line
    emit(source.path, row, row + 1, source.on_bad_row, parse_txt, long, max_chars=source.max_chars)
    return size


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
    if source.max_chars is not None:  # a line of more bytes may be too long: the exact check below counts characters
        suspect = suspect or bool((ends - line_starts > source.max_chars).any())
    top = arr[:end].max()
    clean = top < 128 or _utf8(block[:end])
    suspect = suspect or _odd_bytes(arr[:end], at_file_start, top >= 128)
    if clean and not suspect and not (at_file_start and block[:3] == BOM):
        return 0
    rejects = 0
    for i, (s, e) in enumerate(zip(line_starts.tolist(), ends.tolist())):
        raw = bytes(block[s:e])
        if at_file_start and i == 0 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        row = emit(source.path, first + i, first + i + 1, source.on_bad_row, parse_txt, raw,
                     max_chars=source.max_chars)
        rejects += row.reject is not None
    return rejects


def _odd_bytes(arr: np.ndarray, at_file_start: bool, non_ascii: bool) -> bool:
    """Whether ``arr`` may hold a byte parse_txt refuses inside a line: NUL, a CR not ending a line, a BOM
    past the file's start (then the block goes through the exact reader)."""
    if not arr[arr < 14].size:  # neither NUL nor CR (13): one cheap pass for almost every block
        return bool(non_ascii and _has_inner_bom(arr, at_file_start))
    if (arr == 0).any():
        return True
    cr = np.flatnonzero(arr == 13)
    after = cr + 1
    if (after >= len(arr)).any() or (arr[after[after < len(arr)]] != 10).any():
        return True
    return bool(non_ascii and _has_inner_bom(arr, at_file_start))


def _has_inner_bom(arr: np.ndarray, at_file_start: bool) -> bool:
    """Whether a UTF-8 BOM (EF BB BF) starts anywhere in ``arr`` but at the file's first byte."""
    at = np.flatnonzero(arr[:-2] == 0xEF) if len(arr) > 2 else np.empty(0, np.int64)
    at = at[(arr[at + 1] == 0xBB) & (arr[at + 2] == 0xBF)]
    return bool(len(at) > 1 or (len(at) == 1 and not (at_file_start and at[0] == 0)))


def _offer_long_lines(check: TruncationCheck, block: memoryview, line_starts: np.ndarray, ends: np.ndarray,
                      first: int, max_chars: int | None) -> None:
    for j in np.flatnonzero(ends - line_starts - 1 > check.min_bytes).tolist():
        if check.stop:
            return
        try:
            prompt = strip_eol(bytes(block[line_starts[j]:ends[j]])).decode("utf-8").lstrip("\ufeff")
        except UnicodeDecodeError:
            continue  # a reject, not a prompt
        if prompt.strip() and (max_chars is None or len(prompt) <= max_chars):  # too long: a reject, never tokenized
            check.offer(first + j, first + j + 1, prompt)


def _utf8(block) -> bool:
    try:
        str(block, "utf-8")
        return True
    except UnicodeDecodeError:
        return False


register_format(PromptFormat("txt", (".txt",), read_txt, _rows_at, fields=False,
                             scan=lambda *args: scan_txt(*args)))  # looked up at each call
