"""What the storage refuses, as errors the user can act on: a run directory that cannot be used as it is
(``RunDirError``), and a write refused for space, quota, file size, a read-only file system or permissions
(``DiskFullError``: ``disk_full`` and ``storage_error`` turn an ``OSError``, or a library's error naming its errno
only in its text, into one naming the path, the free space and the fix)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from shardgen.errors import UserError


class RunDirError(UserError, RuntimeError):
    """A run directory (or a file in it) that cannot be used as it is; the message names the file and the fix."""


class DiskFullError(UserError, OSError):
    """The storage refused a write (no space or inodes, quota, file size limit, a read-only file system, a folder or
    file this user may not write: permission denied or an immutable flag); the message names the path (for a refused
    permission the folder or file at fault), the free space where it applies, and the fix."""


def free_space_text(path: Path) -> str:
    """'12.3 GB free' on the filesystem of ``path`` (or '? free' where it cannot be measured)."""
    try:
        return f"{shutil.disk_usage(path).free / 1e9:.1f} GB free"
    except OSError:
        return "? free"


# what the storage refused a write for, and what frees it: each a user error, never a traceback
_STORAGE_FIXES = {errno.ENOSPC: "Free space (or inodes: df -i) or raise the quota",
                  errno.EDQUOT: "Free space or raise the quota",
                  errno.EFBIG: "Raise the file size limit (ulimit -f) or lower samples_per_shard",
                  errno.EROFS: "Remount it writable or choose a run_dir on a writable file system"}


_DENIED = (errno.EACCES, errno.EPERM)  # this user may not write there: its permissions, or an immutable flag


_QUOTED_PATH = re.compile(r"'([^']*/[^']*)'")  # pyarrow names the file only in its text: "... local file '/r/x'. ..."


def disk_full(e: BaseException, path: str | os.PathLike | None = None, need: int | None = None) -> DiskFullError | None:
    """The user-facing error for a write the storage refused (no space or inodes, quota, file size limit, read-only
    file system, permission denied) while writing ``path`` (default: the error's file name); None for other errors,
    and for a refused permission that names no file (not a run file's: e.g. signalling another user's process)."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if code is None and isinstance(e, OSError) and (m := re.search(r"\[errno (\d+)\]", str(e), re.I)):
        code = int(m.group(1))  # pyarrow's write errors carry the errno in their text only
    if code in _DENIED and isinstance(e, OSError):
        path = path or getattr(e, "filename", None) or ((m := _QUOTED_PATH.search(str(e))) and m.group(1))
        return _permission_denied(path, code) if path else None
    if code not in _STORAGE_FIXES:
        return None
    path = path or getattr(e, "filename", None)
    want = f"; about {need / 1e6:.1f} MB more were being written" if need else ""
    free = f"; {free_space_text(Path(path).parent)} there" if path and code in (errno.ENOSPC, errno.EDQUOT) else ""
    path = path or "a run file"
    what = "no space left writing" if code in (errno.ENOSPC, errno.EDQUOT) else "cannot write"
    return DiskFullError(f"{what} {path} ({e.strerror or os.strerror(code)}{free}{want}). {_STORAGE_FIXES[code]}, "
                         "then re-run the same command: the run resumes where it stopped.")


def _permission_denied(path: str | os.PathLike, code: int) -> DiskFullError:
    """The error for EACCES/EPERM on ``path``, naming what is at fault: a folder above it this user cannot enter, the
    file itself where it exists and its folder is writable, or else (the usual case: a file being created, a temp
    file, a rename) the folder it is in."""
    target = Path(path)
    where, what = target.parent, "not writable"
    try:
        blocked = next((d for d in reversed(target.parents) if d.is_dir() and not os.access(d, os.X_OK)), None)
        if blocked is not None:
            where, what = blocked, "not accessible"
        elif os.path.lexists(target) and os.access(target.parent, os.W_OK | os.X_OK):
            if not os.access(target, os.W_OK, follow_symlinks=False):
                where = target
            elif not os.access(target, os.R_OK, follow_symlinks=False):
                where, what = target, "not readable"
    except (OSError, ValueError):
        pass
    flag = (" or clear its immutable flag (lsattr -d, chattr -i)" if code == errno.EPERM else "")
    return DiskFullError(f"{where} is {what} by this user ({os.strerror(code).lower()}); fix its permissions (or run "
                         f"as its owner){flag} and re-run the same command: the run resumes where it stopped")


def storage_error(e: BaseException) -> DiskFullError | None:
    """``disk_full`` of ``e`` or of an error it was raised from (a writer thread's error, re-raised wrapped)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return e
        if full := disk_full(e):
            return full
        e = e.__cause__ or e.__context__
    return None
