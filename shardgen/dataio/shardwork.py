"""One shard in progress: resume from the best checkpoint, append batches, commit, write stats last."""

from __future__ import annotations

import io
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shardgen.dataio import index as shard_index
from shardgen.dataio.rundir import RunDir, atomic_write_json, read_json
from shardgen.dataio.tarshard import PartialTar, copy_prefix

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

    @classmethod
    def carried(cls, key: str, members: dict[str, bytes]) -> "Sample":
        """A committed sample copied as it is into a rewritten shard."""
        meta = json.loads(members["json"])
        return cls(key=key, index=meta["index"], prompt=meta.get("prompt"), meta=meta, status=meta["status"],
                   failure=meta.get("error"), members=[(f"{key}.{ext}", data) for ext, data in members.items()])


def encode_image(pixels, fmt: str, quality: int) -> bytes:
    """Encode an HxWx3 uint8 array as png / jpg / webp bytes."""
    from PIL import Image

    buf = io.BytesIO()
    img = Image.fromarray(pixels)
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=1)  # level 1: ~4x faster than 6, ~10% larger
    elif fmt == "jpg":
        img.save(buf, format="JPEG", quality=quality)
    elif fmt == "webp":
        img.save(buf, format="WEBP", quality=quality)
    else:
        raise ValueError(f"unknown image format {fmt!r}")
    return buf.getvalue()


def sample_members(s: Sample, image: bytes | None, fmt: str) -> list[tuple[str, bytes]]:
    """The tar members of one sample: image (if any), prompt text, metadata json."""
    members = []
    if image is not None:
        members.append((f"{s.key}.{fmt}", image))
    members.append((f"{s.key}.txt", (s.prompt or "").encode("utf-8")))
    meta = dict(s.meta, status=s.status)
    if s.failure:
        meta["error"] = s.failure[:MAX_REASON_CHARS]
    members.append((f"{s.key}.json", json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")))
    return members


def _reason_class(reason: str) -> str:
    """The part of a failure reason used to group failures (before the first colon)."""
    return reason.split(":", 1)[0][:80]


@dataclass
class ShardWork:
    """The writer-side state of one claimed shard."""

    run: RunDir
    shard: int
    gen: int
    num_rows: int
    tar: PartialTar
    index: shard_index.PartialIndex   # every sample's row; failed/rejected samples live only here
    n_done: int = 0
    counts: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    failed: list = field(default_factory=list)
    started: float = field(default_factory=time.time)

    @classmethod
    def open(cls, run: RunDir, shard: int, gen: int, num_rows: int) -> "ShardWork":
        """Start generation ``gen`` of ``shard``, continuing from the furthest earlier checkpoint."""
        best = _best_checkpoint(run, shard, gen)
        if not shard_index.resumable(run, shard, best):
            best = None
        path = run.partial_tar(shard, gen)
        if best is not None:
            copy_prefix(run.partial_tar(shard, best["gen"]), path, best["tar_bytes"])
        index = shard_index.PartialIndex.resume(run, shard, gen, best)
        work = cls(run=run, shard=shard, gen=gen, num_rows=num_rows, index=index,
                   tar=PartialTar(path, resume_bytes=best["tar_bytes"] if best else 0))
        if best:
            work.n_done = best["n_done"]
            work.counts.update(best["counts"])
            work.reasons.update(best["reasons"])
            work.failed = best["failed"]
            work.started = best["started"]
        _remove_older_generations(run, shard, gen)
        work._write_checkpoint()
        return work

    def write(self, samples: list[Sample], encoded: list[bytes | None], fmt: str) -> None:
        """Append samples (in index order) and checkpoint them durably."""
        members = []
        for s, img in zip(samples, encoded):
            record = s.members if s.members is not None else sample_members(s, img, fmt)
            self.index.add(record)
            if s.status == "ok":  # the tars hold images only: one layout for every reader
                members += record
            self.counts[s.status] += 1
            if s.status != "ok":
                self.reasons[_reason_class(s.failure or s.status)] += 1
                self.failed.append(dict(key=s.key, index=s.index, status=s.status, reason=(s.failure or "")[:MAX_REASON_CHARS]))
        self.tar.append(members)
        self.n_done += len(samples)
        self._write_checkpoint()

    def commit(self) -> dict:
        """Commit the tar and write its stats (the done marker); return the stats."""
        assert self.n_done == self.num_rows, f"shard {self.shard}: {self.n_done} of {self.num_rows} samples"
        self.index.commit(shard_index.index_path(self.run, self.shard))
        self.tar.commit(self.run.shard_tar(self.shard))
        stats = dict(shard=self.shard, count=self.n_done, ok=self.counts["ok"], failed=self.counts["failed"],
                     rejected=self.counts["rejected"], failures_by_reason=dict(self.reasons), failed_samples=self.failed,
                     tar_bytes=os.path.getsize(self.run.shard_tar(self.shard)), started=self.started,
                     finished=time.time(), wall_s=round(time.time() - self.started, 3))
        atomic_write_json(self.run.shard_stats(self.shard), stats)
        _remove_older_generations(self.run, self.shard, self.gen + 1)
        return stats

    def close(self) -> None:
        """Stop writing (the partial and its checkpoint stay for a resume)."""
        self.tar.close()
        self.index.close()

    def _write_checkpoint(self) -> None:
        tar_bytes = self.tar.sync()  # data durable before the record that points at it
        self.index.sync()
        atomic_write_json(self.run.checkpoint(self.shard, self.gen), dict(
            shard=self.shard, gen=self.gen, n_done=self.n_done, tar_bytes=tar_bytes, counts=dict(self.counts),
            reasons=dict(self.reasons), failed=self.failed, started=self.started, updated=time.time()))


def shard_checkpoints(run: RunDir, shard: int) -> list[dict]:
    """All readable checkpoint records of ``shard`` (any generation)."""
    prefix = f"{shard:06d}.g"
    out = []
    for name in os.listdir(run.work_dir):
        if name.startswith(prefix) and name.endswith(".ckpt.json"):
            try:
                out.append(read_json(run.work_dir / name))
            except (ValueError, FileNotFoundError):
                pass
    return out


def _best_checkpoint(run: RunDir, shard: int, below_gen: int) -> dict | None:
    cands = [c for c in shard_checkpoints(run, shard) if c["gen"] < below_gen and c["n_done"] > 0
             and run.partial_tar(shard, c["gen"]).exists()]
    return max(cands, key=lambda c: c["n_done"], default=None)


def _remove_older_generations(run: RunDir, shard: int, gen: int) -> None:
    for name in os.listdir(run.work_dir):
        if name.startswith(f"{shard:06d}.g"):
            g = int(name.split(".")[1][1:])
            if g < gen:
                Path(run.work_dir / name).unlink(missing_ok=True)
