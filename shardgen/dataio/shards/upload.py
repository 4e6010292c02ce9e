"""Committed shards copied to object storage (``output_uri``), exactly once under their own names.

A shard is committed in run_dir/shards as always (shardwork.py), then uploaded: its tar, its index, then its stats
(the done marker, last), each object under the shard's own name (``NNNNNN.tar``, ``.parquet``, ``.stats.json``). An
object store publishes an object whole when its upload completes, so a reader of the bucket sees a shard's tar
complete or not at all, and its stats only once tar and index are there. After the tar's size is confirmed on the
server, ``shards/NNNNNN.uploaded.json`` records the upload; with ``keep_local=false`` the local tar is then deleted
(its index and stats stay: small, the run's done marker and what status, report and dedup read). A shard committed but not recorded as uploaded (a
kill during its upload) is uploaded again by the next launch, to the same names. Claims, heartbeats and
checkpoints stay in run_dir.
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shardgen.dataio.rundir.layout import (RunDir, RunDirError, atomic_write_json, create_exclusive, json_bytes,
                                           read_json)
from shardgen.dataio.rundir.remote import StorageError, filesystem, info, retrying
from shardgen.dataio.shards import index as shard_index

log = logging.getLogger("shardgen.upload")
MAX_WAITING = 4  # committed shards waiting for their upload before a commit waits (bounds the local disk)


@dataclass
class ShardUploader:
    """Uploads the committed shards of ``run`` to ``uri`` (a folder URL)."""

    run: RunDir
    uri: str
    keep_local: bool = True
    _queue: queue.Queue = field(default_factory=lambda: queue.Queue(MAX_WAITING), init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _error: BaseException | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.uri = self.uri.rstrip("/") + "/"
        self._fs, self._root = filesystem(self.uri)

    def submit(self, shard: int) -> None:
        """Upload ``shard`` on the uploader's thread (started on first use), so that generation never waits on the
        network; waits only while MAX_WAITING shards are queued. Re-raises an earlier upload's error."""
        self._raise_if_failed()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardgen-upload", daemon=True)
            self._thread.start()
        self._queue.put(shard)

    def close(self) -> None:
        """Wait for the queued uploads; re-raise the first error (what it left is uploaded by the next launch)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (shard := self._queue.get()) is not None:
            if self._error is None:  # after an error the rest waits for the next launch
                try:
                    self.upload(shard)
                except BaseException as e:  # surfaced by the next submit or close
                    self._error = e

    @classmethod
    def from_cfg(cls, cfg: Any, run: RunDir) -> "ShardUploader | None":
        """The run's uploader (None without ``output_uri``)."""
        uri = cfg.get("output_uri")
        return cls(run, uri, keep_local=cfg.get("keep_local", True)) if uri else None

    def check(self) -> None:
        """Before planning or loading any model: ``uri`` takes a write (a probe object written and removed);
        StorageError naming the URL (no bucket, no permission, no credentials) when not."""
        probe = f"{self._root}/.shardgen-probe-{socket.gethostname()}-{os.getpid()}"
        retrying("writing a test object", self.uri, lambda: self._fs.pipe_file(probe, b""))
        retrying("removing the test object", self.uri, lambda: self._fs.rm_file(probe))

    def resume(self) -> int:
        """At a launch: the run uploads where its earlier launches did (RunDirError when not), and the uploads a
        killed launch left unfinished are finished; how many shards were uploaded."""
        path = self.run.output_uri_path
        if not create_exclusive(path, json_bytes({"output_uri": self.uri})):
            before = read_json(path).get("output_uri")
            if before != self.uri:
                raise RunDirError(f"{self.run.root} uploads its shards to {before} ({path}); this launch says "
                                  f"output_uri={self.uri}. Use {before}, or start a new run_dir")
        return self.upload_pending()

    def pending(self) -> list[int]:
        """Committed shards whose upload is not recorded (or recorded for other stats: rewritten since)."""
        return sorted(s for s in self.run.done_shards() if not self.uploaded(s))

    def uploaded(self, shard: int) -> bool:
        """Whether ``shard``'s committed stats are the ones recorded as uploaded."""
        try:
            record = read_json(self.run.shard_uploaded(shard))
            stats = read_json(self.run.shard_stats(shard))
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and isinstance(stats, dict) and record.get("sha256") == stats.get("sha256") \
            and record.get("uri") == self.uri

    def upload_pending(self) -> int:
        """Upload every committed shard not recorded as uploaded; how many were."""
        todo = self.pending()
        for shard in todo:
            self.upload(shard)
        if todo:
            log.info("uploaded %d committed shard(s) to %s that earlier launches had not", len(todo), self.uri)
        return len(todo)

    def upload(self, shard: int) -> None:
        """Upload ``shard`` (tar, index, then stats), confirm the tar's size, record it; with keep_local=false
        delete the local tar. Nothing to do when it is recorded already."""
        if self.uploaded(shard):
            return
        run, name = self.run, f"{shard:06d}"
        try:
            stats_bytes = run.shard_stats(shard).read_bytes()
            stats = json.loads(stats_bytes)
            if self._remote_bytes(f"{name}.stats.json") != stats_bytes:  # else: sent whole before a kill
                for local in (run.shard_file(shard), shard_index.index_path(run, shard)):
                    self._put(local)
                file = run.shard_file(shard).name
                size = info(self._url(file)).get("size")
                if size != stats["tar_bytes"]:
                    raise StorageError(f"{self._url(file)}: {size} bytes on the server after its upload, "
                                       f"{stats['tar_bytes']} committed; re-run to upload it again")
                retrying(f"uploading {name}.stats.json", self.uri,
                         lambda: self._fs.pipe_file(f"{self._root}/{name}.stats.json", stats_bytes))
        except FileNotFoundError:
            if self.uploaded(shard):  # another process uploaded it and deleted the local copy meanwhile
                return
            raise
        atomic_write_json(run.shard_uploaded(shard), dict(uri=self.uri, sha256=stats["sha256"],
                                                          tar_bytes=stats["tar_bytes"], time=time.time()))
        if not self.keep_local:  # the index stays: small, and what status, report and dedup read
            run.shard_file(shard).unlink(missing_ok=True)
        log.info("shard %s uploaded to %s", name, self.uri)

    def _url(self, name: str) -> str:
        return self.uri + name

    def _put(self, local) -> None:
        if not local.is_file():
            raise FileNotFoundError(local)
        target = f"{self._root}/{local.name}"
        retrying(f"uploading {local.name}", self.uri, lambda: self._fs.put_file(str(local), target))

    def _remote_bytes(self, name: str) -> bytes | None:
        """The object ``name`` under uri, None when there is none."""

        def get() -> bytes | None:
            try:
                return self._fs.cat_file(f"{self._root}/{name}")
            except FileNotFoundError:
                return None

        return retrying(f"reading {name}", self.uri, get)


def upload_state(run: RunDir) -> dict | None:
    """Where the run uploads its shards and how many committed shards have a recorded upload (from one listing of
    shards/); None for a run without output_uri."""
    try:
        uri = read_json(run.output_uri_path)["output_uri"]
        names = os.listdir(run.shards_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    done = {n[:6] for n in names if n.endswith(".stats.json")}
    return dict(uri=uri, uploaded=sum(n.endswith(".uploaded.json") and n[:6] in done for n in names),
                committed=len(done))


def fetch_uploaded(run: RunDir, shard: int) -> bytes | None:
    """The tar of ``shard`` read back from where its upload is recorded (its local copy deleted: keep_local=false);
    None when it has no upload record. StorageError when it cannot be read."""
    try:
        uri = read_json(run.shard_uploaded(shard))["uri"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    fs, root = filesystem(uri)
    name = run.shard_file(shard).name
    return retrying(f"reading {name}", uri, lambda: fs.cat_file(f"{root.rstrip('/')}/{name}"))


def committed_tar(run: RunDir, shard: int) -> Any:
    """The committed tar of ``shard`` to read: its local file, or, when that was deleted once uploaded
    (keep_local=false), its bytes from the bucket as a file object."""
    path = run.shard_file(shard)
    if not os.path.lexists(path) and (data := fetch_uploaded(run, shard)) is not None:
        return io.BytesIO(data)
    return path


def uploaded_elsewhere(run: RunDir, shard: int, tar_bytes: int) -> bool:
    """Whether ``shard``'s tar is absent because it was uploaded (keep_local=false) as committed."""
    try:
        record = read_json(run.shard_uploaded(shard))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("tar_bytes") == tar_bytes
