"""Committed shards copied to object storage (``output_uri``), exactly once under their own names.

A shard is committed in run_dir/shards as always (shardwork.py), then uploaded: its tar, its index, then its stats
(the done marker, last), each object under the shard's own name (``NNNNNN.tar``, ``.parquet``, ``.stats.json``). An
object store publishes an object whole when its upload completes, so a reader of the bucket sees a shard's tar
complete or not at all, and its stats only once tar and index are there. Each object's size (and, where the ETag is
the content's MD5, its content) is confirmed on the server; then ``uploads/NNNNNN.json`` records the upload: the
shard's stats and each object's size, ETag and sha256 (uploaded.py reads objects back against it). With
``keep_local=false`` the shard's local tar, index and stats are then deleted: the record is its done marker, and
run_dir/shards goes back to empty. A shard committed but not recorded as uploaded (a kill during its upload) is
uploaded by the next launch, to the same names; an object already there is sent again unless it is the local file's
bytes. Claims, heartbeats, checkpoints, the plan and the upload records stay in run_dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardgen.dataio.rundir.claims import LEASE_S, claim_state, owner_record, read_claim, scan_claims
from shardgen.dataio.rundir.fileio import json_bytes
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.runfiles import DIR_FILES
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.rundir.remote import (PERMANENT_CODES, StorageError, call, filesystem, permanent_reason,
                                           retrying)
from shardgen.dataio.shards import index as shard_index
from shardgen.dataio.shards.uploaded import (etag_of, fetch, local_or_fetched, missing_uploads, read_record,
                                             uploaded_to)
from shardgen.errors import UserError

log = logging.getLogger("shardgen.upload")
MAX_WAITING = 4  # committed shards waiting for their upload before a commit waits (bounds the local disk)
RUN_MARKER_OBJECT = "_shardgen_run.json"  # at output_uri: which run uploads there (one run per folder)


class ForeignPrefixError(UserError):
    """output_uri holds the marker of another run: its shards would be overwritten by this one's."""


def run_id(run: RunDir) -> str | None:
    """What identifies a run wherever its directory is (moved, copied): the sha256 of its owner record
    (``.shardgen-run``, written once when the run is created), 16 hex digits; None before it is created."""
    if run.store:  # the record every machine sharing the run reads
        data = run.files.read(run.marker_path)
        return hashlib.sha256(data).hexdigest()[:16] if data is not None else None
    try:
        return hashlib.sha256(run.marker_path.read_bytes()).hexdigest()[:16] if not run.marker_path.is_symlink() \
            else None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


@dataclass
class ShardUploader:
    """Uploads the committed shards of ``run`` to ``uri`` (a folder URL)."""

    run: RunDir
    uri: str
    keep_local: bool = True
    lease_s: float = LEASE_S  # the run's: how long a silent claim holds its shard (drop_committed_elsewhere)
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
        """The run's uploader: to ``output_uri``, or, for a run kept in a bucket, to its own ``shards/`` folder
        there (nothing kept locally); None for a local run without ``output_uri``."""
        if run.store:
            return cls.committing(run, cfg.lease_s)
        uri = cfg.output_uri
        return cls(run, uri, keep_local=cfg.keep_local, lease_s=cfg.lease_s) if uri else None

    @classmethod
    def committing(cls, run: RunDir, lease_s: float) -> "ShardUploader":
        """The uploader of a run kept in a bucket: into its own ``shards/`` folder there, nothing kept locally."""
        return cls(run, f"{run.store}/shards/", keep_local=False, lease_s=lease_s)

    @property
    def commits(self) -> bool:
        """Whether an upload is the shard's commit, to be made before the shard's claim is given up, not queued: a
        run kept in a bucket, whose done marker is the upload record (written once tar and index are confirmed; it
        holds the stats, so no stats object is sent beside the tar)."""
        return bool(self.run.store)

    def check(self) -> None:
        """Before planning or loading any model: ``uri`` takes a write (a probe object written and removed);
        StorageError naming the URL (no bucket, no permission, no credentials) when not."""
        probe = f"{self._root}/.shardgen-probe-{socket.gethostname()}-{os.getpid()}"
        retrying("writing a test object", self.uri, lambda: call(self._fs, "pipe_file", probe, b""))
        retrying("removing the test object", self.uri, lambda: call(self._fs, "rm_file", probe))
        self._check_owner(self._read_marker())  # another run's folder: refused before planning or any weight

    def check_readable(self) -> None:
        """``check`` without writing (a dry run's): the folder's bucket can be read and no other run uploads there;
        StorageError (no bucket, no permission, no credentials) or ForeignPrefixError naming the URL when not. Write
        permission is only known by writing: the launch's ``check`` probes it."""
        self._check_owner(self._read_marker())

    def _marker_url(self) -> str:
        return self._url(RUN_MARKER_OBJECT)

    def _marker_path(self) -> str:
        return f"{self._root}/{RUN_MARKER_OBJECT}"

    def _read_marker(self) -> dict | None:
        """The run marker at ``uri`` (None: there is none: a new folder, or one of uploads without a marker)."""
        path = self._marker_path()

        def get() -> bytes | None:
            self._fs.invalidate_cache(path)
            try:
                return call(self._fs, "cat_file", path)
            except FileNotFoundError as e:
                if permanent_reason(e) == PERMANENT_CODES["NoSuchBucket"]:
                    raise
                return None

        data = retrying(f"reading {RUN_MARKER_OBJECT}", self.uri, get)
        if data is None:
            return None
        try:
            marker = json.loads(data)
        except ValueError:
            marker = None
        return marker if isinstance(marker, dict) else {"run_id": None, "run_dir": "(unreadable marker)"}

    def _check_owner(self, marker: dict | None) -> None:
        """ForeignPrefixError, one line naming the URL and the fix, when ``marker`` names another run than this."""
        if marker is None or (marker.get("run_id") == run_id(self.run) and marker.get("run_id")):
            return
        raise ForeignPrefixError(
            f"{self.uri}: another run uploads its shards there ({self._marker_url()} names run "
            f"{marker.get('run_id')} in {marker.get('run_dir')}); two runs at one output_uri overwrite each other's "
            f"shards. Choose another output_uri (a folder no other run uses) for {self.run.root}, or, if that run's "
            f"shards there are to be replaced, delete {self._marker_url()} first")

    def _claim_folder(self) -> None:
        """Write the run marker at ``uri`` unless it is there (a folder of earlier uploads without one is taken as
        this run's); ForeignPrefixError when it names another run (one that claimed the folder since ``check``)."""
        mine = run_id(self.run)
        if mine is None:  # a run directory without an owner record (.shardgen-run): nothing to name it by
            return
        marker = self._read_marker()
        if marker is None:
            body = json_bytes(dict(run_id=mine, run_dir=str(self.run.root), host=socket.gethostname(),
                                   time=time.time()))
            retrying(f"writing {RUN_MARKER_OBJECT}", self.uri, lambda: self._create_marker(body))
            marker = self._read_marker()  # read back: whichever run's marker is there now judges this launch
        self._check_owner(marker)

    def _create_marker(self, body: bytes) -> None:
        """Write the marker unless one is there: an exclusive create where the store has one (S3 and servers like
        it: If-None-Match, fsspec's mode="create"), so of two new runs racing for one folder only the first
        passes; a plain write on a store or client without it (then the read-back catches all but a race within
        the same instant)."""
        path = self._marker_path()
        try:
            call(self._fs, "pipe_file", path, body, mode="create")
        except FileExistsError:  # another run's marker came first: the read-back names it
            pass
        except (TypeError, ValueError, NotImplementedError):  # no exclusive create in this client or store
            call(self._fs, "pipe_file", path, body)

    def forget_missing(self) -> list[int]:
        """Shards whose upload is recorded but whose objects the bucket no longer holds as uploaded (deleted, or
        another size), from one listing of ``uri``: their records removed, so that this launch uploads them again
        from their local copy, or (keep_local=false) generates them again. The shards, each logged."""
        gone = missing_uploads(self.run, uri=self.uri)
        for shard, whys in sorted(gone.items()):
            self.run.files.delete(self.run.shard_uploaded(shard))
            local = DIR_FILES.present(self.run.shard_stats(shard))
            log.warning("shard %06d: %s; its upload record removed: %s", shard, "; ".join(whys),
                        "uploaded again from its local copy" if local else "it is generated again")
        return sorted(gone)

    def resume(self) -> int:
        """At a launch: the run uploads where its earlier launches did (RunDirError when not), and the uploads a
        killed launch left unfinished are finished; the folder is claimed for this run (its marker), and shards
        recorded as uploaded but gone from the bucket are made again (``forget_missing``); how many shards were
        uploaded."""
        path = self.run.output_uri_path
        if not self.run.files.create(path, json_bytes({"output_uri": self.uri})):
            before = json.loads(self.run.files.read(path) or b"{}").get("output_uri")
            if before != self.uri and self.commits:  # a run kept in a bucket, copied to this prefix: its shards are
                self.run.files.replace(path, json_bytes({"output_uri": self.uri}))  # here (uploaded.uploaded_to)
            elif before != self.uri:
                raise RunDirError(f"{self.run.root} uploads its shards to {before} ({path}); this launch says "
                                  f"output_uri={self.uri}. Use {before}, or start a new run_dir")
        self._claim_folder()
        self.forget_missing()
        return self.upload_pending()

    def pending(self) -> list[int]:
        """Shards with local stats whose upload is not recorded (or recorded for other stats: rewritten since)."""
        return sorted(s for s in staged_shards(self.run) if not self.uploaded(s))

    def uploaded(self, shard: int) -> bool:
        """Whether ``shard``'s upload to this uri is recorded, for its local stats when it has them."""
        record = read_record(self.run, shard)
        if record is None or uploaded_to(self.run, record) != self.uri:
            return False
        try:
            data = DIR_FILES.read(self.run.shard_stats(shard))
            if data is None:
                return True  # only the record is left: uploaded, local files deleted (keep_local=false)
            stats = json.loads(data)
        except (OSError, ValueError):
            return False
        return isinstance(stats, dict) and record["sha256"] == stats.get("sha256")

    def upload_pending(self) -> int:
        """Upload every committed shard not recorded as uploaded; how many were. With keep_local=false, also delete
        the local files of shards uploaded by a launch killed before it deleted them."""
        if self.commits:
            self.drop_committed_elsewhere()
            return 0
        todo = self.pending()
        for shard in todo:
            self.upload(shard)
        if todo:
            log.info("uploaded %d committed shard(s) to %s that earlier launches had not", len(todo), self.uri)
        if not self.keep_local:
            for shard in staged_shards(self.run):
                self._drop_local(shard)
        return len(todo)

    def drop_committed_elsewhere(self) -> list[int]:
        """A run kept in a bucket: delete this machine's local files of shards the bucket holds as committed; the
        shards. A shard is uploaded under its claim only, so what a killed launch left here (a tar renamed into
        shards/ before its stats were written, or committed and not yet sent) lost its claim with the launch and is
        generated again by its next holder (over these files, when that is on this machine): once another replica
        has committed it, these files are scratch nobody reads. A shard whose claim is alive keeps its files: a
        launch on this machine rewriting it (retry_failed) is between its commit and its upload."""
        done = sorted(s for s in local_shards(self.run) if self.run.is_done(s))
        if not done:
            return []
        claims, me, now = scan_claims(self.run), owner_record(-1), time.time()
        dropped = [s for s in done if s not in claims or claim_state(*read_claim(self.run, s, claims[s]), now,
                                                                     self.lease_s, me) not in ("running", "future")]
        for shard in dropped:
            self._drop_local(shard, force=True)
        return dropped

    def upload(self, shard: int) -> None:
        """Upload ``shard`` (tar, index, then stats; for a run kept in a bucket tar and index), confirm each object,
        record it; with keep_local=false delete the local files. Nothing is sent when it is recorded already."""
        run = self.run
        if not self.uploaded(shard):
            stats_path = run.shard_stats(shard)
            try:
                data = DIR_FILES.read(stats_path)
                if data is None:
                    raise FileNotFoundError(stats_path)
                stats = json.loads(data)
                objects = {local.name: self._send(local) for local in (run.shard_file(shard),
                                                                       shard_index.index_path(run, shard))}
                if not self.commits:  # the stats last: the done marker at output_uri
                    objects[stats_path.name] = self._send(stats_path)
            except FileNotFoundError:
                if self.uploaded(shard):  # another process uploaded it and deleted the local copy meanwhile
                    return
                raise
            run.uploads_dir.mkdir(exist_ok=True)
            run.files.replace(run.shard_uploaded(shard), json_bytes(dict(
                uri=self.uri, sha256=stats["sha256"], tar_bytes=stats["tar_bytes"], time=time.time(), stats=stats,
                objects=objects)))
            log.info("shard %06d uploaded to %s", shard, self.uri)
        self._drop_local(shard)

    def _drop_local(self, shard: int, force: bool = False) -> None:
        """keep_local=false: delete an uploaded shard's local tar, index, then stats (the stats last: until then
        the shard reads as committed locally, and a kill in between leaves it whole). ``force``: whether uploaded
        or not (a run kept in a bucket, whose copy of the shard was committed by another replica)."""
        if self.keep_local or not (force or self.uploaded(shard)):
            return
        run = self.run
        for local in (run.shard_file(shard), shard_index.index_path(run, shard)):
            local.unlink(missing_ok=True)
        DIR_FILES.delete(run.shard_stats(shard))

    def _url(self, name: str) -> str:
        return self.uri + name

    def _send(self, local: Path) -> dict:
        """Upload ``local`` under its name unless the object there is its bytes already (sent whole before a
        kill); the confirmed object's size, ETag and sha256. StorageError when the server holds other bytes after
        the upload (a job writing the same key at the same time)."""
        if not local.is_file():
            raise FileNotFoundError(local)
        size, md5, sha = file_digests(local)
        target = f"{self._root}/{local.name}"
        return self._put_confirmed(local.name, (size, md5, sha),
                                   lambda: call(self._fs, "put_file", str(local), target, size=size))

    def _put_confirmed(self, name: str, digests: tuple[int, str, str], put) -> dict:
        """``put()`` the object ``name`` of (size, md5, sha256) ``digests`` unless it is there already, then confirm
        it: its size, ETag and sha256; StorageError when the server holds other bytes after the upload."""
        size, md5, sha = digests
        meta = self._remote_info(name)
        if meta is None or not same_object(meta, size, md5):
            retrying(f"uploading {name}", self.uri, put)
            meta = self._remote_info(name) or {}
            if not same_object(meta, size, md5, unknown=True):
                raise StorageError(f"{self._url(name)}: {meta.get('size')} bytes on the server after its "
                                   f"upload, other than the {size} sent (another job writing the same key?); check "
                                   "that no other run uses this output_uri, then re-run to upload it again")
        return dict(size=size, etag=etag_of(meta), sha256=sha)

    def _remote_info(self, name: str) -> dict | None:
        """The object ``name``'s metadata, fresh from the server; None when there is none."""
        path = f"{self._root}/{name}"

        def get() -> dict | None:
            self._fs.invalidate_cache(path)
            try:
                return call(self._fs, "info", path)
            except FileNotFoundError:
                return None

        return retrying(f"reading {name}'s metadata", self.uri, get)


def file_digests(path: Path) -> tuple[int, str, str]:
    """(size, md5, sha256) of a local file, in one streamed pass (md5: what S3 gives as the ETag of an object put
    in one part)."""
    md5, sha, size = hashlib.md5(usedforsecurity=False), hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            md5.update(block)
            sha.update(block)
            size += len(block)
    return size, md5.hexdigest(), sha.hexdigest()


def same_object(meta: dict, size: int, md5: str, unknown: bool = False) -> bool:
    """Whether the object of ``meta`` holds the bytes of size ``size`` and MD5 ``md5``: its size equal, and its ETag
    equal to the MD5 where it is one (a multipart upload's is not); ``unknown``: what the size alone allows to
    think when the ETag is no MD5."""
    if meta.get("size") != size:
        return False
    tag = etag_of(meta)
    if tag and re.fullmatch(r"[0-9a-f]{32}", tag):
        return tag == md5
    return unknown


def staged_shards(run: RunDir) -> set[int]:
    """Shards with stats in the local shards/ folder: committed here (for a run kept in a bucket, not yet uploaded),
    from one listing of it."""
    return {int(n[:6]) for n in DIR_FILES.names(run.shards_dir) if n[:6].isdigit() and n[6:] == ".stats.json"}


def local_shards(run: RunDir) -> set[int]:
    """Shards with any file (tar, index or stats) in the local shards/ folder, from one listing of it."""
    return {int(n[:6]) for n in DIR_FILES.names(run.shards_dir) if n[:6].isdigit() and n[6:7] == "."}


def upload_state(run: RunDir) -> dict | None:
    """Where the run uploads its shards and how many committed shards have a recorded upload (from one listing of
    shards/ and uploads/); None for a run without output_uri."""
    try:
        uri = json.loads(run.files.read(run.output_uri_path))["output_uri"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if run.store:  # its own shards/ folder where the run is now (a copied prefix's file names the one it came from)
        uri = f"{run.store}/shards/"
    done = run.done_shards()
    return dict(uri=uri, uploaded=len(run.listed_shards(run.uploads_dir, ".json") & done), committed=len(done))


def fetch_uploaded(run: RunDir, shard: int) -> bytes | None:
    """The tar of ``shard`` read back from where its upload is recorded (its local copy deleted: keep_local=false),
    checked against the record; None when it has no upload record. StorageError when it cannot be read."""
    return fetch(run, shard, run.shard_file(shard).suffix)


def committed_tar(run: RunDir, shard: int) -> Any:
    """The committed tar of ``shard`` to read: its local file, or, when that was deleted once uploaded
    (keep_local=false), its bytes from the bucket as a file object."""
    return local_or_fetched(run, shard, run.shard_file(shard), run.shard_file(shard).suffix)


def uploaded_elsewhere(run: RunDir, shard: int, tar_bytes: int) -> bool:
    """Whether ``shard``'s tar is absent because it was uploaded (keep_local=false) as committed."""
    record = read_record(run, shard)
    return record is not None and record["tar_bytes"] == tar_bytes
