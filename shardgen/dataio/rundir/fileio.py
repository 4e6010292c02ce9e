"""Atomic file I/O for run files, which other processes read and which may be anything on the next launch.

Every file other processes may read is written whole: temp file, fsync, atomic rename (``atomic_write_bytes``,
``atomic_write_json``), or created exclusively (``create_exclusive``, ``open_fresh``). That holds on NFS and Lustre,
where rename within a directory is atomic. Nothing is ever written through a symlink: new files are created with
O_EXCL (which never follows one) and renamed over the old name (which replaces a link, not its target). Reads open
regular files only, without blocking on a FIFO (``open_regular``, ``read_state``), and many small reads run on
threads (``map_io``). Temp files are named ``.<name>~<host>~<pid>~<random>.tmp`` (``TEMP_FILE_NAME``), so clean-up
can tell whose they are (``temp_owner``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable

from shardgen.dataio.rundir.liveness import host_name
from shardgen.dataio.rundir.storage import RunDirError, disk_full


TMP_SEP = "~"          # temp names: .<name>~<host>~<pid>~<random>.tmp (the owner can be checked)


# the only names clean-up may remove: what shardgen's own writers and planners create
TEMP_FILE_NAME = re.compile(r"\.[^~/]+~[^~/]+~[0-9]+~[A-Za-z0-9_]+\.tmp")


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _tmp_prefix(name: str) -> str:
    return f".{name}{TMP_SEP}{host_name()}{TMP_SEP}{os.getpid()}{TMP_SEP}"


def temp_path(path: Path) -> Path:
    """An unused temp name next to ``path`` in shardgen's pattern (``TEMP_FILE_NAME``), for writers that open
    files by name (pyarrow): nothing exists there, so nothing is written through a link."""
    import secrets

    path = Path(path)
    return path.with_name(f"{_tmp_prefix(path.name)}{secrets.token_hex(4)}.tmp")


def atomic_write_bytes(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Write ``data`` (bytes, or chunks of it written as they come) to ``path`` so readers see the old file or the
    whole new one, never a part.

    The temp file is created fresh (O_EXCL) and renamed over ``path``: a symlink at ``path`` is
    replaced, never written through."""
    path = Path(path)
    chunks = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    written = 0
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path.name), suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; run files are meant to be shared
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                written += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and (full := disk_full(e, path, len(data) if chunks is not data else written)):
            raise full from None
        raise


def json_bytes(obj: Any) -> bytes:
    """Standard JSON (no NaN/Infinity), indented, keys sorted: the form of every run-state file."""
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    atomic_write_bytes(path, json_bytes(obj))


def create_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` whole, only if nothing (not even a symlink) is there; False if
    something is. The content is written under a temp name and hard-linked into place, so a reader
    never sees a partial file and of two racing creators exactly one wins (link is atomic on NFS too)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path.name), suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            return create_new(path, data)  # filesystems without hard links
        return True
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def create_new(path: str | os.PathLike, data: bytes, mode: int = 0o666) -> bool:
    """Create ``path`` holding ``data`` (fsynced) with O_EXCL, which never follows a symlink; False if something is
    there. Of two racing creators exactly one wins (on NFSv3+ and Lustre too), but a reader may see the file before
    its bytes: ``create_exclusive`` when it must not."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return True


def open_fresh(path: Path) -> int:
    """A new empty file at ``path`` opened read-write, never through a symlink: whatever is at
    ``path`` (a stale file, or a link planted there) is unlinked first; the caller owns the name."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


class NotRegularFileError(RunDirError, OSError):
    """A run file that is a FIFO, a device, a socket or a directory: never read (reading a FIFO blocks until
    someone writes into it). An OSError too, so readers that skip an unreadable file skip it."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink"))


def open_regular(path: str | os.PathLike, *, follow: bool = True, buffering: int = -1) -> BinaryIO:
    """``path`` opened for reading, only if it is a regular file: the one way run files are opened for reading.

    The open never blocks (O_NONBLOCK: a FIFO opens at once and is refused by its type); ``follow=False`` refuses
    a symlink too (O_NOFOLLOW). NotRegularFileError names the file, what it is and the fix; a missing file raises
    FileNotFoundError as ``open`` does."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise NotRegularFileError(f"{path} is a symlink; run files must be regular files. Delete the link "
                                      "(the next launch repairs what it can)") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
            raise NotRegularFileError(f"{path} is {kind}, not a regular file, so it is not read (a FIFO would block "
                                      "the reader). Move it away and put the file it should be there (in a run "
                                      "directory: the next launch repairs what it can)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


MAX_RUN_FILE_BYTES = 1 << 30
"""What ``read_regular`` reads of a run file at most unless told otherwise (far above any JSON or log shardgen
writes; a run file of more is damaged or not shardgen's, and is not read into memory)."""


def read_regular(path: str | os.PathLike, *, follow: bool = True, limit: int = MAX_RUN_FILE_BYTES) -> bytes:
    """The bytes of a regular file (``open_regular``: never blocks, never a FIFO or a device); RunDirError when it
    holds more than ``limit`` bytes (checked before reading, and no more than ``limit`` + 1 bytes are read: a file
    growing meanwhile is cut, and fails its parse)."""
    with open_regular(path, follow=follow) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise too_large(path, size, limit)
        # read(n) allocates n bytes before reading: ask for the file's size (+1 shows a file grown since), not limit
        data = f.read(size + 1)
        if len(data) > size:
            data += f.read(max(0, limit + 1 - len(data)))
        return data[:limit + 1]


def too_large(where: str | os.PathLike, size: int, limit: int) -> RunDirError:
    """The error for a run file of ``size`` bytes where one of its kind holds at most ``limit``."""
    return RunDirError(f"{where} is {size} bytes, more than a file of its kind holds ({limit}); it is damaged or not "
                       "shardgen's. Move it away")


def read_json(path: Path) -> Any:
    """Read a JSON file (a regular file only: ``open_regular``)."""
    return json.loads(read_regular(path))


def read_state(path: Path, required: dict[str, type] | None = None) -> Any:
    """A run-state JSON file, or RunDirError naming it: missing, a symlink, empty, not JSON (or not
    standard JSON), or lacking a required key of the required type."""
    path = Path(path)
    if path.is_symlink():
        raise RunDirError(f"{path} is a symlink; run files must be regular files")
    try:
        data = read_regular(path, follow=False)
    except FileNotFoundError:
        data = None
    return parse_state(path, data, required)


def parse_state(where: str | os.PathLike, data: bytes | None, required: dict[str, type] | None = None) -> Any:
    """The run-state JSON in ``data`` (None: the file is missing), read from ``where`` (a path or a URL, named in
    the errors): RunDirError when missing, empty, not JSON (or not standard JSON), or lacking a required key of the
    required type."""
    if data is None:
        raise RunDirError(f"{where} is missing")
    if not data.strip():
        raise RunDirError(f"{where} is empty")
    try:
        obj = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise RunDirError(f"{where} is not valid JSON ({e})") from None
    for key, typ in (required or {}).items():
        if not isinstance(obj, dict) or not isinstance(obj.get(key), typ) or isinstance(obj.get(key), bool) != (typ is bool):
            raise RunDirError(f"{where} has no valid {key!r} (another version, or damaged)")
    return obj


def _reject_constant(name: str):
    raise ValueError(f"{name} is not standard JSON")


IO_THREADS = 16  # concurrent small reads of run files: enough to hide a network filesystem's round trips


def map_io(fn, items: list) -> list:
    """``[fn(x) for x in items]``, run by IO_THREADS threads when there are many: each read of a run file is a
    round trip to the file server on NFS or Lustre, and 100k of them one after another take minutes."""
    if len(items) < 64:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(IO_THREADS, thread_name_prefix="shardgen-io") as pool:
        return list(pool.map(fn, items, chunksize=256))


def open_append(path: str | os.PathLike) -> int:
    """A descriptor appending to the regular file ``path`` (created if missing): never through a symlink and never
    blocking (opening a FIFO for writing waits for a reader); NotRegularFileError naming anything else there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFileError(f"{path} is a symlink; run files must be regular files. Delete the link") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader, a directory
            raise NotRegularFileError(f"{path} is not a regular file; run files must be regular files. Move it "
                                      "away") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFileError(f"{path} is not a regular file; run files must be regular files. Move it away")
    os.set_blocking(fd, True)
    return fd


def append_line(path: Path, line: str) -> None:
    """Append one line to a log-like run file (O_APPEND, never through a symlink, never blocking), durably."""
    fd = open_append(path)
    with os.fdopen(fd, "ab") as f:
        f.write((line.rstrip("\n") + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def temp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of the process that made the temp file called ``name`` (None: not a temp name of that shape)."""
    parts = name.split(TMP_SEP)
    if len(parts) == 4 and parts[2].isdigit():
        return parts[1], int(parts[2])
    return None
