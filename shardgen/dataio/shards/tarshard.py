"""Shard files: a partial tar grown batch by batch, durably checkpointed, committed by rename.

Members are written with the standard library's tar headers (``tarfile.TarInfo.tobuf``), one
512-byte-aligned member after another, without the end-of-archive blocks until commit. So the
file, cut at any checkpointed byte offset, is a valid tar prefix: resuming copies the prefix up
to the last checkpoint and appends. The SHA-256 of the bytes written so far is kept as they are
written, so a checkpoint (and a committed shard's stats) record what the bytes must hash to, and
a resume verifies the prefix before it trusts it. (webdataset's TarWriter streams through
``tarfile`` and cannot reopen a file at an offset, hence this small writer; readers stay webdataset's.) ``read_tar_members`` reads a committed shard back for the
tools, the resume of a rewritten shard and the benchmark.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from shardgen.dataio.rundir.fileio import open_fresh, open_regular
from shardgen.dataio.rundir.storage import disk_full

BLOCK = tarfile.BLOCKSIZE  # 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
# Every member's mtime: a fixed time (2020-01-01 UTC), not the time of writing, so the same samples always make
# the same tar bytes, whether the run was interrupted and resumed or not (as reproducible builds fix theirs).
MEMBER_MTIME = 1577836800


def tar_member(name: str, data: bytes, mtime: float) -> bytes:
    """One tar member (header + data + padding) as bytes."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(mtime)
    info.mode = 0o644
    pad = (-len(data)) % BLOCK
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict") + data + b"\0" * pad


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PartialTar:
    """An append-only tar under construction at ``path``: a fresh file (never written through a
    symlink), optionally starting with a verified copy of another partial's first bytes."""

    def __init__(self, path: Path, prefix_of: Path | None = None, prefix_bytes: int = 0,
                 prefix_sha256: str | None = None):
        self.path = Path(path)
        self._sha = hashlib.sha256()
        self._f = os.fdopen(open_fresh(self.path), "w+b")
        self.bytes = 0
        if prefix_of is not None and prefix_bytes:
            try:
                self._copy_prefix(Path(prefix_of), prefix_bytes, prefix_sha256)
            except BaseException:
                self.discard()
                raise

    def _copy_prefix(self, src: Path, nbytes: int, want_sha: str | None) -> None:
        """Copy (not rename: a stalled previous holder may still write into its own file) and hash."""
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)  # a symlinked partial is not ours: ELOOP
        with os.fdopen(fd, "rb") as fi:
            left = nbytes
            while left > 0:
                block = fi.read(min(left, 1 << 24))
                if not block:
                    raise ValueError(f"{src} is shorter than its checkpoint ({nbytes} bytes)")
                self._write(block)
                left -= len(block)
        if want_sha != self._sha.hexdigest():
            raise ValueError(f"{src}: its first {nbytes} bytes do not match the sha256 of its checkpoint")
        self.sync()

    def _write(self, blob: bytes) -> None:
        try:
            self._f.write(blob)
        except OSError as e:
            raise (disk_full(e, self.path, len(blob)) or e) from None
        self._sha.update(blob)
        self.bytes += len(blob)

    @property
    def sha256(self) -> str:
        """SHA-256 of the bytes written so far."""
        return self._sha.hexdigest()

    def append(self, members: list[tuple[str, bytes]]) -> None:
        """Append members (name, data) in order (each with MEMBER_MTIME)."""
        self._write(b"".join(tar_member(name, data, MEMBER_MTIME) for name, data in members))

    def sync(self) -> int:
        """Flush and fsync; return the durable byte length (a checkpoint offset)."""
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise (disk_full(e, self.path) or e) from None
        return self.bytes

    def finish(self) -> None:
        """Close the archive (end-of-archive blocks), durably; the file stays at ``path``."""
        self._write(END_OF_ARCHIVE)
        self.sync()
        self._f.close()

    def close(self) -> None:
        """Close without committing (the partial stays for a later resume)."""
        if not self._f.closed:
            self._f.close()

    def discard(self) -> None:
        """Close and delete the partial."""
        self.close()
        self.path.unlink(missing_ok=True)


@dataclass
class ShardScan:
    """What a walk over a (partial or committed) shard file found (the scan of every container)."""

    samples: list[dict] = field(default_factory=list)  # each whole sample's json, in order
    end: int = 0              # byte offset just after the last whole sample
    complete: bool = False    # the container is closed after the last sample
    closed_end: int = 0       # with ``complete``: the byte offset just after the closing (a whole file's size)
    problem: str | None = None



def scan_tar(path: Path, keys: list[str], limit: int | None = None) -> ShardScan:
    """Walk the members of ``path`` (up to ``limit`` bytes): whole samples in the order ``keys``
    gives them (image, txt, then json last, as the writer writes them); where and why it stops."""
    scan = ShardScan()
    size = os.lstat(path).st_size if limit is None else limit
    with open_regular(path, follow=False) as f:
        pos, current = 0, None
        while pos + BLOCK <= size:
            f.seek(pos)
            head = f.read(BLOCK)
            if head == b"\0" * BLOCK:
                scan.complete = current is None and f.read(BLOCK) == b"\0" * BLOCK and pos == scan.end
                scan.closed_end = pos + 2 * BLOCK if scan.complete else 0
                break
            try:
                f.seek(pos)
                info = tarfile.TarInfo.fromtarfile(_Reader(f))
            except (tarfile.TarError, ValueError, UnicodeError, OSError) as e:
                scan.problem = f"no valid tar header at byte {pos} ({e})"
                break
            next_pos = info.offset_data + info.size + (-info.size) % BLOCK
            if next_pos > size:
                scan.problem = f"member {info.name} runs past byte {size}"
                break
            key, _, ext = info.name.partition(".")
            n = len(scan.samples)
            if n >= len(keys) or key != keys[n]:
                scan.problem = f"unexpected member {info.name} (sample {n} should be {keys[n] if n < len(keys) else 'none'})"
                break
            current, pos = key, next_pos
            if ext == "json":
                f.seek(info.offset_data)
                try:
                    meta = json.loads(f.read(info.size))
                    if not isinstance(meta, dict) or meta.get("status") not in ("ok", "failed", "rejected") \
                            or not isinstance(meta.get("index"), int):
                        raise ValueError("no status or index")
                except ValueError as e:
                    scan.problem = f"sample {key}: bad json ({e})"
                    break
                scan.samples.append(meta)
                scan.end, current = pos, None
    return scan


class _Reader:
    """The minimal file interface ``TarInfo.fromtarfile`` uses (pax headers read their extension)."""

    def __init__(self, f):
        self.fileobj, self.offset, self.pax_headers = f, f.tell(), {}
        self.encoding, self.errors = "utf-8", "surrogateescape"


def read_tar_members(path) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes} of one tar, a path or a file object (raises on an unreadable tar)."""
    samples: dict[str, dict[str, bytes]] = defaultdict(dict)
    if isinstance(path, (str, os.PathLike)):
        with open_regular(path) as f:
            return read_tar_members(f)
    with tarfile.open(fileobj=path) as tf:
        for m in tf:
            if not m.isfile():
                continue
            key, _, ext = m.name.partition(".")
            if ext in samples[key]:
                raise ValueError(f"{path}: member {m.name} appears twice")
            samples[key][ext] = tf.extractfile(m).read()
    return samples

