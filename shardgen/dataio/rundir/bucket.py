"""Small objects of an S3 bucket under a prefix, written with conditional PutObject: what a run's claims
(claimstore.BucketClaims) and its other small files (runfiles.BucketFiles) share.

``Bucket`` sends one S3 request at a time through s3fs's client, bounded in time; an error that says something of
the object (412 the condition failed, 409 a concurrent conditional write, 404 no such object, 501 the condition is
unknown) is an answer to the caller (``s3_answer``), any other is retried with backoff (``retrying``) or reported as
StorageError naming the object.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any, Callable, TypeVar

from shardgen.dataio.rundir.remote import StorageError, filesystem, public_url, retrying, timeouts

T = TypeVar("T")

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


def split_url(url: str, what: str) -> tuple[str, str]:
    """(bucket, prefix with a trailing slash, or "") of ``s3://bucket/prefix``; StorageError saying what
    ``what`` (e.g. "claims in a bucket") takes otherwise."""
    scheme, _, rest = str(url).partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme.lower() not in ("s3", "s3a") or not bucket:
        raise StorageError(f"{url}: {what} take an s3://BUCKET/PREFIX URL")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


class Bucket:
    """One bucket's objects, read and written one request at a time. ``requests`` counts the requests sent, by S3
    operation; ``read_limit`` is the most bytes a GetObject reads (a larger object's ``Body`` is None)."""

    list_page = 1000  # keys per ListObjectsV2 answer (S3's most)
    read_limit = 1 << 16

    def __init__(self, bucket: str):
        self.bucket = bucket
        self._fs, _ = filesystem(f"s3://{bucket}")
        self._lock = threading.Lock()
        self.requests: Counter = Counter()

    def create_object(self, key: str, data: bytes, what: str) -> dict | None:
        """PutObject with If-None-Match: * (``put_once``): None when the object exists (a 412) or another create of
        it is under way (a 409): a lost race."""
        return self.put_once(key, data, f"creating {what}", (REFUSED, CONFLICT), IfNoneMatch="*")

    def put_once(self, key: str, data: bytes, what: str, answers: tuple[str, ...], **condition: str) -> dict | None:
        """A conditional PutObject, retried on transient errors: its response, or None when the store gave one of
        ``answers``. A 412 after a retry may be our own write whose answer was lost: the object holding ``data``
        says it is (its GetObject response is returned)."""
        attempts: list = []
        resp = self.retried(what, key, attempts=attempts, fn=lambda: self.put(key, data, answers, **condition))
        if resp == REFUSED and len(attempts) > 1:
            got = self.retried(f"reading {key}", key, lambda: self.get(key))
            if isinstance(got, dict) and got["Body"] == data:
                return got
        return resp if isinstance(resp, dict) else None

    def list_names(self, prefix: str, what: str) -> list[str]:
        """The keys under ``prefix``, without it, from ListObjectsV2 (a request per ``list_page`` objects);
        ``what`` says what is listed, in messages."""
        return [obj["Key"][len(prefix):] for obj in self.list_objects(prefix, what)]

    def list_objects(self, prefix: str, what: str) -> list[dict]:
        """ListObjectsV2's entries (Key, Size, LastModified, ETag) under ``prefix``, every page of them."""
        objects, more = [], {}
        while True:
            page = self.retried(f"listing {what}", prefix,
                                lambda: self.send("list_objects_v2", None, (), Prefix=prefix, MaxKeys=self.list_page,
                                                  **more))
            objects += page.get("Contents", [])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return objects
            more = dict(ContinuationToken=token)

    def put(self, key: str, data: bytes, answers: tuple[str, ...], **condition: str) -> dict | str:
        """One (conditional) PutObject: the response, or the answer in ``answers`` the store gave;
        ConditionalWritesUnsupported when the store does not know the condition's header."""
        resp = self.send("put_object", key, answers + (UNSUPPORTED,), Body=data, **condition)
        if resp == UNSUPPORTED:
            header = "If-None-Match" if "IfNoneMatch" in condition else "If-Match"
            raise ConditionalWritesUnsupported(f"{self.store_name()}: the object store refuses {header} on "
                                               f"PutObject (501 Not Implemented); {NEEDS}")
        return resp

    def get(self, key: str) -> dict | str:
        """One GetObject: the response with its ``Body`` read (None when over ``read_limit``), or MISSING."""
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
        if op == "get_object":  # the body is read on the client's loop, at most read_limit + 1 of it
            limit = self.read_limit
            async with resp["Body"] as body:
                small = resp.get("ContentLength", 0) <= limit
                data = await body.read(limit + 1) if small else b""
            resp["Body"] = data if small and len(data) <= limit else None
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
        """The bucket's URL, and the endpoint where it is not AWS's own, for messages."""
        return public_url(f"s3://{self.bucket}") + self.endpoint_note()

    def endpoint_note(self) -> str:
        """`` (at ENDPOINT)`` where the server is not AWS's own, else ""."""
        endpoint = getattr(getattr(getattr(self._fs, "s3", None), "meta", None), "endpoint_url", None)
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
        return f" (at {public_url(endpoint)})" if endpoint and "amazonaws.com" not in endpoint else ""
