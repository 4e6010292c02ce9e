"""Where a run's small files live: the run directory (``DirFiles``) or a bucket (``BucketFiles``).

The owner record, the fingerprint and its change log, the plan and its digests, the prompt file's hash, config.yaml,
summary.json, launches.jsonl, output_uri.json and the shards' done markers are read and written through one
interface, ``RunFiles``, so a run whose files are objects of a bucket (``s3://bucket/prefix``) is coordinated like
one in a shared directory. A file is named by its path in the run directory (``RunDir``'s paths); a bucket keeps it
under the same relative name below its prefix.

``DirFiles`` is fileio.py's functions unchanged: whole-file atomic replaces, exclusive creates (first creator wins),
never a write through a symlink. ``BucketFiles``: PutObject replaces atomically, ``If-None-Match: *`` creates only
if absent, ``If-Match: <ETag>`` replaces only if unchanged; transient errors are retried (bucket.py).
"""

from __future__ import annotations

import functools
import os
import random
import time
from pathlib import Path
from typing import Any, Protocol

from shardgen.dataio.rundir.bucket import CONFLICT, MISSING, REFUSED, Bucket, split_url
from shardgen.dataio.rundir.fileio import (MAX_RUN_FILE_BYTES, append_line, atomic_write_bytes, create_exclusive,
                                           parse_state, read_regular, read_state, too_large)
from shardgen.dataio.rundir.remote import StorageError, public_url

APPEND_TRIES = 20  # conditional replaces one line's append makes before giving up (writers: one a launch)


class RunFiles(Protocol):
    """What the run's readers and writers need of where its small files live."""

    def where(self, path: Path) -> str:
        """The file's path or URL, for messages."""
        ...

    def read(self, path: Path, limit: int = MAX_RUN_FILE_BYTES) -> bytes | None:
        """The file's bytes; None when it does not exist; RunDirError when it holds more than ``limit``."""
        ...

    def read_versioned(self, path: Path) -> tuple[bytes | None, str | None]:
        """(the file's bytes, its version for ``replace_if``); (None, None) when it does not exist."""
        ...

    def version(self, path: Path) -> str | None:
        """What changes whenever the file is replaced (None: it does not exist), without reading it."""
        ...

    def state(self, path: Path, required: dict[str, type] | None = None) -> Any:
        """The run-state JSON file (fileio.read_state's checks and messages: missing, empty, not JSON, a required
        key missing), RunDirError naming the file."""
        ...

    def create(self, path: Path, data: bytes) -> bool:
        """Create the file holding ``data`` only if nothing is there; False when something is (of racing creators
        exactly one gets True)."""
        ...

    def replace(self, path: Path, data: bytes) -> None:
        """Write the file whole: readers see the old bytes or the new ones, never a part."""
        ...

    def replace_if(self, path: Path, data: bytes, version: str | None) -> bool:
        """``replace`` only while the file is at ``version`` (``read_versioned``'s; None: only while absent);
        False when it changed."""
        ...

    def append(self, path: Path, line: str) -> None:
        """Add ``line`` (one JSON record) to the log-like file at ``path`` as its last line (creating it)."""
        ...

    def exists(self, path: Path) -> bool:
        """Whether the file exists (locally: a regular file, or a link to one)."""
        ...

    def present(self, path: Path) -> bool:
        """Whether anything is at the file's name (locally: a dangling symlink too)."""
        ...

    def names(self, folder: Path) -> list[str]:
        """The names of the files directly in ``folder`` ([] when there is none)."""
        ...

    def signatures(self, folder: Path) -> dict[str, tuple[int, int]]:
        """Name -> (size, modification time in ns) of the files directly in ``folder``, from one listing."""
        ...

    def delete(self, path: Path) -> None:
        """Remove the file, if there."""
        ...


class DirFiles:
    """A run's files in its directory, through fileio.py (a POSIX directory, NFS or Lustre)."""

    def where(self, path: Path) -> str:
        """The path itself."""
        return str(path)

    def read(self, path: Path, limit: int = MAX_RUN_FILE_BYTES) -> bytes | None:
        """``read_regular`` (a regular file, or a link to one, as ``read_json`` reads it)."""
        try:
            return read_regular(path, limit=limit)
        except FileNotFoundError:
            return None

    def read_versioned(self, path: Path) -> tuple[bytes | None, str | None]:
        """The version taken before the bytes: a replace in between makes it stale, never too new."""
        version = self.version(path)
        data = self.read(path) if version is not None else None
        return (data, version) if data is not None else (None, None)

    def version(self, path: Path) -> str | None:
        """Inode, mtime and size: a replace (a new inode by rename) changes it."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"

    def state(self, path: Path, required: dict[str, type] | None = None) -> Any:
        """``read_state`` (a symlink is refused)."""
        return read_state(path, required)

    def create(self, path: Path, data: bytes) -> bool:
        """``create_exclusive``: written under a temp name, hard-linked into place."""
        return create_exclusive(path, data)

    def replace(self, path: Path, data: bytes) -> None:
        """``atomic_write_bytes``: a temp file renamed over the name (a symlink there is replaced, not followed)."""
        atomic_write_bytes(path, data)

    def replace_if(self, path: Path, data: bytes, version: str | None) -> bool:
        """A check, then the replace or create: a POSIX directory has no conditional rename, so a writer between
        the two is not seen. Callers that race rely on ``create`` alone."""
        if version is None:
            return self.create(path, data)
        if self.version(path) != version:
            return False
        self.replace(path, data)
        return True

    def append(self, path: Path, line: str) -> None:
        """``append_line``: one O_APPEND write, durably."""
        append_line(path, line)

    def exists(self, path: Path) -> bool:
        """``Path.exists`` (follows a link)."""
        return Path(path).exists()

    def present(self, path: Path) -> bool:
        """``os.path.lexists``."""
        return os.path.lexists(path)

    def names(self, folder: Path) -> list[str]:
        """One listing of the folder."""
        try:
            return os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def signatures(self, folder: Path) -> dict[str, tuple[int, int]]:
        """os.scandir with each entry's lstat ({} for a missing folder)."""
        try:
            with os.scandir(folder) as entries:
                return {e.name: (st.st_size, st.st_mtime_ns) for e in entries
                        if e.is_file(follow_symlinks=False) and (st := e.stat(follow_symlinks=False))}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def delete(self, path: Path) -> None:
        """Unlink (a link itself, never its target)."""
        Path(path).unlink(missing_ok=True)


class BucketFiles(Bucket):
    """A run's files as objects ``<prefix>/<name in the run directory>`` of an S3 bucket (``s3://bucket/prefix``);
    ``root``: the run directory whose paths name them. The version of an object is its ETag."""

    read_limit = MAX_RUN_FILE_BYTES

    def __init__(self, url: str, root: Path):
        bucket, self.prefix = split_url(url, "run files in a bucket")
        super().__init__(bucket)
        self.root = Path(root)

    def key(self, path: Path) -> str:
        """The object key of the run file at ``path``."""
        return self.prefix + Path(path).relative_to(self.root).as_posix()

    def where(self, path: Path) -> str:
        """The object's URL."""
        return public_url(f"s3://{self.bucket}/{self.key(path)}")

    def read(self, path: Path, limit: int = MAX_RUN_FILE_BYTES) -> bytes | None:
        """GetObject."""
        data = self.read_versioned(path)[0]
        if data is not None and len(data) > limit:
            raise too_large(self.where(path), len(data), limit)
        return data

    def read_versioned(self, path: Path) -> tuple[bytes | None, str | None]:
        """GetObject: its bytes and ETag; RunDirError when larger than any run file (not read into memory)."""
        key = self.key(path)
        resp = self.retried(f"reading {key}", key, lambda: self.get(key))
        if not isinstance(resp, dict):
            return None, None
        if resp["Body"] is None:
            raise too_large(self.where(path), int(resp.get("ContentLength") or 0), self.read_limit)
        return resp["Body"], resp["ETag"]

    def version(self, path: Path) -> str | None:
        """HeadObject's ETag."""
        key = self.key(path)
        resp = self.retried(f"looking for {key}", key, lambda: self.send("head_object", key, (MISSING,)))
        return resp["ETag"] if isinstance(resp, dict) else None

    def state(self, path: Path, required: dict[str, type] | None = None) -> Any:
        """``parse_state`` of the object's bytes, naming its URL."""
        return parse_state(self.where(path), self.read(path), required)

    def create(self, path: Path, data: bytes) -> bool:
        """PutObject with If-None-Match: *."""
        key = self.key(path)
        return self.create_object(key, data, key) is not None

    def replace(self, path: Path, data: bytes) -> None:
        """PutObject (an object appears whole or not at all)."""
        key = self.key(path)
        self.retried(f"writing {key}", key, lambda: self.send("put_object", key, (), Body=data))

    def replace_if(self, path: Path, data: bytes, version: str | None) -> bool:
        """PutObject with If-Match: ``version`` (None: If-None-Match: *); a 412, 409 or 404 means it changed."""
        if version is None:
            return self.create(path, data)
        key = self.key(path)
        return self.put_once(key, data, f"replacing {key}", (REFUSED, CONFLICT, MISSING), IfMatch=version) is not None

    def append(self, path: Path, line: str) -> None:
        """GetObject, then PutObject of its bytes and ``line`` with If-Match (If-None-Match: * when absent), again
        while another writer changed it in between. One object per file, not one per entry: its readers (the run's
        and a person's) read one file as in a run directory, and these files take a line per launch, so writers
        rarely race; StorageError when they kept racing past APPEND_TRIES."""
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        for attempt in range(APPEND_TRIES):
            old, version = self.read_versioned(path)
            if self.replace_if(path, (old or b"") + data, version):
                return
            time.sleep(random.uniform(0, 0.05 * (attempt + 1)))  # apart, so racing writers stop colliding
        raise StorageError(f"{self.where(path)}: other writers kept replacing it while a line was added "
                           f"({APPEND_TRIES} tries); re-run")

    def exists(self, path: Path) -> bool:
        """HeadObject."""
        return self.version(path) is not None

    def present(self, path: Path) -> bool:
        """HeadObject (a bucket has no links)."""
        return self.exists(path)

    def names(self, folder: Path) -> list[str]:
        """ListObjectsV2 under the folder's prefix, without what is in folders below it."""
        prefix = self.key(folder).rstrip("/") + "/" if Path(folder) != self.root else self.prefix
        return [n for n in self.list_names(prefix, prefix) if "/" not in n]

    def signatures(self, folder: Path) -> dict[str, tuple[int, int]]:
        """Name -> (size, LastModified in ns) of the objects directly in ``folder``, from one listing (what a
        run directory's stat of each file gives its readers' caches)."""
        prefix = self.key(folder).rstrip("/") + "/"
        return {o["Key"][len(prefix):]: (int(o["Size"]), int(o["LastModified"].timestamp() * 1e9))
                for o in self.list_objects(prefix, prefix) if "/" not in o["Key"][len(prefix):]}

    def delete(self, path: Path) -> None:
        """DeleteObject (a missing object is no error)."""
        key = self.key(path)
        self.retried(f"removing {key}", key, lambda: self.send("delete_object", key, (MISSING,)))


DIR_FILES = DirFiles()


@functools.lru_cache(maxsize=16)
def bucket_files(url: str, root: Path) -> BucketFiles:
    """The files of the run at ``root`` kept in the bucket ``url`` (one store per run and process: its request
    counts and client are shared)."""
    return BucketFiles(url, Path(root))
