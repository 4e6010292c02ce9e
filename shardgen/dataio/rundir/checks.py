"""A run_dir value refused before anything reads or writes it, in one line that says what to write instead
(``check_run_dir_text``): empty, a URL of a store that cannot hold a run or short of its "//", a NUL byte, a path no
file system takes. The directory it names is checked by layout.py's ``check_run_root`` (``/``, the home directory,
a file, an unwritable or a foreign non-empty directory)."""

from __future__ import annotations

import os
import re

from shardgen.dataio.rundir.remote import SCHEME_PACKAGES, ambiguous_folder, plain_folder
from shardgen.dataio.rundir.storage import RunDirError

URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # a run_dir that names a store, not a path
NAME_MAX = 255    # bytes of one path component (Linux, macOS and the usual file systems)
PATH_MAX = 4096   # bytes of a whole path, its terminating NUL included (Linux)
BUCKET_SCHEMES = ("s3", "s3a")  # the stores whose conditional writes shardgen knows (bucket.py)
# "s3:/bucket/run", "gs:": a store's URL short of its "//", which as a path is a local folder named "s3:"
_NEAR_URL = re.compile(r"(?P<scheme>" + "|".join(sorted({*SCHEME_PACKAGES, "file"}, key=len, reverse=True))
                       + r"):(?:/(?!/)(?P<rest>.*))?", re.IGNORECASE | re.DOTALL)


def check_run_dir_text(text: str) -> None:
    """RunDirError for a run_dir value that can only be a mistake, before anything reads or writes it: empty (it
    would mean the current directory), a URL of a store that cannot hold a run (only s3:// can: it has conditional
    writes), a store's URL short of its "//" (``s3:/bucket/run``, a local folder named "s3:" as a path), a NUL byte,
    or a path no file system takes (a name over NAME_MAX bytes, the whole over PATH_MAX)."""
    text = str(text)
    if not text.strip():
        raise RunDirError("run_dir is empty: it would be the current directory. Set run_dir=PATH to a new directory "
                          "(or an existing run)")
    if advice := near_url_advice(text):
        raise RunDirError(advice)
    if URL_SCHEME.match(text.strip()):
        scheme, _, rest = text.strip().partition("://")
        if scheme.lower() == "file":
            raise RunDirError(f"run_dir={text.strip()[:200]}: a local folder is given as its path; write "
                              f"run_dir=/{rest.lstrip('/')[:200] or 'PATH'}")
        if scheme.lower() not in BUCKET_SCHEMES:
            raise RunDirError(f"run_dir={text.strip()[:200]}: a run kept in a bucket needs an S3-compatible store "
                              "(run_dir=s3://BUCKET/PREFIX); for another store keep run_dir local (or on a shared "
                              "file system) and set output_uri=" + text.strip()[:200].rstrip("/") + "/ to send every "
                              "committed shard there")
        if not rest.strip("/").partition("/")[2].strip("/"):
            raise RunDirError(f"run_dir={text.strip()[:200]}: name a folder in the bucket for the run "
                              f"(run_dir={scheme}://{rest.strip('/') or 'BUCKET'}/RUN_NAME): the run's files are kept "
                              "under it")
        if ambiguous_folder(text.strip()):
            raise RunDirError(f"run_dir={text.strip()[:200]}: an empty, '.' or '..' folder name (as in //) is a key "
                              "object stores keep and fsspec normalises away, so the run's files would be written "
                              f"and read back under different keys; write run_dir={plain_folder(text.strip())[:-1]}")
        return
    if "\0" in text:
        raise RunDirError("run_dir holds a NUL byte, which no path may; set run_dir=PATH without it")
    full = os.fsencode(os.path.abspath(os.path.expanduser(text)))
    long = next((n for n in full.split(b"/") if len(n) > NAME_MAX), None)
    if long is not None or len(full) >= PATH_MAX:
        what = (f"a folder name of {len(long)} bytes (at most {NAME_MAX})" if long is not None
                else f"{len(full)} bytes as an absolute path (at most {PATH_MAX - 1})")
        raise RunDirError(f"run_dir {text[:60]}... is {what}: no file system takes it; choose a shorter run_dir")


def near_url_advice(text: str, key: str = "run_dir") -> str | None:
    """What to write instead of a ``key`` value that is a store's URL short of its "//" (``s3:/bucket/run``: as a
    path, one in a local folder named "s3:"); None for any other value."""
    near = _NEAR_URL.fullmatch(str(text).strip())
    if near is None:
        return None
    scheme, rest, shown = near["scheme"], (near["rest"] or "")[:200], str(text).strip()[:200]
    meant = f"/{rest or 'PATH'}" if scheme.lower() == "file" else f"{scheme}://{rest or 'BUCKET/RUN_NAME'}"
    return (f"{key}={shown} is no URL (a URL has '//' after '{scheme}:') but a local path in a folder named "
            f"'{scheme}:'. Write {key}={meant}; for a local path of that name, {key}=./{shown}")
