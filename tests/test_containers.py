"""A shard container is one module: a toy one (length-prefixed records), registered here, carries a whole job —
checkpoints, a resume from a verified prefix after the storage refused a write, the commit, jobs.verify — with the
samples' bytes of the tar container; a launch asking another container of a planned run is refused."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from jobs.generate import run
from shardgen.dataio.rundir.fileio import open_fresh, open_regular
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.storage import DiskFullError
from shardgen.dataio.shards.container import (ContainerError, ShardContainer, ShardScan, get_container,
                                              read_shard_members, register_container, unregister_container)
from shardgen.dataio.prompts.plan import load_plan
from shardgen.errors import UserError
from shardgen.tools.verify import verify_run
from tests.conftest import compose_cfg

HEAD = struct.Struct("<HQ")   # name length, data length
END = b"END!"                  # closes the container


class RecWriter:
    """The toy container's partial file: records appended, the sha256 of the bytes kept, a verified prefix copied."""

    fail_at_append: int | None = None  # the storage refuses a writer's append number N (the resume test)

    def __init__(self, path, prefix_of=None, prefix_bytes=0, prefix_sha256=None):
        self.path, self.bytes, self._sha, self.appends = Path(path), 0, hashlib.sha256(), 0
        self._f = os.fdopen(open_fresh(self.path), "w+b")
        if prefix_of is not None and prefix_bytes:
            with open(prefix_of, "rb") as f:
                self._write(f.read(prefix_bytes))
            if self._sha.hexdigest() != prefix_sha256:
                self.discard()
                raise ValueError(f"{prefix_of}: its first {prefix_bytes} bytes do not match their checkpoint")

    def _write(self, blob: bytes) -> None:
        self._f.write(blob)
        self._sha.update(blob)
        self.bytes += len(blob)

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def append(self, members):
        self.appends += 1
        if self.appends == RecWriter.fail_at_append:
            raise DiskFullError(f"no space left writing {self.path}; free some and re-run the same command")
        self._write(b"".join(HEAD.pack(len(n.encode()), len(d)) + n.encode() + d for n, d in members))

    def sync(self) -> int:
        self._f.flush()
        os.fsync(self._f.fileno())
        return self.bytes

    def finish(self) -> None:
        self._write(END)
        self.sync()
        self._f.close()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _records(data: bytes):
    """(name, payload, end offset) of each whole record; then whether END closes the data."""
    pos, out = 0, []
    while pos + HEAD.size <= len(data) and data[pos:pos + 4] != END:
        n, size = HEAD.unpack_from(data, pos)
        end = pos + HEAD.size + n + size
        if end > len(data):
            break
        out.append((data[pos + HEAD.size:pos + HEAD.size + n].decode(), data[pos + HEAD.size + n:end], end))
        pos = end
    return out, data[pos:pos + 4] == END and pos + 4 == len(data), pos


def rec_scan(path, keys, limit=None) -> ShardScan:
    with open_regular(path, follow=False) as f:
        data = f.read() if limit is None else f.read(limit)
    scan = ShardScan()
    records, closed, pos = _records(data)
    for name, payload, end in records:
        key, _, ext = name.partition(".")
        if len(scan.samples) >= len(keys) or key != keys[len(scan.samples)]:
            scan.problem = f"unexpected member {name}"
            return scan
        if ext == "json":
            scan.samples.append(json.loads(payload))
            scan.end = end
    scan.complete = closed and pos == scan.end
    scan.closed_end = pos + 4 if scan.complete else 0
    return scan


def rec_members(path):
    data = path.read() if hasattr(path, "read") else Path(path).read_bytes()
    records, closed, _ = _records(data)
    if not closed:
        raise ValueError("not a closed rec container")
    out: dict[str, dict[str, bytes]] = {}
    for name, payload, _ in records:
        key, _, ext = name.partition(".")
        out.setdefault(key, {})[ext] = payload
    return out


@pytest.fixture(scope="module")
def rec():
    register_container(ShardContainer("rec", writer=RecWriter, scan=rec_scan, read_members=rec_members))
    yield
    unregister_container("rec")


@pytest.fixture(scope="module")
def made(rec, tmp_path_factory):
    """The same job in the tar container and in the toy one (made once for the module)."""
    d = tmp_path_factory.mktemp("containers")
    results = {c: run(compose_cfg(f"run_dir={d / c}", *ARGS, f"shard_container={c}")) for c in ("tar", "rec")}
    return d, results


ARGS = ("height=64", "width=64", "steps=1", "prompts.limit=6", "samples_per_shard=3", "batch_size=2",
        "progress=false")


def _samples(run_dir: Path, container: str) -> dict:
    rd = RunDir(run_dir, container)
    return {k: m for f in rd.shard_files() for k, m in read_shard_members(f, container).items()}


def test_a_toy_container_carries_a_job_with_the_tar_containers_sample_bytes(made):
    d, results = made
    assert (results["rec"].ok, results["rec"].complete) == (results["tar"].ok, True) == (6, True)
    assert sorted(p.name for p in (d / "rec" / "shards").glob("*.rec")) == ["000000.rec", "000001.rec"]
    assert not list((d / "rec" / "shards").glob("*.tar"))
    assert _samples(d / "rec", "rec") == _samples(d / "tar", "tar")  # images, captions, json
    report = verify_run(load_plan(RunDir(d / "rec")))
    assert report.ok and report.shards_checked == 2, report.defects


def test_a_toy_container_resumes_from_its_checkpointed_prefix(made, tmp_path):
    d, _ = made
    RecWriter.fail_at_append = 2  # a shard's first batch of 2 is checkpointed, its last sample is refused
    try:
        with pytest.raises(DiskFullError):
            run(compose_cfg(f"run_dir={tmp_path / 'r'}", *ARGS, "shard_container=rec"))
    finally:
        RecWriter.fail_at_append = None
    assert list((tmp_path / "r" / "work").glob("*.rec")) and not list((tmp_path / "r" / "shards").glob("*.rec"))
    # the refused launch's claim is taken over once its lease runs out (short here)
    again = run(compose_cfg(f"run_dir={tmp_path / 'r'}", *ARGS, "shard_container=rec", "lease_s=3", "heartbeat_s=1"))
    assert (again.ok, again.complete) == (6, True)
    assert again.generated_here < 6  # the checkpointed samples were not made again
    for shard in (0, 1):
        assert (RunDir(tmp_path / "r", "rec").shard_file(shard).read_bytes()
                == RunDir(d / "rec", "rec").shard_file(shard).read_bytes())


def test_a_launch_asking_another_container_of_a_planned_run_is_refused(made, tmp_path):
    d, _ = made
    with pytest.raises(ContainerError, match="planned with shard_container=rec.*Set shard_container=rec"):
        run(compose_cfg(f"run_dir={d / 'rec'}", *ARGS))
    with pytest.raises(UserError, match=r"shard_container='zip': use one of \['rec', 'tar'\]"):
        run(compose_cfg(f"run_dir={tmp_path / 'z'}", *ARGS, "shard_container=zip"))
    with pytest.raises(UserError, match=r"shard_container='zip': use one of"):  # a dry run refuses it too
        run(compose_cfg(f"run_dir={tmp_path / 'z'}", *ARGS, "shard_container=zip", "dry_run=true"))
    assert not (tmp_path / "z").exists()
    assert get_container().name == "tar"
