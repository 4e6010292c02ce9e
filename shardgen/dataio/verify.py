"""Auditing a run: every prompt index exactly once across committed shards, every tar readable,
counts equal to the stats. Used by ``jobs.verify`` and the tests."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from shardgen.dataio.index import committed_samples
from shardgen.dataio.plan import Plan, sample_key
from shardgen.dataio.rundir import read_json
from shardgen.dataio.video import VIDEO_EXT, check_video_member

IMAGE_EXTS = ("png", "jpg", "webp")
MEDIA_EXTS = IMAGE_EXTS + (VIDEO_EXT,)  # a sample's one image or video member


@dataclass
class VerifyReport:
    """Defects found (empty = the run is complete and sound)."""

    shards_checked: int = 0
    samples: int = 0
    status: Counter = field(default_factory=Counter)
    defects: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.defects


def read_shard_members(path) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes} of one tar (raises on an unreadable tar)."""
    samples: dict[str, dict[str, bytes]] = defaultdict(dict)
    with tarfile.open(path) as tf:
        for m in tf:
            if not m.isfile():
                continue
            key, _, ext = m.name.partition(".")
            if ext in samples[key]:
                raise ValueError(f"{path}: member {m.name} appears twice")
            samples[key][ext] = tf.extractfile(m).read()
    return samples


def _check_sample(key: str, members: dict[str, bytes], decode: bool) -> tuple[str, list[str]]:
    problems = []
    for ext in ("txt", "json"):
        if ext not in members:
            problems.append(f"{key}: no .{ext}")
    meta = json.loads(members.get("json", b"{}"))
    status = meta.get("status", "?")
    images = [e for e in MEDIA_EXTS if e in members]
    if status == "ok" and len(images) != 1:
        problems.append(f"{key}: status ok but {len(images)} images")
    if status != "ok" and images:
        problems.append(f"{key}: status {status} but has an image")
    if status != "ok" and not meta.get("error"):
        problems.append(f"{key}: status {status} without a recorded reason")
    if decode and images == [VIDEO_EXT]:  # decodes every frame; counts them against the json
        problems += check_video_member(key, members[VIDEO_EXT], meta)
    elif decode and images:
        from PIL import Image

        try:
            Image.open(io.BytesIO(members[images[0]])).load()
        except Exception as e:
            problems.append(f"{key}: image does not decode ({e})")
    return status, problems


def verify_run(plan: Plan, decode: bool = True) -> VerifyReport:
    """Check every shard of ``plan``; report each defect in a line that names the shard and key."""
    rep = VerifyReport()
    run = plan.run
    for shard in range(plan.num_shards):
        tar, stats = run.shard_tar(shard), run.shard_stats(shard)
        if not stats.exists() or not tar.exists():
            rep.defects.append(f"shard {shard:06d}: not committed ({'stats' if tar.exists() else 'tar'} missing)")
            continue
        rep.shards_checked += 1
        try:
            members = read_shard_members(tar)
        except Exception as e:
            rep.defects.append(f"shard {shard:06d}: unreadable tar ({e})")
            continue
        members, problems = committed_samples(run, shard, members)  # + failed/rejected rows of the index
        rep.defects += [f"shard {shard:06d}: {p}" for p in problems]
        expected = {sample_key(i) for i in plan.shard_range(shard)}
        got = set(members)
        if got != expected:
            rep.defects.append(f"shard {shard:06d}: {len(expected - got)} prompt indices missing, "
                               f"{len(got - expected)} unexpected keys")
        st = read_json(stats)
        if st["count"] != len(got):
            rep.defects.append(f"shard {shard:06d}: stats count {st['count']} != {len(got)} samples in the tar")
        shard_status: Counter = Counter()
        for key, mem in members.items():
            status, problems = _check_sample(key, mem, decode)
            shard_status[status] += 1
            rep.defects += [f"shard {shard:06d}: {p}" for p in problems]
        for k in ("ok", "failed", "rejected"):
            if st.get(k, 0) != shard_status[k]:
                rep.defects.append(f"shard {shard:06d}: stats say {st.get(k, 0)} {k}, the tar has {shard_status[k]}")
        rep.status.update(shard_status)
        rep.samples += len(got)
    return rep
