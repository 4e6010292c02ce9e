"""Shard files: a partial tar grown batch by batch, durably checkpointed, committed by rename.

Members are written with the standard library's tar headers (``tarfile.TarInfo.tobuf``), one
512-byte-aligned member after another, without the end-of-archive blocks until commit. So the
file, cut at any checkpointed byte offset, is a valid tar prefix: resuming truncates back to the
last checkpoint and appends. (webdataset's TarWriter streams through ``tarfile`` and cannot
reopen a file at an offset, hence this small writer; readers stay webdataset's.)
"""

from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path

BLOCK = tarfile.BLOCKSIZE  # 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


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
    """An append-only tar under construction at ``path``."""

    def __init__(self, path: Path, resume_bytes: int = 0):
        self.path = Path(path)
        self._f = open(self.path, "r+b" if self.path.exists() else "w+b")
        self._f.truncate(resume_bytes)  # drop anything written after the last checkpoint
        self._f.seek(resume_bytes)
        self.bytes = resume_bytes

    def append(self, members: list[tuple[str, bytes]]) -> None:
        """Append members (name, data) in order."""
        now = time.time()
        blob = b"".join(tar_member(name, data, now) for name, data in members)
        self._f.write(blob)
        self.bytes += len(blob)

    def sync(self) -> int:
        """Flush and fsync; return the durable byte length (a checkpoint offset)."""
        self._f.flush()
        os.fsync(self._f.fileno())
        return self.bytes

    def commit(self, final: Path) -> None:
        """Close the archive and atomically rename it to ``final``."""
        self._f.write(END_OF_ARCHIVE)
        self.sync()
        self._f.close()
        os.replace(self.path, final)
        fsync_dir(Path(final).parent)

    def close(self) -> None:
        """Close without committing (the partial stays for a later resume)."""
        if not self._f.closed:
            self._f.close()


def copy_prefix(src: Path, dst: Path, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``src`` to a new file ``dst`` (adopting another claim's partial).

    A copy, not a rename: the previous holder may be a live but stalled process that still has
    the old file open, and must not be able to write into the new holder's shard.
    """
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        left = nbytes
        while left > 0:
            block = fi.read(min(left, 1 << 24))
            if not block:
                raise IOError(f"{src} is shorter than its checkpoint ({nbytes} bytes)")
            fo.write(block)
            left -= len(block)
        fo.flush()
        os.fsync(fo.fileno())
