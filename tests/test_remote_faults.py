"""output_uri faults found by testing: an uploaded object deleted from the bucket, two runs given one output_uri, a
server that accepts connections and never answers. Against the real S3 server of tests/s3_server.py."""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time

import pytest

import jobs.verify
from jobs.generate import run
from shardgen.dataio.rundir import StorageError
from shardgen.errors import UserError
from tests.conftest import compose_cfg

FAST = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=4")


def names(s3, url: str) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in s3.fs().ls(url, refresh=True)}


def test_a_deleted_uploaded_object_is_a_defect_of_its_shard_and_repair_or_a_resume_makes_it_again(
        s3, bucket, tmp_path, capsys):
    """keep_local=false: objects of shards 0 and 2 deleted from the bucket. jobs.verify lists both (exit 1, every
    shard checked), --repair has them generated again; a later deletion is noticed by the next launch itself."""
    run_dir, out = tmp_path / "run", f"s3://{bucket}/d2"
    cfg = compose_cfg(f"run_dir={run_dir}", f"output_uri={out}", "keep_local=false", "prompts.limit=6",
                      "samples_per_shard=2", *FAST)
    assert run(cfg).complete
    good = {n: s3.fs().cat_file(f"{out}/{n}") for n in ("000000.tar", "000002.parquet", "000001.tar")}
    s3.fs().rm(f"{out}/000000.tar")
    s3.fs().rm(f"{out}/000002.parquet")
    capsys.readouterr()
    assert jobs.verify.main([str(run_dir)]) == 1
    said = capsys.readouterr().out
    assert f"shard 000000: {out}/000000.tar missing from the bucket" in said, said
    assert f"shard 000002: {out}/000002.parquet missing from the bucket" in said, said
    assert "3/3 shards" in said and "shard 000001" not in said
    assert jobs.verify.main([str(run_dir), "--repair"]) == 1
    assert not (run_dir / "uploads" / "000000.json").exists() and not (run_dir / "uploads" / "000002.json").exists()
    result = run(cfg)
    assert (result.complete, result.generated_here) == (True, 4)
    assert s3.fs().cat_file(f"{out}/000000.tar") == good["000000.tar"]
    assert jobs.verify.main([str(run_dir)]) == 0
    # deleted again, no verify in between: the launch notices it (one listing) instead of "already complete"
    s3.fs().rm(f"{out}/000001.tar")
    result = run(cfg)
    assert (result.complete, result.generated_here) == (True, 2)
    assert s3.fs().cat_file(f"{out}/000001.tar") == good["000001.tar"]
    assert jobs.verify.main([str(run_dir)]) == 0


def test_keep_local_true_an_object_deleted_from_the_bucket_is_uploaded_again_not_generated(s3, bucket, tmp_path,
                                                                                          capsys):
    run_dir, out = tmp_path / "run", f"s3://{bucket}/keep"
    cfg = compose_cfg(f"run_dir={run_dir}", f"output_uri={out}", "prompts.limit=4", "samples_per_shard=2", *FAST)
    assert run(cfg).complete
    s3.fs().rm(f"{out}/000001.stats.json")
    capsys.readouterr()
    assert jobs.verify.main([str(run_dir), "--repair"]) == 1
    said = capsys.readouterr().out
    assert f"{out}/000001.stats.json missing from the bucket" in said and "upload record removed" in said, said
    assert (run_dir / "shards" / "000001.tar").exists()
    result = run(cfg)
    assert (result.complete, result.generated_here) == (True, 0)
    assert "000001.stats.json" in names(s3, out)
    assert jobs.verify.main([str(run_dir)]) == 0


def test_a_second_run_at_the_same_output_uri_is_refused_the_same_run_moved_or_from_before_markers_is_not(
        s3, bucket, tmp_path, monkeypatch):
    out = f"s3://{bucket}/shared"
    first = compose_cfg(f"run_dir={tmp_path / 'a'}", f"output_uri={out}", "keep_local=false", "prompts.limit=4",
                        "samples_per_shard=2", *FAST)
    assert run(first).complete
    assert "_shardgen_run.json" in names(s3, out)
    before = {n: s3.fs().cat_file(f"{out}/{n}") for n in names(s3, out)}
    monkeypatch.setattr("shardgen.run.runner.apply_strategy", lambda *a: pytest.fail("a model was loaded"))
    other = compose_cfg(f"run_dir={tmp_path / 'b'}", f"output_uri={out}/", "keep_local=false", "prompts.limit=6",
                        "seed=7", "samples_per_shard=3", *FAST)
    with pytest.raises(UserError) as e:
        run(other)
    msg = str(e.value)
    assert f"{out}/" in msg and "another output_uri" in msg and "\n" not in msg, msg
    assert not (tmp_path / "b").exists()  # refused before the run directory was made
    assert {n: s3.fs().cat_file(f"{out}/{n}") for n in names(s3, out)} == before  # nothing overwritten
    monkeypatch.undo()
    # the same run, its directory moved: still its folder
    shutil.move(tmp_path / "a", tmp_path / "moved")
    moved = compose_cfg(f"run_dir={tmp_path / 'moved'}", f"output_uri={out}", "keep_local=false", "prompts.limit=4",
                        "samples_per_shard=2", *FAST)
    again = run(moved)
    assert (again.complete, again.generated_here) == (True, 0)
    # a folder uploaded to before markers existed (none there): taken as this run's, and marked
    s3.fs().rm(f"{out}/_shardgen_run.json")
    assert run(moved).complete and "_shardgen_run.json" in names(s3, out)


def test_of_two_new_runs_racing_for_one_output_uri_only_the_first_marker_holds(s3, bucket, tmp_path, monkeypatch):
    """Another run writes its marker between this launch's look (none there) and its write: the exclusive create
    fails, the read-back names the other run, and this launch is refused; the other run's marker stays."""
    import json

    from shardgen.dataio.shards.upload import ShardUploader

    out = f"s3://{bucket}/race"
    theirs = json.dumps({"run_id": "the-other-run", "run_dir": "/elsewhere/run"}).encode()
    s3.fs().pipe_file(f"{out}/_shardgen_run.json", theirs)
    looked, create = {"wrote": False}, ShardUploader._create_marker
    read = ShardUploader._read_marker

    def racing_read(self):  # the marker is not there yet when this launch looks
        return read(self) if looked["wrote"] else None

    def create_after_the_other(self, body):
        looked["wrote"] = True
        return create(self, body)

    monkeypatch.setattr(ShardUploader, "_read_marker", racing_read)
    monkeypatch.setattr(ShardUploader, "_create_marker", create_after_the_other)
    cfg = compose_cfg(f"run_dir={tmp_path / 'a'}", f"output_uri={out}", "prompts.limit=2", *FAST)
    with pytest.raises(UserError, match="the-other-run"):
        run(cfg)
    assert s3.fs().cat_file(f"{out}/_shardgen_run.json") == theirs


class SilentServer:
    """Accepts TCP connections and never answers (a hung endpoint, a paused proxy)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def test_a_server_that_never_answers_is_reported_naming_the_url_each_retry_logged(s3, tmp_path, monkeypatch,
                                                                                 caplog):
    import s3fs

    silent = SilentServer()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.port}")
    monkeypatch.setenv("SHARDGEN_STORAGE_TIMEOUT_S", "1")
    monkeypatch.setattr("shardgen.dataio.rundir.remote.RETRIES", 3)
    monkeypatch.setattr("shardgen.dataio.rundir.remote.BACKOFF_S", 0.1)
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would still reach the real server
    out = "s3://hung-bucket/run"
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"output_uri={out}", "prompts.limit=2", *FAST)
    got: list = []

    def launch() -> None:
        try:
            run(cfg)
            got.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            got.append(e)

    t0 = time.time()
    with caplog.at_level(logging.WARNING, logger="shardgen.storage"):
        worker = threading.Thread(target=launch, daemon=True)
        worker.start()
        worker.join(timeout=30)
    try:
        assert not worker.is_alive(), "the launch still hangs after 30 s"
        assert got and isinstance(got[0], StorageError), got
        assert f"{out}/" in str(got[0]) and "failed 3 times" in str(got[0]) and "timeout" in str(got[0]).lower()
        retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
        assert len(retries) == 2 and all(r.startswith(f"{out}/") for r in retries), retries
        assert time.time() - t0 < 20
    finally:
        silent.close()
        s3fs.S3FileSystem.clear_instance_cache()


def test_the_storage_timeout_is_set_on_the_filesystems_and_can_be_overridden(monkeypatch):
    from shardgen.dataio.rundir.remote import filesystem

    fs, _ = filesystem("s3://some-bucket/x")
    assert (fs.config_kwargs["connect_timeout"], fs.config_kwargs["read_timeout"]) == (5.0, 10.0)
    assert fs.retries == 1
    monkeypatch.setenv("SHARDGEN_STORAGE_TIMEOUT_S", "3")
    fs, _ = filesystem("s3://some-bucket/x")
    assert (fs.config_kwargs["connect_timeout"], fs.config_kwargs["read_timeout"]) == (3.0, 3.0)
    monkeypatch.setenv("SHARDGEN_STORAGE_TIMEOUT_S", "soon")
    with pytest.raises(StorageError, match="SHARDGEN_STORAGE_TIMEOUT_S=soon"):
        filesystem("s3://some-bucket/x")
    monkeypatch.delenv("SHARDGEN_STORAGE_TIMEOUT_S")
    http, _ = filesystem("http://127.0.0.1:1/p.txt")
    assert http.client_kwargs["timeout"].sock_read == 10.0


def test_keep_local_true_an_object_written_over_at_the_same_size_is_a_defect_and_uploaded_again(s3, bucket, tmp_path,
                                                                                               capsys):
    run_dir, out = tmp_path / "run", f"s3://{bucket}/same-size"
    cfg = compose_cfg(f"run_dir={run_dir}", f"output_uri={out}", "prompts.limit=4", "samples_per_shard=2", *FAST)
    assert run(cfg).complete
    good = s3.fs().cat_file(f"{out}/000001.tar")
    s3.fs().pipe(f"{out}/000001.tar", bytes(len(good)))  # another job's bytes, the same size
    capsys.readouterr()
    assert jobs.verify.main([str(run_dir)]) == 1
    said = capsys.readouterr().out
    assert f"shard 000001: {out}/000001.tar written over in the bucket (ETag " in said, said
    result = run(cfg)  # the launch notices it from the listing: the local copy is uploaded again
    assert (result.complete, result.generated_here) == (True, 0)
    assert s3.fs().cat_file(f"{out}/000001.tar") == good
    assert jobs.verify.main([str(run_dir)]) == 0
