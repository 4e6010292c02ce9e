"""A shard in progress, alone: the partial tar is a valid tar prefix at every checkpoint, a resume truncates to
it, and a committed shard holds every sample once with its stats written last."""

from __future__ import annotations

import io
import tarfile

import numpy as np

from shardgen.dataio.rundir.fileio import read_json
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.shards.shardwork import Sample, ShardWork, shard_checkpoints
from shardgen.dataio.shards.tarshard import PartialTar


def names_in(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return tf.getnames()


def test_partial_tar_is_a_valid_prefix_and_resumes_at_its_checkpoint(tmp_path):
    part = tmp_path / "x.g1.tar"
    t = PartialTar(part)
    t.append([("a.txt", b"A" * 700), ("b.txt", b"B")])
    ckpt, sha = t.sync(), t.sha256
    assert ckpt % 512 == 0 and names_in(part.read_bytes()) == ["a.txt", "b.txt"]
    t.append([("lost.txt", b"written after the checkpoint, then the process died")])
    t.close()
    t = PartialTar(tmp_path / "x.g2.tar", prefix_of=part, prefix_bytes=ckpt, prefix_sha256=sha)
    t.append([("c.txt", b"C")])
    t.finish()
    with tarfile.open(t.path) as tf:
        assert tf.getnames() == ["a.txt", "b.txt", "c.txt"]
        assert tf.extractfile("a.txt").read() == b"A" * 700


def sample(i: int, status: str = "ok") -> Sample:
    return Sample(key=f"{i:010d}", index=i, prompt=f"p{i}", meta={"index": i, "status": status},
                  pixels=np.full((4, 4, 3), i, np.uint8) if status == "ok" else None,
                  failure=None if status == "ok" else "CUDA error: out of memory", status=status)


def write(work: ShardWork, *samples: Sample) -> None:
    work.write(list(samples), [b"img%d" % s.index if s.status == "ok" else None for s in samples], "png")


def test_shard_work_resumes_from_the_best_checkpoint_and_commits_each_sample_once(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    first = ShardWork.open(run, 0, gen=1, indices=range(4))
    write(first, sample(0), sample(1, "failed"))
    first.close()  # the holder died after two durable samples
    second = ShardWork.open(run, 0, gen=2, indices=range(4))
    assert second.n_done == 2 and second.counts["failed"] == 1
    write(second, sample(2), sample(3))
    stats = second.commit()
    assert (stats["count"], stats["ok"], stats["failed"]) == (4, 3, 1)
    assert [f["index"] for f in stats["failed_samples"]] == [1]
    assert read_json(run.shard_stats(0)) == stats and run.done_shards() == {0}
    names = names_in(run.shard_file(0).read_bytes())
    assert len(names) == len(set(names)) == 3 * 3  # image, txt and json each; the failure is in the index only
    assert [n for n in names if n.endswith(".png")] == [f"{i:010d}.png" for i in (0, 2, 3)]
    assert shard_checkpoints(run, 0) == []  # nothing of the earlier generations is left
