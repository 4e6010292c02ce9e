"""What a model directory holds, as one SHA-256: the fingerprint's ``model.sha256``.

A model's name and revision say which model was asked for, not which bytes were read: a bit flip in a cached
file, or weights replaced in place between two launches, would let a resume mix two models. The content hash is
computed once per model directory and kept in the shardgen cache (``hashes/``) with each file's size, mtime,
ctime and inode; a later launch stats the files and re-hashes only those whose identity changed (ctime cannot be
set back by tools that preserve mtime, so any write shows).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("shardgen")
RECORD_VERSION = 1
_CHUNK = 1 << 20


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def model_files(directory: Path) -> list[Path]:
    """Every regular file of a model directory (hidden names, like caches of other tools, left out), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / f for f in filenames if not f.startswith(".") and os.path.isfile(os.path.join(dirpath, f))]
    return sorted(out)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record_path(directory: Path, cache_root: Path) -> Path:
    """Where the content record of ``directory`` is kept: under the cache, named by the directory's real path."""
    key = hashlib.sha256(os.path.realpath(directory).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return Path(cache_root) / "hashes" / f"{key}.json"


def _read_record(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            rec = json.loads(f.read(1 << 24))
        if isinstance(rec, dict) and rec.get("version") == RECORD_VERSION and isinstance(rec.get("files"), dict):
            return rec["files"]
    except (OSError, ValueError):
        pass
    return {}


def changed_files(directory: Path, cache_root: Path) -> list[str] | None:
    """The files of ``directory`` whose identity differs from its content record (added, removed or written since
    it was hashed); None when there is no record yet."""
    known = _read_record(record_path(directory, cache_root))
    if not known:
        return None
    now = {str(p.relative_to(directory)): _identity(p.stat()) for p in model_files(directory)}
    return sorted(k for k in set(now) | set(known) if now.get(k) != (known.get(k) or [None])[:4])


def content_sha256(directory: str | os.PathLike, cache_root: str | os.PathLike) -> str:
    """SHA-256 over every file of ``directory`` (names and bytes); files unchanged since the record was made are not
    read again. The record is rewritten when anything was hashed; an unwritable cache only costs the re-hash."""
    directory = Path(directory)
    path = record_path(directory, Path(cache_root))
    known = _read_record(path)
    files, total, hashed = {}, hashlib.sha256(), 0
    for p in model_files(directory):
        rel = str(p.relative_to(directory))
        ident = _identity(p.stat())  # before reading: a write while hashing changes it, so it never matches later
        old = known.get(rel)
        if isinstance(old, list) and len(old) == 5 and old[:4] == ident and isinstance(old[4], str):
            digest = old[4]
        else:
            digest, hashed = _file_sha256(p), hashed + 1
        files[rel] = [*ident, digest]
        total.update(f"{rel}\0{digest}\n".encode("utf-8", "surrogateescape"))
    if hashed or set(known) != set(files):
        _write_record(path, directory, files)
    return total.hexdigest()


def _write_record(path: Path, directory: Path, files: dict) -> None:
    """Replace the record atomically (a temp file renamed over it: a reader sees the old or the new one). It is
    advisory, so a failed write only means hashing again next launch."""
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(dict(version=RECORD_VERSION, directory=str(directory), files=files), f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.debug("cannot keep the content hash of %s in %s (%s); it is computed again next launch", directory, path, e)
