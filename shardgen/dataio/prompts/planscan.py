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
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from shardgen.dataio.prompts import read as P
from shardgen.dataio.prompts.formats import prompt_format
from shardgen.dataio.prompts.read import PromptSource
from shardgen.dataio.prompts.truncation import TruncationCheck
from shardgen.dataio.rundir.remote import StorageError, identity, is_url, open_input, sizeof


log = logging.getLogger("shardgen.plan")
_BLOCK = 16 << 20   # bytes read at a time (line offsets, shard ranges)


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
    return (prompt_format(source.format).count_rows is not None and check is None and not source.row_rules
            and is_url(source.path) and bool(identity(source.path)["etag"]))


def footer_plan(source: PromptSource, per_shard: int) -> tuple[int, int, np.ndarray, int, None]:
    """(rows, rejects: 0, shard starts, the end row, no digests) of a parquet file from its footer's row count."""
    n = prompt_format(source.format).count_rows(source.path)
    n = min(n, source.limit) if source.limit is not None else n
    first = np.arange(0, n, per_shard, dtype=np.int64)
    return n, 0, np.stack([first, first + 1], axis=1), n, None


LORAS = "loras"
LORA_REJECTS = "rejects"
"""The key under ``adapters`` (scan_rows) of the rows rejected for their adapters while planning (index -> reason)."""


def scan_rows(source: PromptSource, per_shard: int, check: TruncationCheck | None = None, first_row: int = 0,
              shapes: Counter | None = None, adapters: dict | None = None, image_rejects: dict | None = None,
              samples: list | None = None, images: int = 1) -> tuple[int, int, np.ndarray, int, np.ndarray | None]:
    """Any format: every row through the reader (those before ``first_row`` planned already); shard starts
    from the rows' lines (parquet: row numbers). (rows, rejects, starts, where the planned rows end: a byte
    offset, parquet a row, the shards' digests: parquet only, of the rows read; text formats: None).
    ``shapes``: counts the valid rows per ``Shape`` (prompts.row_settings' sizes and frames) into it; ``adapters``:
    the LoRA files valid rows name (sha256 -> path) go into it, and under LORA_REJECTS the rows rejected for
    their adapters (row index -> reason); ``image_rejects``: the rows whose input image file is
    unusable (``image_problem``) go into it (row index -> reason; with prompts.on_bad_row=error the scan stops at the
    first, naming its file and line); ``samples``: each shard's samples are appended to it, its rows' own
    ``images_per_prompt`` (prompts.row_settings) or ``images``."""
    rules = source.rules
    rows = P.read_prompts(source.path, format=source.format, field=source.field, seed_field=source.seed_field,
                          on_bad_row=source.on_bad_row, max_chars=source.max_chars, rules=source.rules)
    n = rejects = 0
    first_lines, hashers, stop_line = [], [], None
    parquet = not prompt_format(source.format).lines  # numbered rows, hashed as read
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
                if samples is not None:
                    samples.append(0)
            if samples is not None:
                samples[-1] += row_images(row.settings, images)
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
            elif adapters is not None and row.reject.startswith(f"{LORAS}:"):
                adapters.setdefault(LORA_REJECTS, {})[str(row.index)] = row.reject  # a file read back later may differ
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


def row_images(settings: dict, images: int) -> int:
    """The samples of a row whose own settings are ``settings``: its images_per_prompt, else the run's ``images``
    (a rejected row's too: each of its samples is recorded as rejected)."""
    return int(settings.get("images_per_prompt", images))


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
    """``count`` rows from row ``index``, which starts at byte ``offset`` (a format without lines: row) and ``line``;
    read from ``data`` (the shard's bytes, with ``head`` the file's bytes before the first row) when given, else the
    file (its format's ``rows_at``)."""
    fmt = prompt_format(src.format)
    with contextlib.ExitStack() as stack:
        if data is None and fmt.lines:
            data = stack.enter_context(open_input(src.path))
            data.seek(offset)
        yield from fmt.rows_at(src, data, offset, line, index, count, head)
