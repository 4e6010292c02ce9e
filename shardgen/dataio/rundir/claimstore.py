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

import functools
import logging
import os
import re
import uuid
from typing import Any, Protocol

from shardgen.dataio.rundir.fileio import create_new, read_regular
from shardgen.dataio.rundir.layout import RunDir, shard_name
from shardgen.dataio.rundir.liveness import host_name
from shardgen.dataio.rundir.bucket import (CONFLICT, MISSING, NEEDS, NO_SUCH_ETAG, REFUSED, Bucket,
                                           ConditionalWritesUnsupported, split_url)
from shardgen.dataio.rundir.remote import StorageError, public_url
from shardgen.dataio.rundir.storage import RunDirError

CLAIM_BYTES = 1 << 16  # a claim record is a few hundred bytes
CLAIM_NAME = re.compile(r"^(\d{6})\.g(\d+)$")

log = logging.getLogger("shardgen.claims")


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


class BucketClaims(Bucket):
    """Claims as objects ``<prefix>/claims/NNNNNN.g<gen>`` of an S3 bucket (``s3://bucket/prefix``), through s3fs's
    client. Transient errors (timeouts, 5xx, 503 SlowDown) are retried with backoff (``retrying``); a failed
    precondition is an answer and never retried. ``requests`` counts the requests sent, by S3 operation."""

    read_limit = CLAIM_BYTES

    def __init__(self, url: str):
        bucket, prefix = split_url(url, "claims in a bucket")
        super().__init__(bucket)
        self.claims_prefix = f"{prefix}claims/"
        self._mine: dict[str, tuple[str, bytes]] = {}  # key -> (ETag, bytes) of each claim this store created

    @property
    def where(self) -> str:
        """The claims' URL prefix."""
        return public_url(f"s3://{self.bucket}/{self.claims_prefix.rstrip('/')}")

    def key(self, shard: int, gen: int) -> str:
        """The object key of claim (shard, gen)."""
        return self.claims_prefix + claim_name(shard, gen)

    def create(self, shard: int, gen: int, data: bytes) -> bool:
        """PutObject with If-None-Match: * (``create_object``): a 412 (it exists) or a 409 (a concurrent create of
        it) is a lost race."""
        key = self.key(shard, gen)
        resp = self.create_object(key, data, f"claim {key}")
        if resp is None:
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
        return latest_of(self.list_names(self.claims_prefix, "the claims"))

    def store_name(self) -> str:
        """The claims' URL, and the endpoint where it is not AWS's own, for messages."""
        return self.where + self.endpoint_note()


@functools.lru_cache(maxsize=16)
def bucket_claims(url: str) -> BucketClaims:
    """The claims of the run kept in the bucket ``url`` (one store per run and process: its request counts, its
    client and the ETags of the claims it created are shared by every claimer of the process)."""
    return BucketClaims(url)


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
    first = put("creating a probe object", b"1", (REFUSED, CONFLICT), attempts, IfNoneMatch="*")  # none to delete
    try:
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
