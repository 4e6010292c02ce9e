"""Planning scans: a prompt file's rows validated once and cut into shards, without keeping them; and
reading a planned shard's rows back from the file.

txt files go through a numpy block scan (newlines, UTF-8, a first-byte test for blank lines) with the
per-line reader only for a block that may hold a bad line; other formats through the reader. Both
start at any row (an extension plans only the rows appended since) and offer long prompts to the
truncation check (``prompts.on_truncation``).

Each shard's rows get a SHA-256 (``shard_digests``): of its bytes in the file (csv/tsv: after the header
line, which is hashed with them), of its parsed rows for parquet. A shard is read back only from bytes with
that digest, so a prompt file edited after planning, even to the same size, is refused before a changed
row is used; rows appended after the planned bytes change no digest (the run grows, see extend.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from shardgen.dataio.prompts import read as P
from shardgen.dataio.prompts.read import PromptSource
from shardgen.dataio.prompts.truncation import TruncationCheck
from shardgen.dataio.rundir.remote import StorageError, identity, is_url, open_input, sizeof


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


def planned_from_footer(source: PromptSource, check: TruncationCheck | None) -> bool:
    """Whether ``source`` is planned from its parquet footer alone, no row read: a remote parquet file with an ETag
    (which identifies its content in the fingerprint, so no pass hashes it), when planning needs nothing of its rows
    (no token count, no per-row settings). Its rows are then checked when their shard is read."""
    return (source.format == "parquet" and check is None and not source.row_rules and is_url(source.path)
            and bool(identity(source.path)["etag"]))


def footer_plan(source: PromptSource, per_shard: int) -> tuple[int, int, np.ndarray, int, None]:
    """(rows, rejects: 0, shard starts, the end row, no digests) of a parquet file from its footer's row count."""
    n = P.parquet_file(source.path).metadata.num_rows
    n = min(n, source.limit) if source.limit is not None else n
    first = np.arange(0, n, per_shard, dtype=np.int64)
    return n, 0, np.stack([first, first + 1], axis=1), n, None


def scan_rows(source: PromptSource, per_shard: int, check: TruncationCheck | None = None, first_row: int = 0,
              shapes: Counter | None = None, adapters: dict | None = None, image_rejects: dict | None = None
              ) -> tuple[int, int, np.ndarray, int, np.ndarray | None]:
    """Any format: every row through the reader (those before ``first_row`` planned already); shard starts
    from the rows' lines (parquet: row numbers). (rows, rejects, starts, where the planned rows end: a byte
    offset, parquet a row, the shards' digests: parquet only, of the rows read; text formats: None).
    ``shapes``: counts the valid rows per ``Shape`` (prompts.row_settings' sizes and frames) into it; ``adapters``:
    the LoRA files valid rows name (sha256 -> path) go into it; ``image_rejects``: the rows whose input image file is
    unusable (``image_problem``) go into it (row index -> reason; with prompts.on_bad_row=error the scan stops at the
    first, naming its file and line)."""
    rules = source.rules
    rows = P.read_prompts(source.path, format=source.format, field=source.field, seed_field=source.seed_field,
                          on_bad_row=source.on_bad_row, max_chars=source.max_chars, rules=source.rules)
    n = rejects = 0
    first_lines, hashers, stop_line = [], [], None
    parquet = source.format == "parquet"
    try:
        for row in rows:
            if source.limit is not None and row.index >= source.limit:
                stop_line = row.line
                break
            if row.index < first_row:
                continue
            if (row.index - first_row) % per_shard == 0:
                first_lines.append(row.line)
                if parquet:
                    hashers.append(hashlib.sha256())
            if parquet:
                hashers[-1].update(row_bytes(row))
            if image_rejects is not None and row.reject is None and (bad := image_problem(source, row)):
                image_rejects[str(row.index)] = bad  # the row read back stays as it is: the plan records its reject
                row = dataclasses.replace(row, reject=bad)
            rejects += row.reject is not None
            if shapes is not None and row.reject is None:
                shapes[rules.shape(row.settings)] += 1
            if adapters is not None and row.reject is None:
                adapters.update((lo.sha256, lo.path) for lo in row.settings.get("loras", ()))
            if check and row.reject is None and len(row.prompt.encode("utf-8")) > check.min_bytes:
                check.offer(row.index, row.line, row.prompt)
                if check.stop:
                    break
            n += 1
    except P.PromptFileError as e:
        if "has no rows" not in str(e):
            raise
    lines = np.asarray(first_lines, dtype=np.int64)
    if parquet:
        starts = np.stack([lines - 1, lines], axis=1) if n else np.zeros((0, 2), np.int64)
        return n, rejects, starts, first_row + n, digest_array([h.digest() for h in hashers])
    offsets = _line_offsets(source.path, np.append(lines, stop_line) if stop_line else lines)
    end = int(offsets[-1]) if stop_line else sizeof(source.path)
    return n, rejects, np.stack([offsets[:len(lines)], lines], axis=1), end, None


def image_problem(source: PromptSource, row: P.PromptRow) -> str | None:
    """Why ``row``'s input image file cannot be used (missing, a link, a directory, empty, too big: what a stat
    tells, no pixel decoded), None when it can or the row names none; raises PromptFileError (file:line) with
    prompts.on_bad_row=error."""
    from shardgen.models import condition

    image = row.settings.get("image")
    if image is None or image.path is None:
        return None
    try:
        condition.check_file(Path(image.path))
    except condition.BadImage as e:
        if source.on_bad_row == "error":
            raise P.fail(source.path, row.line, f"image: {e}", "Fix the row's image, or set prompts.on_bad_row=skip "
                         "to reject such rows and generate the others") from None
        return f"image: {e}"
    return None


def _line_offsets(path: str, lines: np.ndarray) -> np.ndarray:
    """Byte offset where each (1-based, increasing) line of ``lines`` starts."""
    out = np.zeros(len(lines), dtype=np.int64)
    if not len(lines):
        return out
    base = newlines = 0  # bytes and newlines before the current block
    with open_input(path) as f:
        while block := f.read(_BLOCK):
            nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            # line L starts after newline number L-1 (1-based)
            want = (lines >= newlines + 2) & (lines <= newlines + len(nl) + 1)
            out[want] = base + nl[lines[want] - 2 - newlines] + 1
            base, newlines = base + len(block), newlines + len(nl)
    return out


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
    max_line = P.max_line_bytes(source.max_chars)
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
    long = P.LongLine()
    long.size, long.limit = size, max_line
    P.emit(source.path, row, row + 1, source.on_bad_row, P.parse_txt, long, max_chars=source.max_chars)
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
    clean = arr[:end].max() < 128 or _utf8(block[:end])
    if clean and not suspect and not (at_file_start and block[:3] == P.BOM):
        return 0
    rejects = 0
    for i, (s, e) in enumerate(zip(line_starts.tolist(), ends.tolist())):
        raw = bytes(block[s:e])
        if at_file_start and i == 0 and raw.startswith(P.BOM):
            raw = raw[len(P.BOM):]
        row = P.emit(source.path, first + i, first + i + 1, source.on_bad_row, P.parse_txt, raw,
                     max_chars=source.max_chars)
        rejects += row.reject is not None
    return rejects


def _offer_long_lines(check: TruncationCheck, block: memoryview, line_starts: np.ndarray, ends: np.ndarray,
                      first: int, max_chars: int | None) -> None:
    for j in np.flatnonzero(ends - line_starts - 1 > check.min_bytes).tolist():
        if check.stop:
            return
        try:
            prompt = P.strip_eol(bytes(block[line_starts[j]:ends[j]])).decode("utf-8").lstrip("\ufeff")
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


# ---------------------------------------------------------------- shard digests

def row_bytes(row: P.PromptRow) -> bytes:
    """A parsed row as bytes, for the digest of a parquet shard (whose rows are not byte ranges of the file). A row's
    LoRA adapters count by content and scale, not by where the prompt file's folder put their paths (a run moves);
    its input image by the path as written (or the bytes' sha256)."""
    settings = row.settings
    if "loras" in settings:
        settings = dict(settings, loras=[[lo.sha256, lo.scale] for lo in settings["loras"]])
    if "image" in settings:  # the path as written, or the bytes' sha256 (parquet image bytes)
        settings = dict(settings, image=settings["image"].digest_key())
    fields = [row.prompt, row.seed, row.extra, row.reject] + ([settings] if settings else [])  # as before without
    return json.dumps(fields, sort_keys=True, ensure_ascii=False).encode() + b"\n"


def rows_digest(rows: list[P.PromptRow]) -> bytes:
    """The digest of a parquet shard's rows as read back (``row_bytes`` of each, in order)."""
    h = hashlib.sha256()
    for r in rows:
        h.update(row_bytes(r))
    return h.digest()


def digest_array(digests: list[bytes]) -> np.ndarray:
    """(shards, 32) uint8: the digests as plan/digests.npy stores them."""
    return np.frombuffer(b"".join(digests), np.uint8).reshape(-1, 32).copy()


def range_digests(path: str, starts: np.ndarray, end: int, head_end: int) -> np.ndarray:
    """sha256 of each shard's bytes of a text prompt file (shard k: from its start to the next one's, the last
    to ``end``), each after the file's bytes ``0..head_end`` (csv/tsv: the header line, as it names the columns;
    0 for txt and jsonl)."""
    offsets = [int(x) for x in starts[:, 0]] + [end]
    out = []
    with open_input(path) as f:
        head = f.read(head_end)
        f.seek(offsets[0])
        for lo, hi in zip(offsets, offsets[1:]):
            h, left = hashlib.sha256(head), hi - lo
            while left > 0 and (chunk := f.read(min(left, _BLOCK))):
                h.update(chunk)
                left -= len(chunk)
            out.append(h.digest())
    return digest_array(out)


# ---------------------------------------------------------------- reading a shard back

def check_unchanged(path: str, size: int) -> None:
    """The planned bytes are still there (appending is how a run grows, so a longer file is fine: the
    launch's fingerprint check hashes the content)."""
    try:
        now = sizeof(path)
    except StorageError:
        raise  # names the URL and why
    except OSError as e:
        raise P.fail(path, 0, f"the prompt file of this run cannot be read ({e.strerror})",
                     "Restore it: the run's shards are read from it") from None
    if now < size:
        raise P.fail(path, 0, f"the prompt file changed since the run was planned ({size} bytes then, {now} now)",
                     "Restore the original file, or start a new run_dir")


def check_etag(path: str, etag: str | None) -> None:
    """A remote prompt file still has the ETag it was planned with (None: not recorded, nothing to check)."""
    if etag is not None and is_url(path) and identity(path)["etag"] != etag:
        raise P.fail(path, 0, f"the prompt file changed since the run was planned (ETag {etag} then, "
                     f"{identity(path)['etag']} now)", "Restore the original object, or start a new run_dir")


def file_identity(path: str) -> tuple:
    """(size, mtime, inode) of a file (a remote one: size, ETag, modification time): equal before and after a scan
    when nothing wrote to it meanwhile."""
    if is_url(path):
        return tuple(identity(path).values())
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def read_range(path: str, head_end: int, lo: int, hi: int) -> tuple[bytes, BinaryIO, bytes]:
    """(bytes 0..head_end, a copy of bytes lo..hi, the SHA-256 of both) of the prompt file: the csv/tsv header, and
    a shard's rows, copied as they are hashed (what is parsed is what was hashed). The copy is in memory up to
    one block, on disk beyond: a shard holding a runaway line (a reject) stays within bounded memory."""
    import tempfile

    copy = tempfile.SpooledTemporaryFile(max_size=_BLOCK)
    with open_input(path) as f:
        head = f.read(head_end)
        h = hashlib.sha256(head)
        f.seek(lo)
        left = max(0, hi - lo)
        while left > 0 and (chunk := f.read(min(left, _BLOCK))):
            h.update(chunk)
            copy.write(chunk)
            left -= len(chunk)
    copy.seek(0)
    return head, copy, h.digest()


def read_rows_at(src: PromptSource, offset: int, line: int, index: int, count: int, data: BinaryIO | None = None,
                  head: bytes | None = None) -> Iterator[P.PromptRow]:
    """``count`` rows from row ``index``, which starts at byte ``offset`` (parquet: row) and ``line``; read from
    ``data`` (the shard's bytes, with ``head`` the file's bytes before the first row) when given, else the file."""
    if src.format == "parquet":
        yield from parquet_rows_at(src, index, count)
        return
    with contextlib.ExitStack() as stack:
        if data is None:
            data = stack.enter_context(open_input(src.path))
            data.seek(offset)
        if src.format in ("csv", "tsv"):
            yield from _table_rows_at(src, data, line, index, count, head)
            return
        parse = P.parse_txt if src.format == "txt" else P.parse_jsonl
        args = () if src.format == "txt" else (src.field, src.seed_field, src.rules)
        for i in range(count):
            raw = P.read_line(data, P.max_line_bytes(src.max_chars))
            if offset == 0 and i == 0 and raw.startswith(P.BOM):
                raw = raw[len(P.BOM):]
            yield P.emit(src.path, index + i, line + i, src.on_bad_row, parse, raw, *args, max_chars=src.max_chars)


class _HeaderThen:
    """A header line, then the lines of a file: what the bounded line reader (``P.read_line``) reads."""

    def __init__(self, header: bytes, f: BinaryIO):
        self._header, self._f = header, f

    def readline(self, size: int = -1) -> bytes:
        if self._header is not None:
            header, self._header = self._header, None
            return header
        return self._f.readline(size)


def _table_rows_at(src: PromptSource, f, line: int, index: int, count: int,
                   head: bytes | None = None) -> Iterator[P.PromptRow]:
    """csv/tsv records from ``f``'s position: the prompt reader, given the header line then the rest."""
    from itertools import islice

    if head is not None:
        header = next(P.raw_lines(io.BytesIO(head)))[1]
    else:
        with open_input(src.path) as h:
            header = next(P.raw_lines(h))[1]
    # the reader numbers the header line 1 and this shard's first record line 2
    for r in islice(P.read_table(src.path, _HeaderThen(header, f), src.format, src.field, src.seed_field,
                                 src.on_bad_row, src.max_chars, src.rules), count):
        yield P.PromptRow(r.index + index, r.line + line - 2, r.prompt, r.seed, r.extra, r.reject, r.settings)


def parquet_rows_at(src: PromptSource, index: int, count: int) -> Iterator[P.PromptRow]:
    """``count`` rows of a parquet prompt file from row ``index`` (only the row groups that hold them are read)."""
    pf = P.parquet_file(src.path)
    row_groups, first, pos = [], 0, 0  # the row groups that hold rows index..index+count-1
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if pos + n > index and pos < index + count:
            first = pos if not row_groups else first
            row_groups.append(g)
        pos += n
    table = pf.read_row_groups(row_groups).slice(index - first, count)
    for i, rec in enumerate(table.to_pylist()):
        yield P.emit(src.path, index + i, index + i + 1, src.on_bad_row, P.parse_parquet, rec, src.field,
                     src.seed_field, src.rules, max_chars=src.max_chars)
