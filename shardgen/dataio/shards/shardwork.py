"""One shard in progress: resume from the best checkpoint, append batches, commit, write stats last."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shardgen.dataio.shards import index as shard_index
from shardgen.dataio.prompts.plan import sample_key
from shardgen.dataio.prompts.rowsettings import shape_label
from shardgen.dataio.rundir.fileio import atomic_write_json, json_bytes, open_regular, read_state
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.runfiles import DIR_FILES
from shardgen.dataio.rundir.storage import DiskFullError, RunDirError
from shardgen.dataio.shards.container import PartialShard, get_container
from shardgen.dataio.shards.tarshard import fsync_dir
from shardgen.dataio.shards.uploaded import record_stats

log = logging.getLogger("shardgen.shard")

MAX_REASON_CHARS = 300  # an error string is kept short: the json and the stats stay readable


@dataclass
class Sample:
    """A finished sample handed from the generation loop to the writer."""

    key: str
    index: int
    prompt: str | None
    meta: dict
    pixels: object | None = None   # HxWx3 uint8 numpy array, None for a failure
    failure: str | None = None     # reason, when no image
    status: str = "ok"             # ok | failed | rejected
    members: list | None = None    # tar members carried over unchanged (retry_failed keeps good samples)
    gen_s: float | None = None     # generation time per sample: in the index only, never in the tar (so a
    #                                resumed run's tars equal an uninterrupted run's byte for byte)

    @classmethod
    def carried(cls, key: str, members: dict[str, bytes]) -> "Sample":
        """A committed sample copied as it is into a rewritten shard."""
        meta = json.loads(members["json"])
        return cls(key=key, index=meta["index"], prompt=meta.get("prompt"), meta=meta, status=meta["status"],
                   failure=meta.get("error"), members=[(f"{key}.{ext}", data) for ext, data in members.items()])


def sample_members(s: Sample, image: bytes | None, fmt: str) -> list[tuple[str, bytes]]:
    """The tar members of one sample: image (if any), prompt text, metadata json."""
    members = []
    if image is not None:
        members.append((f"{s.key}.{fmt}", image))
    members.append((f"{s.key}.txt", (s.prompt or "").encode("utf-8")))
    meta = dict(s.meta, status=s.status)
    meta.pop("error", None)  # only ours: an input column of that name is never taken for a failure
    if s.failure:
        meta["error"] = s.failure[:MAX_REASON_CHARS]
    members.append((f"{s.key}.json", json.dumps(meta, ensure_ascii=False, sort_keys=True, allow_nan=False)
                    .encode("utf-8")))
    return members


def _reason_class(reason: str) -> str:
    """The part of a failure reason used to group failures (before the first colon)."""
    return reason.split(":", 1)[0][:80]


def stats_from_samples(shard: int, metas: list[dict]) -> tuple[Counter, Counter, list, Counter]:
    """(status counts, failure reasons, failed-sample records, images per shape) of a shard's sample jsons."""
    counts, reasons, failed, shapes = Counter(), Counter(), [], Counter()
    for meta in metas:
        _count(counts, reasons, failed, meta["status"], meta.get("error"), meta.get("key") or sample_key(meta["index"]),
               meta["index"])
        counts["truncated"] += bool(meta.get("truncated"))
        count_shape(shapes, meta["status"], meta)
    return counts, reasons, failed, shapes


def count_shape(shapes: Counter, status: str, meta: dict) -> None:
    """Count an ok sample under its shape (``shape_label``: width x height [x frames], from its json): the one
    count of images per shape, written in the shard's stats, that jobs.status and jobs.report sum."""
    if status == "ok":
        shapes[shape_label(meta.get("width"), meta.get("height"), meta.get("frames"))] += 1


def _count(counts: Counter, reasons: Counter, failed: list, status: str, failure: str | None, key: str,
           index: int) -> None:
    counts[status] += 1
    if status != "ok":
        reasons[_reason_class(failure or status)] += 1
        failed.append(dict(key=key, index=index, status=status, reason=(failure or "")[:MAX_REASON_CHARS]))


CKPT_FIELDS = {"shard": int, "gen": int, "n_done": int, "tar_bytes": int, "sha256": str, "started": (int, float)}
STATS_FIELDS = {"shard": int, "count": int, "ok": int, "failed": int, "rejected": int, "tar_bytes": int,
                "failed_samples": list}


@dataclass
class ShardWork:
    """The writer-side state of one claimed shard; ``commit`` is the one place a shard is committed.

    The tar holds the ok samples only (one layout for every reader); the index (shardgen/dataio/shards/index.py)
    holds a row for every sample, failed and rejected ones included. Both advance batch by batch under one
    checkpoint."""

    run: RunDir
    shard: int
    gen: int
    indices: range
    file: PartialShard
    """The shard file under construction, in the run's container (``RunDir.container``)."""
    index: shard_index.PartialIndex
    n_done: int = 0
    counts: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    failed: list = field(default_factory=list)
    shapes: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.time)
    still_mine: Callable[[], bool] = lambda: True   # False once another replica took the shard over
    replaces: bool = False  # rewrites a committed shard on purpose (retry_failed); else a committed one stands
    # takes the exclusive right to commit just before the renames (Claimer.take_commit); the default is for a writer
    # without claims (one process: nothing to race with)
    take_commit: Callable[[], bool] = lambda: True

    @property
    def keys(self) -> list[str]:
        return [sample_key(i) for i in self.indices]

    @classmethod
    def open(cls, run: RunDir, shard: int, gen: int, indices: range, still_mine: Callable[[], bool] = lambda: True,
             replaces: bool = False, take_commit: Callable[[], bool] = lambda: True) -> "ShardWork":
        """Start generation ``gen`` of ``shard``, continuing from the furthest earlier checkpoint whose
        partial verifies: its index has a row for each of its samples, its tar's bytes hash to the checkpoint's
        sha256 and hold exactly the ok samples of those rows, in plan order. An unverifiable partial is reported
        and the shard restarts from its first sample."""
        file, ckpt, rows = None, None, None
        for ckpt in _checkpoints_by_progress(run, shard, gen):
            rows = _index_rows(run, shard, ckpt, indices)
            if rows is not None:
                file = _adopt(run, shard, gen, ckpt, [r["key"] for r in rows if r["status"] == "ok"])
            if file is not None:
                break
        if file is None:
            ckpt, rows, file = None, [], get_container(run.container).writer(run.partial_shard(shard, gen))
        work = cls(run=run, shard=shard, gen=gen, indices=indices, file=file, still_mine=still_mine, replaces=replaces,
                   take_commit=take_commit, index=shard_index.PartialIndex.resume(run, shard, gen, ckpt))
        if ckpt is not None:
            work.n_done, work.started = len(rows), float(ckpt["started"])
            metas = [json.loads(r["json"]) for r in rows]
            work.counts, work.reasons, work.failed, work.shapes = stats_from_samples(shard, metas)
        _remove_older_generations(run, shard, gen)
        work._write_checkpoint()
        return work

    def write(self, samples: list[Sample], encoded: list[bytes | None], fmt: str) -> None:
        """Append samples (in index order) and checkpoint them durably."""
        members = []
        for s, img in zip(samples, encoded):
            record = s.members if s.members is not None else sample_members(s, img, fmt)
            self.index.add(record, gen_s=s.gen_s)
            if s.status == "ok":  # the tars hold images only: one layout for every reader
                members += record
            _count(self.counts, self.reasons, self.failed, s.status, s.failure, s.key, s.index)
            self.counts["truncated"] += bool(s.meta.get("truncated"))
            count_shape(self.shapes, s.status, s.meta)
        self.file.append(members)
        self.n_done += len(samples)
        self._write_checkpoint()

    def commit(self) -> dict | None:
        """Commit the shard: close the tar, rename it into shards/, write its stats (the done marker,
        last); return the stats, or None when the shard was taken over meanwhile (nothing committed)."""
        assert self.n_done == len(self.indices), f"shard {self.shard}: {self.n_done} of {len(self.indices)} samples"
        self.file.finish()
        # a holder alive but silent past its lease and the replica that took its shard over can reach this point in
        # the same milliseconds: a check of the done marker then the renames would let both rename their tar, index
        # and stats one by one (files of two generations). take_commit is exclusive (an O_EXCL create): one wins,
        # the other leaves its partial files to the winner, which removes them at its commit (or, when the winner is
        # a takeover still resuming, continues from them)
        if not self.still_mine() or not self.take_commit():
            log.warning("shard %06d was taken over by another replica before its commit; leaving it", self.shard)
            self.close()
            return None
        if not self.replaces and self.run.is_done(self.shard):
            # the holder this replica took the shard over from was alive after all and committed it (whole, under its
            # own take_commit) before this replica claimed: its commit stands; ours would replace it
            log.warning("shard %06d was committed by the replica it was taken over from; dropping this copy", self.shard)
            self.close()
            remove_generation(self.run, self.shard, self.gen)
            return None
        final = self.run.shard_file(self.shard)
        try:  # taken over between still_mine and here: the new holder removes our partial files
            self.index.commit(shard_index.index_path(self.run, self.shard))  # the index first: a tar is never alone
            os.replace(self.file.path, final)
        except FileNotFoundError:  # the new holder removed our partial: it owns the shard now
            log.warning("shard %06d: its partial was removed by the replica that took it over; leaving it", self.shard)
            return None
        fsync_dir(final.parent)
        stats = shard_stats(self.shard, self.counts, self.reasons, self.failed, tar_bytes=self.file.bytes,
                            sha256=self.file.sha256, started=self.started, shapes=self.shapes)
        # beside the tar: a run kept in a bucket has it uploaded with the tar and index before its done marker
        DIR_FILES.replace(self.run.shard_stats(self.shard), json_bytes(stats))
        _remove_older_generations(self.run, self.shard, self.gen + 1)
        return stats

    def close(self) -> None:
        """Stop writing (the partial and its checkpoint stay for a resume)."""
        self.file.close()
        self.index.close()

    def _write_checkpoint(self) -> None:
        tar_bytes = self.file.sync()  # data durable before the record that points at it
        self.index.sync()
        atomic_write_json(self.run.checkpoint(self.shard, self.gen), dict(
            shard=self.shard, gen=self.gen, n_done=self.n_done, tar_bytes=tar_bytes, sha256=self.file.sha256,
            counts=dict(self.counts), started=self.started, updated=time.time()))


def shard_stats(shard: int, counts: Counter, reasons: Counter, failed: list, *, tar_bytes: int, sha256: str,
                started: float, shapes: Counter) -> dict:
    """The stats (done marker) of a committed shard; ``truncated``: its prompts a text encoder cut; ``shapes``:
    its images per shape (``count_shape``)."""
    now = time.time()
    return dict(shard=shard, count=counts["ok"] + counts["failed"] + counts["rejected"], ok=counts["ok"],
                failed=counts["failed"], rejected=counts["rejected"], truncated=counts["truncated"],
                failures_by_reason=dict(reasons), shapes=dict(sorted(shapes.items())), failed_samples=failed,
                tar_bytes=tar_bytes, sha256=sha256, started=started, finished=now, wall_s=round(now - started, 3))


def committed_stats(run: RunDir, shard: int) -> dict:
    """A committed shard's stats (RunDirError naming the file when they are damaged): its stats file, or, once its
    local files were deleted after their upload (keep_local=false), the stats its upload record keeps."""
    try:
        return run.files.state(run.shard_stats(shard), STATS_FIELDS)
    except RunDirError:
        if run.files.present(run.shard_stats(shard)) or not run.files.present(run.shard_uploaded(shard)):
            raise
        return record_stats(run, shard, STATS_FIELDS)


def read_checkpoint(path: Path) -> dict:
    """A checkpoint record (RunDirError if it is not one of this version)."""
    return read_state(path, CKPT_FIELDS)


def shard_checkpoints(run: RunDir, shard: int) -> list[dict]:
    """All valid checkpoint records of ``shard`` (any generation); damaged ones are skipped."""
    return all_checkpoints(run, {shard}).get(shard, [])


def all_checkpoints(run: RunDir, shards: set[int] | None = None) -> dict[int, list[dict]]:
    """shard -> its valid checkpoint records (of ``shards``, or all), from one listing of work/ (a reader of
    every shard in progress lists the directory once, not once per shard); damaged ones are skipped."""
    out: dict[int, list[dict]] = {}
    try:
        names = os.listdir(run.work_dir)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".ckpt.json") or not name[:6].isdigit() or name[6:8] != ".g":
            continue
        shard = int(name[:6])
        if shards is not None and shard not in shards:
            continue
        try:
            ckpt = read_checkpoint(run.work_dir / name)
        except RunDirError:
            continue
        if ckpt["shard"] == shard and name == run.checkpoint(shard, ckpt["gen"]).name:
            out.setdefault(shard, []).append(ckpt)
    return out


def durable_partial(run: RunDir, shard: int) -> bytes | None:
    """The durable bytes of ``shard``'s furthest partial tar (up to its checkpoint, a valid tar prefix), for
    readers of a run in progress (jobs.preview); None without one. Never written to, never trusted further."""
    for ckpt in sorted(shard_checkpoints(run, shard), key=lambda c: -c["n_done"]):
        path = run.partial_shard(shard, ckpt["gen"])
        try:
            with open_regular(path, follow=False) as f:  # a symlink or FIFO where a partial should be is not read
                data = f.read(ckpt["tar_bytes"])
        except OSError:
            continue
        if len(data) == ckpt["tar_bytes"]:
            return data
    return None


def _checkpoints_by_progress(run: RunDir, shard: int, below_gen: int) -> list[dict]:
    if below_gen <= 1:  # a first claim has nothing to continue: no listing of work/ (thousands of entries)
        return []
    cands = [c for c in shard_checkpoints(run, shard) if c["gen"] < below_gen and c["n_done"] > 0]
    return sorted(cands, key=lambda c: -c["n_done"])


def _index_rows(run: RunDir, shard: int, ckpt: dict, indices: range) -> list[dict] | None:
    """The ``n_done`` index rows of ``ckpt``'s generation, in plan order; None when they are missing or damaged."""
    if not shard_index.resumable(run, shard, ckpt):
        log.warning("shard %06d: generation %d's index lacks rows its checkpoint counts; restarting the shard",
                    shard, ckpt["gen"])
        return None
    try:
        rows = shard_index.partial_rows(run, shard, ckpt["gen"], ckpt["n_done"])
    except (ValueError, KeyError, OSError) as e:
        log.warning("shard %06d: generation %d's index is damaged (%s); restarting the shard", shard, ckpt["gen"], e)
        return None
    expected = [sample_key(i) for i in indices[:len(rows)]]
    if [r.get("key") for r in rows] != expected or any(r.get("status") not in ("ok", "failed", "rejected")
                                                       for r in rows):
        log.warning("shard %06d: generation %d's index rows are not the plan's samples; restarting the shard", shard,
                    ckpt["gen"])
        return None
    return rows


def _adopt(run: RunDir, shard: int, gen: int, ckpt: dict, keys: list[str]) -> PartialShard | None:
    """A partial shard file continuing ``ckpt``'s verified prefix, which must hold exactly the samples ``keys``; None
    when it does not verify."""
    src = run.partial_shard(shard, ckpt["gen"])
    container = get_container(run.container)
    try:
        file = container.writer(run.partial_shard(shard, gen), prefix_of=src, prefix_bytes=ckpt["tar_bytes"],
                                prefix_sha256=ckpt["sha256"])
    except (ValueError, OSError) as e:  # ValueError: the prefix does not hash to the checkpoint's sha256
        if isinstance(e, DiskFullError):
            raise
        log.warning("shard %06d: %s does not match its checkpoint (%s); restarting the shard from its first sample",
                    shard, src, e)
        return None
    scan = container.scan(file.path, keys, limit=file.bytes)
    if scan.problem or len(scan.samples) != len(keys) or scan.end != file.bytes:
        log.warning("shard %06d: %s holds %d whole samples, its index says %d (%s); restarting the shard",
                    shard, src, len(scan.samples), len(keys), scan.problem or "count differs")
        file.discard()
        return None
    return file


def _remove_older_generations(run: RunDir, shard: int, gen: int) -> None:
    """Remove the work files (partial tar, its index, checkpoint) of ``shard``'s generations below ``gen``, by
    name: generations are numbered from 1, so no listing of work/ (thousands of entries at cluster scale)."""
    for g in range(1, gen):
        remove_generation(run, shard, g)


def remove_generation(run: RunDir, shard: int, gen: int) -> None:
    """Remove the work files (partial tar, its index, checkpoint) of generation ``gen`` of ``shard``."""
    for path in (run.partial_shard(shard, gen), shard_index.partial_index_path(run, shard, gen),
                 run.checkpoint(shard, gen)):
        path.unlink(missing_ok=True)
