"""Where shard claims live: a run directory's claims/ folder (``DirClaims``) or a bucket (``BucketClaims``).

``Claimer`` (claims.py) needs four things of a store, all of which a POSIX directory and an object store with
conditional writes give: create a claim only if it does not exist (one of many contenders wins), read a claim and
its heartbeat time, renew the heartbeat only while the claim is still the one we wrote, and list the highest
generation of every shard. A claim is named ``NNNNNN.g<gen>`` in both.

``DirClaims``: O_CREAT|O_EXCL (atomic on local disks and on NFSv3+/Lustre), the mtime as the heartbeat.
``BucketClaims`` (``s3://bucket/prefix``, keys ``<prefix>/claims/NNNNNN.g<gen>``): PutObject with
``If-None-Match: *`` creates, PutObject of the same bytes with ``If-Match: <the ETag we wrote>`` renews, the
object's LastModified (the server's clock) is the heartbeat. ``probe_conditional_writes`` tells whether a store
honours both conditions, before replicas rely on them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections import Counter
from typing import Any, Callable, Protocol, TypeVar

from shardgen.dataio.rundir.fileio import create_new, read_regular
from shardgen.dataio.rundir.layout import RunDir, shard_name
from shardgen.dataio.rundir.liveness import host_name
from shardgen.dataio.rundir.remote import StorageError, filesystem, public_url, retrying, timeouts
from shardgen.dataio.rundir.storage import RunDirError

CLAIM_BYTES = 1 << 16  # a claim record is a few hundred bytes
CLAIM_NAME = re.compile(r"^(\d{6})\.g(\d+)$")

log = logging.getLogger("shardgen.claims")
T = TypeVar("T")


def claim_name(shard: int, gen: int) -> str:
    """The name of claim (shard, gen) in any store: ``NNNNNN.g<gen>``."""
    return f"{shard_name(shard)}.g{gen}"


def latest_of(names: Any) -> dict[int, int]:
    """Highest claim generation per shard among ``names`` (anything not named like a claim is passed over)."""
    latest: dict[int, int] = {}
    for name in names:
        m = CLAIM_NAME.match(name)
        if m:
            shard, gen = int(m.group(1)), int(m.group(2))
            latest[shard] = max(gen, latest.get(shard, 0))
    return latest


class ClaimStore(Protocol):
    """What ``Claimer`` and the claims' readers (ledger, status, repair) need of where claims live."""

    @property
    def where(self) -> str:
        """Where the claims are, for messages (a claim is ``<where>/NNNNNN.g<gen>``)."""
        ...

    def create(self, shard: int, gen: int, data: bytes) -> bool:
        """Create claim (shard, gen) holding ``data`` if it does not exist; False when it does (another won)."""
        ...

    def read(self, shard: int, gen: int) -> tuple[bytes | None, float | None]:
        """(bytes, heartbeat time) of a claim; (None, time) for something there that is not a claim shardgen wrote
        (alive only by its time); (None, None) when it does not exist."""
        ...

    def exists(self, shard: int, gen: int) -> bool:
        """Whether claim (shard, gen) exists."""
        ...

    def renew(self, shard: int, gen: int) -> bool:
        """Renew the heartbeat of our claim (shard, gen); False when it is gone or was replaced by someone else
        (its holder must stop)."""
        ...

    def remove(self, shard: int, gen: int) -> None:
        """Delete claim (shard, gen) if it exists."""
        ...

    def latest(self) -> dict[int, int]:
        """Highest claim generation per shard."""
        ...


class DirClaims:
    """Claims as files in a run directory's claims/ folder (a shared POSIX directory)."""

    def __init__(self, run: RunDir):
        self.run = run

    @property
    def where(self) -> str:
        """The claims folder."""
        return str(self.run.claims_dir)

    def create(self, shard: int, gen: int, data: bytes) -> bool:
        """O_EXCL (``create_new``): one creator wins, on NFSv3+ and Lustre too. A reader may see the file before its
        bytes (``read_claim`` takes an unparsable claim for one being written, alive by its mtime)."""
        return create_new(self.run.claim(shard, gen), data, 0o644)

    def read(self, shard: int, gen: int) -> tuple[bytes | None, float | None]:
        """The file's bytes (a regular file only, never through a link, bounded) and its mtime."""
        path = self.run.claim(shard, gen)
        try:
            mtime = os.stat(path).st_mtime
            return read_regular(path, follow=False, limit=CLAIM_BYTES), mtime
        except FileNotFoundError:
            return None, None
        except RunDirError:  # not a claim shardgen wrote (a FIFO, a link, a huge file): alive only by its mtime
            return None, mtime

    def exists(self, shard: int, gen: int) -> bool:
        """Whether the claim's file exists."""
        return self.run.claim(shard, gen).exists()

    def renew(self, shard: int, gen: int) -> bool:
        """Touch the file's mtime (not through a link); False when it is gone."""
        try:
            os.utime(self.run.claim(shard, gen), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def remove(self, shard: int, gen: int) -> None:
        """Unlink the claim's file, if there."""
        try:
            os.unlink(self.run.claim(shard, gen))
        except FileNotFoundError:
            pass

    def latest(self) -> dict[int, int]:
        """From one listing of claims/."""
        return latest_of(os.listdir(self.run.claims_dir))


# What a failed S3 request says about the object when that is an answer, not an error to retry or report
REFUSED = "refused"          # 412 PreconditionFailed: the object is not as the condition required
CONFLICT = "conflict"        # 409 ConditionalRequestConflict: a concurrent conditional write of the same key
MISSING = "missing"          # 404: no such object
UNSUPPORTED = "unsupported"  # 501 NotImplemented: the store does not know the condition header
NEEDS = ("shardgen needs conditional writes to coordinate replicas through a bucket (S3, GCS, MinIO and Azure have "
         "them)")
NO_SUCH_ETAG = '"00000000000000000000000000000000"'  # an If-Match no object of a probe has


def s3_answer(e: BaseException) -> str | None:
    """REFUSED, CONFLICT, MISSING or UNSUPPORTED when ``e`` (botocore's error, or s3fs's translation of it, which
    keeps botocore's as its cause) says so of the object; None for any other error."""
    for err in (e, e.__cause__, e.__context__):
        response = getattr(err, "response", None)
        if not isinstance(response, dict):
            continue
        code = str((response.get("Error") or {}).get("Code", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":  # a 404 too, but about the bucket: an error to report
            return None
        for answer, codes, number in ((REFUSED, ("PreconditionFailed", "412"), 412),
                                      (CONFLICT, ("ConditionalRequestConflict", "409"), 409),
                                      (MISSING, ("NoSuchKey", "404"), 404),
                                      (UNSUPPORTED, ("NotImplemented", "501"), 501)):
            if code in codes or status == number:
                return answer
    return None


class ConditionalWritesUnsupported(StorageError):
    """The object store does not honour If-None-Match or If-Match on PutObject: replicas cannot share claims there."""


class BucketClaims:
    """Claims as objects ``<prefix>/claims/NNNNNN.g<gen>`` of an S3 bucket (``s3://bucket/prefix``), through s3fs's
    client. Transient errors (timeouts, 5xx, 503 SlowDown) are retried with backoff (``retrying``); a failed
    precondition is an answer and never retried. ``requests`` counts the requests sent, by S3 operation."""

    list_page = 1000  # keys per ListObjectsV2 answer (S3's most)

    def __init__(self, url: str):
        scheme, _, rest = str(url).partition("://")
        bucket, _, prefix = rest.partition("/")
        if scheme.lower() not in ("s3", "s3a") or not bucket:
            raise StorageError(f"{url}: claims in a bucket take an s3://BUCKET/PREFIX URL")
        self.bucket = bucket
        self.claims_prefix = f"{prefix.strip('/')}/claims/".lstrip("/")
        self._fs, _ = filesystem(f"s3://{bucket}")
        self._lock = threading.Lock()
        self._mine: dict[str, tuple[str, bytes]] = {}  # key -> (ETag, bytes) of each claim this store created
        self.requests: Counter = Counter()

    @property
    def where(self) -> str:
        """The claims' URL prefix."""
        return public_url(f"s3://{self.bucket}/{self.claims_prefix.rstrip('/')}")

    def key(self, shard: int, gen: int) -> str:
        """The object key of claim (shard, gen)."""
        return self.claims_prefix + claim_name(shard, gen)

    def create(self, shard: int, gen: int, data: bytes) -> bool:
        """PutObject with If-None-Match: *; a 412 (it exists) or a 409 (a concurrent create of it) is a lost race."""
        key, attempts = self.key(shard, gen), []
        resp = self.retried(f"creating claim {key}", key, attempts=attempts,
                            fn=lambda: self.put(key, data, (REFUSED, CONFLICT), IfNoneMatch="*"))
        if resp == REFUSED and len(attempts) > 1:
            # an earlier attempt may have created it and only its answer was lost: ours if it holds our bytes
            got = self.retried(f"reading claim {key}", key, lambda: self.get(key))
            resp = got if isinstance(got, dict) and got["Body"] == data else REFUSED
        if not isinstance(resp, dict):
            return False
        with self._lock:
            self._mine[key] = (resp["ETag"], data)
        return True

    def read(self, shard: int, gen: int) -> tuple[bytes | None, float | None]:
        """GetObject: its bytes (None when over CLAIM_BYTES: not a claim shardgen wrote) and LastModified."""
        key = self.key(shard, gen)
        resp = self.retried(f"reading claim {key}", key, lambda: self.get(key))
        if not isinstance(resp, dict):
            return None, None
        return resp["Body"], resp["LastModified"].timestamp()

    def exists(self, shard: int, gen: int) -> bool:
        """HeadObject."""
        key = self.key(shard, gen)
        return isinstance(self.retried(f"looking for claim {key}", key,
                                       lambda: self.send("head_object", key, (MISSING,))), dict)

    def renew(self, shard: int, gen: int) -> bool:
        """PutObject of the bytes we wrote, If-Match the ETag we last wrote: a 412 or 404 (overwritten or deleted,
        by hand or by a store that lost it) means the claim is no longer ours."""
        key = self.key(shard, gen)
        with self._lock:
            etag, data = self._mine.get(key, (None, b""))
        if etag is None:  # not created by this store: nothing tells it is still ours
            return False
        resp = self.retried(f"renewing claim {key}", key,
                            lambda: self.put(key, data, (REFUSED, MISSING), IfMatch=etag))
        with self._lock:
            if isinstance(resp, dict):
                self._mine[key] = (resp["ETag"], data)
            else:
                self._mine.pop(key, None)
        return isinstance(resp, dict)

    def remove(self, shard: int, gen: int) -> None:
        """DeleteObject (a missing object is no error)."""
        key = self.key(shard, gen)
        with self._lock:
            self._mine.pop(key, None)
        self.retried(f"removing claim {key}", key, lambda: self.send("delete_object", key, (MISSING,)))

    def latest(self) -> dict[int, int]:
        """ListObjectsV2 over the claims prefix (a request per ``list_page`` objects)."""
        names, more = [], {}
        while True:
            page = self.retried("listing the claims", self.claims_prefix,
                                lambda: self.send("list_objects_v2", None, (), Prefix=self.claims_prefix,
                                                  MaxKeys=self.list_page, **more))
            names += [obj["Key"][len(self.claims_prefix):] for obj in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return latest_of(names)
            more = dict(ContinuationToken=token)

    def put(self, key: str, data: bytes, answers: tuple[str, ...], **condition: str) -> dict | str:
        """One conditional PutObject: the response, or the answer in ``answers`` the store gave;
        ConditionalWritesUnsupported when the store does not know the condition's header."""
        resp = self.send("put_object", key, answers + (UNSUPPORTED,), Body=data, **condition)
        if resp == UNSUPPORTED:
            header = "If-None-Match" if "IfNoneMatch" in condition else "If-Match"
            raise ConditionalWritesUnsupported(f"{self.store_name()}: the object store refuses {header} on "
                                               f"PutObject (501 Not Implemented); {NEEDS}")
        return resp

    def get(self, key: str) -> dict | str:
        """One GetObject: the response with its ``Body`` read (None when over CLAIM_BYTES), or MISSING."""
        return self.send("get_object", key, (MISSING,))

    def send(self, op: str, key: str | None, answers: tuple[str, ...], **kw: Any) -> Any:
        """One request of S3 operation ``op`` on ``key``: the response, or the answer among ``answers`` the store
        gave (``s3_answer``); any other error is raised (for ``retrying`` to retry or report)."""
        from fsspec.asyn import sync

        with self._lock:
            self.requests[op] += 1
        if key is not None:
            kw["Key"] = key
        try:
            # bounded like remote.call: the client's own timeouts leave some waits unbounded
            return sync(self._fs.loop, self._send, op, timeout=sum(timeouts()), **kw)
        except Exception as e:
            answer = s3_answer(e)
            if answer in answers:
                return answer
            raise

    async def _send(self, op: str, **kw: Any) -> dict:
        resp = await self._fs._call_s3(op, Bucket=self.bucket, **kw)
        if op == "get_object":  # the body is read on the client's loop, at most CLAIM_BYTES + 1 of it
            async with resp["Body"] as body:
                small = resp.get("ContentLength", 0) <= CLAIM_BYTES
                data = await body.read(CLAIM_BYTES + 1) if small else b""
            resp["Body"] = data if small and len(data) <= CLAIM_BYTES else None
        return resp

    def retried(self, what: str, key: str, fn: Callable[[], T], attempts: list | None = None) -> T:
        """``fn()`` retried on transient errors (``retrying``), each attempt appended to ``attempts``; StorageError
        naming the object on a permanent error or when the retries are used up."""
        def attempt() -> T:
            if attempts is not None:
                attempts.append(1)
            return fn()

        return retrying(what, f"s3://{self.bucket}/{key}", attempt)

    def store_name(self) -> str:
        """The claims' URL, and the endpoint where it is not AWS's own, for messages."""
        endpoint = getattr(getattr(getattr(self._fs, "s3", None), "meta", None), "endpoint_url", None)
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
        return self.where + (f" (at {public_url(endpoint)})" if endpoint and "amazonaws.com" not in endpoint else "")


def probe_conditional_writes(url: str) -> None:
    """Check that the object store of ``url`` (``s3://bucket/prefix``) honours the conditional writes claims rely
    on: a second create of one object with If-None-Match: * is refused, and a replace with an If-Match ETag the
    object does not have is refused. ConditionalWritesUnsupported, one line naming the store and what it ignores,
    when it does not. The probe object (under the claims prefix, named unlike any claim) is deleted afterwards."""
    store = BucketClaims(url)
    key = f"{store.claims_prefix}.probe~{host_name()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"

    def put(what: str, data: bytes, answers: tuple[str, ...], attempts: list | None = None, **condition: str):
        return store.retried(what, key, lambda: store.put(key, data, answers, **condition), attempts)

    def unsupported(what: str) -> ConditionalWritesUnsupported:
        return ConditionalWritesUnsupported(f"{store.store_name()}: the object store {what}; {NEEDS}")

    attempts: list = []
    try:
        first = put("creating a probe object", b"1", (REFUSED, CONFLICT), attempts, IfNoneMatch="*")
        if not isinstance(first, dict) and len(attempts) == 1:  # after a lost answer, a 412 may be our own create
            raise unsupported(f"refused creating a new object with If-None-Match: * ({first})")
        if isinstance(put("creating the probe object again", b"2", (REFUSED, CONFLICT), IfNoneMatch="*"), dict):
            raise unsupported("ignores If-None-Match: two creates of one object both succeeded")
        if isinstance(put("replacing the probe object", b"3", (REFUSED, MISSING), IfMatch=NO_SUCH_ETAG), dict):
            raise unsupported("ignores If-Match: a replace naming an ETag the object does not have succeeded")
    finally:
        try:
            store.retried("deleting the probe object", key, lambda: store.send("delete_object", key, (MISSING,)))
        except StorageError as e:
            log.warning("could not delete the probe object s3://%s/%s: %s", store.bucket, key, e)
