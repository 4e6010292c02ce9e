"""Files at fsspec URLs (``s3://``, ``gs://``, ``hf://``, ``https://``): reading a prompt file, writing shards.

Every scheme takes the same fsspec path; s3:// (a local S3 server) and http(s):// (a local web server) are what the
tests reach, gs:// and hf:// are that same path untested here.

``open_input`` and ``sizeof`` take a local path (opened as before) or a URL; a remote file is read through ranged
requests (``RemoteFile``: a seekable file object whose reads are byte ranges), never copied to
local disk first. Credentials come from where each filesystem looks for them (for S3: the environment, the
AWS config files, an instance role); nothing here writes or logs them.

Transient errors (timeouts, 5xx, throttling, dropped or refused connections) are retried with backoff, each retry
logged; permanent ones (no such bucket or object, no permission, no credentials) raise ``StorageError``: one line
naming the URL and the fix.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import time
from collections import Counter
from typing import Any, Callable, TypeVar

from shardgen.errors import UserError

log = logging.getLogger("shardgen.storage")
T = TypeVar("T")

RETRIES = 6          # attempts of one request before a transient error is given up on
BACKOFF_S = 0.5      # the first wait; doubled at each retry
MAX_BACKOFF_S = 16.0
READ_BLOCK = 4 << 20  # bytes per ranged read of a remote prompt file
_BYTES_READ: Counter = Counter()  # URL -> bytes fetched by this process
# error codes of S3 and its look-alikes that no retry changes
PERMANENT_CODES = {"NoSuchBucket": "the bucket does not exist", "NoSuchKey": "no such object",
                   "AccessDenied": "access denied", "InvalidAccessKeyId": "the access key is not known",
                   "SignatureDoesNotMatch": "the secret key does not match", "AllAccessDisabled": "access denied",
                   "InvalidBucketName": "not a valid bucket name", "403": "access denied", "404": "not found"}
FIX = ("Check the URL, that the bucket exists and that the credentials the environment provides (for S3: "
       "AWS_ACCESS_KEY_ID/AWS_PROFILE, AWS_ENDPOINT_URL for an S3-compatible server) may use it")


class StorageError(UserError, OSError):
    """Object storage refused a request for good (no bucket, no permission, no credentials), or kept failing."""


def is_url(path: Any) -> bool:
    """Whether ``path`` names a file through a filesystem other than the local one (``scheme://...``)."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def ambiguous_folder(url: str) -> bool:
    """Whether the path of ``url`` (after its bucket) has an empty, "." or ".." segment (a trailing "/" aside):
    object stores keep such keys as written while fsspec normalises them, so what is written under them would be
    read back under other keys."""
    path = url.split("://", 1)[-1].split("?", 1)[0]
    return any(part in ("", ".", "..") for part in path.rstrip("/").split("/")[1:])


def plain_folder(url: str) -> str:
    """``url`` without its empty, "." and ".." segments, ending in "/"."""
    scheme, _, path = url.partition("://")
    parts = [p for p in path.split("/") if p not in ("", ".", "..")]
    return f"{scheme}://{'/'.join(parts)}/"


SECRET_SHOWN = "REDACTED"
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def public_url(url: str) -> str:
    """``url`` as it may be written down (a run's files, its logs): without a user or password, and with every
    query value replaced by REDACTED. A presigned URL's query holds its signature and credential (S3's
    ``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``; a SAS ``sig``; ...), a secret like a
    password; the parameter names stay, so the record still shows what kind of URL it was."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    host, tail = rest[:cut].rpartition("@")[2], rest[cut:]
    path, q, query = tail.partition("?")
    if q:
        query, hash_, frag = query.partition("#")
        names = [part.partition("=")[0] for part in query.split("&") if part]
        path += "?" + "&".join(f"{n}={SECRET_SHOWN}" for n in names) + hash_ + frag
    return f"{scheme}://{host}{path}"


def urls_in(text: str) -> list[str]:
    """Every URL written in ``text``."""
    return _URL_IN_TEXT.findall(text) if "://" in text else []


def redact_urls(text: str) -> str:
    """``text`` with every URL in it as ``public_url`` writes it."""
    return _URL_IN_TEXT.sub(lambda m: public_url(m.group(0)), text) if "://" in text else text


# the package fsspec needs for each scheme (gs:// and hf:// take the same path as s3://, untested here: no server)
SCHEME_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub",
                   "az": "adlfs", "abfs": "adlfs", "http": "aiohttp", "https": "aiohttp"}


TIMEOUT_VAR = "SHARDGEN_STORAGE_TIMEOUT_S"  # overrides READ_TIMEOUT_S (and caps CONNECT_TIMEOUT_S)
CONNECT_TIMEOUT_S = 5.0   # a server that does not accept the connection: given up on after this
READ_TIMEOUT_S = 10.0     # a server that accepted but does not answer (nor send the next bytes): given up on after this


def timeouts() -> tuple[float, float]:
    """(connect, read) timeouts in seconds of one request, per attempt: READ_TIMEOUT_S, or $SHARDGEN_STORAGE_TIMEOUT_S;
    the connect timeout is at most the read one. A hung server is thus reported within about
    RETRIES x (connect + read timeout) + the backoff (about 105 s by default; the first retry logged after 15 s)."""
    read = READ_TIMEOUT_S
    if text := os.environ.get(TIMEOUT_VAR, "").strip():
        try:
            read = float(text)
            if not read > 0:
                raise ValueError
        except ValueError:
            raise StorageError(f"{TIMEOUT_VAR}={text}: expected a number of seconds > 0") from None
    return min(CONNECT_TIMEOUT_S, read), read


MIN_RATE = 256 << 10  # bytes/s: a transfer slower than this is taken for a hung one (``call``'s deadline)


def call(fs: Any, method: str, *args, size: int = 0, **kwargs) -> Any:
    """``fs.method(*args, **kwargs)`` given up on (asyncio.TimeoutError, retried by ``retrying``) after the connect
    and read timeouts, or when longer the time ``size`` bytes take at MIN_RATE: the client's own timeouts leave
    some waits unbounded (an S3 PUT to a server that accepted the connection and never answers waits forever).
    Async filesystems (s3fs, gcsfs, http) only: others are called as they are."""
    from fsspec.asyn import AsyncFileSystem

    if isinstance(fs, AsyncFileSystem):
        connect, read = timeouts()
        kwargs["timeout"] = connect + max(read, size / MIN_RATE)
    return getattr(fs, method)(*args, **kwargs)


def storage_options(scheme: str) -> dict:
    """The options shardgen gives the filesystem of ``scheme``: its own connect/read timeouts (botocore's are 60 s,
    aiohttp's 5 minutes a request), and for S3 none of the client's silent retries of a timeout (s3fs retries one 5
    times, botocore up to 5 times more, each waiting the whole timeout): ``retrying`` retries, logging each. botocore
    keeps its own retry count when the environment sets one (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE)."""
    connect, read = timeouts()
    if scheme in ("s3", "s3a"):
        config: dict = dict(connect_timeout=connect, read_timeout=read)
        if not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
            config["retries"] = {"total_max_attempts": 1}
        return dict(config_kwargs=config)
    if scheme in ("http", "https"):
        try:
            import aiohttp
        except ImportError:
            return {}
        return dict(client_kwargs=dict(timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect,
                                                                     sock_read=read)))
    return {}


def filesystem(url: str) -> tuple[Any, str]:
    """(the fsspec filesystem of ``url``, the path within it, with shardgen's timeouts: ``storage_options``);
    StorageError, one line naming the package to install, when its scheme's package is missing."""
    import fsspec

    scheme = str(url).split("://", 1)[0].lower()
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options(scheme))
        if scheme in ("s3", "s3a"):
            fs.retries = 1  # s3fs's own retry loop (silent, 5 by default): ``retrying`` does it, logged
        return fs, path
    except ImportError:  # e.g. gs:// without gcsfs installed
        package = SCHEME_PACKAGES.get(scheme, f"the fsspec package of {scheme}://")
        raise StorageError(f"{url}: reading {scheme}:// URLs needs {package}, which is not installed: "
                           f"pip install {package}") from None
    except ValueError as e:  # a scheme fsspec does not know
        raise StorageError(f"{url}: {scheme}:// is not a filesystem fsspec knows ({short(e)}); use a local path or an "
                           "s3://, gs://, hf:// or https:// URL") from None


def permanent_reason(e: BaseException) -> str | None:
    """Why ``e`` will fail again however often it is retried; None for a transient error."""
    for err in (e, e.__cause__, e.__context__):
        if err is None:
            continue
        response = getattr(err, "response", None)
        code = str((response.get("Error") or {}).get("Code", "")) if isinstance(response, dict) else ""
        if code in PERMANENT_CODES:
            return PERMANENT_CODES[code]
        if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):  # botocore's, not importable here
            return "no credentials found"
    if isinstance(e, FileNotFoundError):
        return "not found (no such bucket or object)"
    if isinstance(e, (PermissionError, IsADirectoryError, NotADirectoryError)):
        return "access denied" if isinstance(e, PermissionError) else str(e)
    return None


def retrying(what: str, url: str, fn: Callable[[], T], *, attempts: int | None = None) -> T:
    """``fn()``, retried with backoff on transient errors (each retry logged); StorageError naming ``url`` on a
    permanent one, or when the ``attempts`` (default RETRIES) are used up."""
    attempts, delay = attempts or RETRIES, BACKOFF_S
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:
            why = permanent_reason(e)
            if why is not None:
                raise StorageError(f"{url}: {what} failed: {why}. {FIX}") from None
            if attempt == attempts:
                raise StorageError(f"{url}: {what} failed {attempts} times ({type(e).__name__}: {short(e)}); "
                                   "the storage is unreachable or failing. Re-run once it answers: the run "
                                   "continues where it stopped") from None
            log.warning("%s: %s failed (%s: %s); retry %d of %d in %.1f s", url, what, type(e).__name__,
                        short(e), attempt, attempts - 1, delay)
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
    raise AssertionError("unreachable")


def short(e: BaseException) -> str:
    """An error's message on one line, bounded (a botocore message can hold a whole response)."""
    text = " ".join(str(e).split())[:200]
    if not text and isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return f"no answer in time (read timeout {timeouts()[1]:g} s, ${TIMEOUT_VAR})"
    return text


def info(url: str) -> dict:
    """The file's metadata (size, ETag, ...), fresh from the server; StorageError when it does not exist."""
    fs, path = filesystem(url)

    def get() -> dict:
        fs.invalidate_cache(path)
        return call(fs, "info", path)

    return retrying("reading the file's metadata", url, get)


def identity(url: str) -> dict:
    """What identifies the content of a remote file without reading it: its URL, size, ETag (or checksum, as the
    store names it) and modification time. Equal identities: the same bytes (an overwrite changes the ETag). The URL
is ``public_url``'s: an identity is written into the run."""
    meta = info(url)
    tag = next((meta[k] for k in ("ETag", "etag", "md5Hash", "crc32c", "blob_id", "checksum", "sha256") if meta.get(k)), None)
    modified = meta.get("LastModified") or meta.get("mtime") or meta.get("updated")
    return dict(path=public_url(url), size=int(meta.get("size") or 0), etag=str(tag) if tag is not None else None,
                modified=str(modified) if modified is not None else None)


class RemoteFile(io.RawIOBase):
    """A remote file as a seekable binary file whose reads are ranged requests, each retried on a transient error
    (a dropped connection mid-file is a retry of one range, not a failed scan). ``bytes_read``: what was fetched."""

    def __init__(self, url: str, size: int | None = None):
        super().__init__()
        self.url = url
        self._fs, self._path = filesystem(url)
        self.size = size if size is not None else identity(url)["size"]
        self._pos = 0
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self._pos)
        if n <= 0:
            return 0
        lo = self._pos
        data = retrying(f"reading bytes {lo}..{lo + n}", self.url,
                        lambda: call(self._fs, "cat_file", self._path, start=lo, end=lo + n, size=n))
        if len(data) > n:  # a web server that ignores Range sends the whole file for each read
            raise StorageError(f"{self.url}: {len(data)} bytes sent for a range of {n}: the server ignores byte "
                               "ranges (Range requests). Serve the file from one that answers them, or copy it to a "
                               "local path")
        buf[:len(data)] = data
        self._pos += len(data)
        self.bytes_read += len(data)
        _BYTES_READ[self.url] += len(data)
        return len(data)


def bytes_read(url: str) -> int:
    """Bytes of ``url`` this process has fetched so far (ranged reads; a planning scan reports it)."""
    return _BYTES_READ[url]


def open_remote(url: str, buffering: int = READ_BLOCK) -> io.BufferedReader:
    """``url`` opened for reading as a buffered binary file (ranged reads of ``buffering`` bytes)."""
    return io.BufferedReader(RemoteFile(url), buffer_size=max(buffering, io.DEFAULT_BUFFER_SIZE))


def sizeof(path: Any) -> int:
    """A file's size in bytes, local or remote."""
    return identity(str(path))["size"] if is_url(path) else os.path.getsize(path)


def open_input(path: Any, buffering: int = -1):
    """A local path or a URL opened for binary reading (a URL: ranged reads, never a download first; a local path:
    only a regular file, ``open_regular``: a FIFO in its place is refused, not waited on)."""
    if is_url(path):
        return open_remote(str(path))
    from shardgen.dataio.rundir.fileio import open_regular

    return open_regular(path, buffering=buffering)
