"""Prompts and shards on object storage, against a real S3-compatible server (tests/s3_server.py)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import re
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobs.status
import jobs.verify
from jobs.generate import run
from shardgen.config.validate import ConfigError
from shardgen.dataio.resume.fingerprint import FingerprintMismatch
from shardgen.dataio.rundir import StorageError
from shardgen.errors import UserError
from tests.conftest import compose_cfg
from tests.s3_server import ACCESS_DENIED, SECRET

FAST = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=4")


def put(s3, url: str, data: bytes) -> None:
    s3.fs().pipe(url, data)


def test_prompts_from_a_bucket_appended_to_extend_changed_refused_parquet_by_ranges(s3, bucket, tmp_path):
    lines = [f"a prompt number {i}" for i in range(10)]
    put(s3, f"s3://{bucket}/captions.txt", "".join(p + "\n" for p in lines).encode())
    txt = compose_cfg(f"run_dir={tmp_path / 'txt'}", f"prompts.path=s3://{bucket}/captions.txt",
                      "samples_per_shard=4", *FAST)
    first, again = run(txt), run(txt)
    assert (first.ok, again.generated_here) == (10, 0)  # the second launch finds the run complete, its file unchanged
    # the object rewritten with rows appended: the new rows extend the run, as for a local file
    put(s3, f"s3://{bucket}/captions.txt", "".join(p + "\n" for p in lines + ["one more", "and another"]).encode())
    result = run(txt)
    assert (result.ok, result.generated_here, result.complete) == (12, 2, True)
    # any other change (here, one row edited, the size unchanged) is refused, naming the URL, before any model
    put(s3, f"s3://{bucket}/captions.txt", "".join(p + "\n" for p in ["A" + lines[0][1:]] + lines[1:]
                                                   + ["one more", "and another"]).encode())
    with pytest.raises(FingerprintMismatch, match=f"s3://{bucket}/captions.txt: not this run's prompt file"):
        run(txt)
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"prompt": lines, "n": list(range(10))}), buf, row_group_size=3)
    put(s3, f"s3://{bucket}/captions.parquet", buf.getvalue().to_pybytes())
    result = run(compose_cfg(f"run_dir={tmp_path / 'pq'}", "prompts=parquet",
                             f"prompts.path=s3://{bucket}/captions.parquet",
                             "samples_per_shard=4", *FAST))
    assert (result.ok, result.complete) == (10, True)
    hashed = json.loads((tmp_path / "pq" / "prompt_hash.json").read_text())
    assert hashed["path"] == f"s3://{bucket}/captions.parquet" and hashed["etag"]


def test_a_large_remote_parquet_is_planned_from_its_footer_and_its_etag_guards_the_rows(s3, bucket, tmp_path):
    """200k rows planned with a few ranged reads (no row read, no hash pass); the object overwritten later: its rows
    are refused when a shard is read, naming the URL."""
    from shardgen.dataio.prompts.read import PromptFileError
    from shardgen.dataio.rundir import bytes_read
    from shardgen.run.runner import prepare_run

    n, url = 200_000, f"s3://{bucket}/big.parquet"
    table = pa.table({"prompt": [f"a photo of thing number {i}" for i in range(n)], "n": list(range(n))})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, row_group_size=20_000)
    put(s3, url, buf.getvalue().to_pybytes())
    size = s3.fs().info(url)["size"]
    plan = prepare_run(compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts=parquet", f"prompts.path={url}",
                                   "samples_per_shard=1000", *FAST))
    assert (plan.num_rows, plan.num_shards) == (n, 200)
    assert bytes_read(url) < size / 10, f"{bytes_read(url)} of {size} bytes read to plan"
    assert [r.prompt for r in plan.rows(150)][:2] == [f"a photo of thing number {i}" for i in (150000, 150001)]
    other = pa.BufferOutputStream()
    pq.write_table(table.slice(1), other, row_group_size=20_000)
    put(s3, url, other.getvalue().to_pybytes())  # another object: another ETag
    with pytest.raises(PromptFileError, match=f"{url}: the prompt file changed since the run was planned"):
        plan.rows(3)


def bucket_samples(s3, url: str) -> dict[str, list[str]]:
    """shard name -> the keys of its tar, over the shards whose stats (the done marker) are in the bucket."""
    import io
    import tarfile

    fs, out = s3.fs(), {}
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(url, refresh=True)}
    for stats in sorted(n for n in names if n.endswith(".stats.json")):
        shard = stats[:6]
        assert {f"{shard}.tar", f"{shard}.parquet"} <= names, f"{shard}: stats without its tar or index"
        data = fs.cat_file(f"{url}/{shard}.tar")
        assert len(data) == json.loads(fs.cat_file(f"{url}/{stats}"))["tar_bytes"]
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            out[shard] = sorted({m.name.split(".")[0] for m in tar.getmembers()})
    return out


def dir_bytes(path) -> int:
    """Bytes of the regular files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tool_answers(run_dir, capsys) -> dict[str, str]:
    """What jobs.status, jobs.verify, jobs.dedup and jobs.report say about ``run_dir``, with its path and the
    bucket folder (which differ between the runs compared) and the times of day taken out."""
    import re

    import jobs.dedup
    import jobs.report

    out = {}
    for name, tool, args in (("status", jobs.status, []), ("verify", jobs.verify, []),
                             ("dedup", jobs.dedup, ["--json", "--max-distance", "64"]), ("report", jobs.report, [])):
        capsys.readouterr()
        assert tool.main([str(run_dir), *args]) == 0, name
        out[name] = capsys.readouterr().out
    html = (run_dir / "report.html").read_text()
    # the report's figures that do not depend on when it ran: counts, failures, truncation, the contact sheet
    sections = dict(part.split("</h2>", 1) for part in html.split("<h2>")[1:])
    out["report"] = "".join(sections[k] for k in ("Counts", "Failures by reason", "Truncation", "Contact sheet"))
    out["status"] = "\n".join(line for line in out["status"].splitlines()
                              if not re.search(r"started|finished|elapsed|rate|/s\b|ago|uploads", line))
    return {k: v.replace(str(run_dir), "RUN").replace("/keep/", "/X/").replace("/drop/", "/X/") for k, v in out.items()}


def test_keep_local_false_leaves_no_shard_file_on_disk_and_every_tool_answers_as_with_keep_local_true(
        s3, bucket, tmp_path, capsys, monkeypatch):
    answers, runs = {}, {}
    for keep in ("true", "false"):
        run_dir = runs[keep] = tmp_path / f"keep-{keep}"
        folder = "keep" if keep == "true" else "drop"
        cfg = compose_cfg(f"run_dir={run_dir}", f"output_uri=s3://{bucket}/{folder}", f"keep_local={keep}",
                          "prompts.limit=10", "samples_per_shard=4", "signals=[phash]", *FAST)
        assert run(cfg).complete
        answers[keep] = tool_answers(run_dir, capsys)
    shards = runs["false"] / "shards"
    assert dir_bytes(shards) == 0 and not list(shards.iterdir())  # tars, indexes and stats all deleted
    assert dir_bytes(runs["true"] / "shards") > 0
    assert sorted(p.name for p in (runs["false"] / "uploads").iterdir()) == [f"00000{i}.json" for i in range(3)]
    assert answers["false"] == answers["true"]
    assert "10/10 samples" in answers["false"]["verify"]
    assert sorted(json.loads(answers["false"]["dedup"])[0]) == [f"{i:010d}" for i in range(10)]  # every phash read
    keys = bucket_samples(s3, f"s3://{bucket}/drop")
    assert sorted(k for ks in keys.values() for k in ks) == [f"{i:010d}" for i in range(10)]
    cfg = compose_cfg(f"run_dir={runs['false']}", f"output_uri=s3://{bucket}/drop", "keep_local=false",
                      "prompts.limit=10", "samples_per_shard=4", "signals=[phash]", *FAST)
    again = run(cfg)  # a complete run stays complete: nothing regenerated, nothing uploaded again
    assert again.complete and again.generated_here == 0 and dir_bytes(shards) == 0
    assert jobs.status.main([str(runs["false"])]) == 0
    assert f"uploads  3 of 3 committed shards in s3://{bucket}/drop/" in capsys.readouterr().out
    # the README's snippets, reading the bucket
    import fsspec
    import webdataset as wds
    from datasets import load_dataset
    from webdataset.gopen import gopen_schemes

    monkeypatch.setitem(gopen_schemes, "s3", lambda url, mode="rb", bufsize=8192, **kw: fsspec.open(url, mode).open())
    ds = wds.WebDataset(f"s3://{bucket}/drop/{{000000..000002}}.tar", shardshuffle=False).decode("pil")
    assert sorted(s["json"]["index"] for s in ds) == list(range(10))
    hf = load_dataset("webdataset", data_files={"train": f"s3://{bucket}/drop/*.tar"}, split="train",
                      cache_dir=str(tmp_path / "hf"))
    assert hf.num_rows == 10


@pytest.mark.parametrize("damage", ["truncated", "empty", "another job's"])
def test_an_object_in_the_bucket_that_is_not_the_uploaded_one_is_never_read_as_the_shard(s3, bucket, tmp_path,
                                                                                        capsys, damage):
    """keep_local=false, then the bucket's tar of shard 1 replaced: jobs.verify names it and --repair has the shard
    generated (and uploaded) again; the next launch makes exactly that shard."""
    run_dir, out = tmp_path / "run", f"s3://{bucket}/out"
    cfg = compose_cfg(f"run_dir={run_dir}", f"output_uri={out}", "keep_local=false", "prompts.limit=6",
                      "samples_per_shard=2", *FAST)
    assert run(cfg).complete
    good = s3.fs().cat_file(f"{out}/000001.tar")
    put(s3, f"{out}/000001.tar", {"truncated": good[:len(good) // 2], "empty": b"",
                                  "another job's": s3.fs().cat_file(f"{out}/000002.tar")}[damage])
    capsys.readouterr()
    assert jobs.verify.main([str(run_dir)]) == 1
    said = capsys.readouterr().out
    assert f"shard 000001: {out}/000001.tar written over in the bucket (" in said and "000000:" not in said
    assert jobs.verify.main([str(run_dir), "--repair"]) == 1
    result = run(cfg)
    assert (result.complete, result.generated_here) == (True, 2)
    assert s3.fs().cat_file(f"{out}/000001.tar") == good  # the same pixels, uploaded again
    assert jobs.verify.main([str(run_dir)]) == 0


def committed_shard(root) -> tuple:
    """(a RunDir at ``root`` holding shard 0 committed: a 2 kB tar, an index, stats; the tar's bytes)."""
    from shardgen.dataio.rundir.layout import RunDir

    run_dir = RunDir(root)
    run_dir.shards_dir.mkdir(parents=True)
    tar = b"t" * 2048
    run_dir.shard_file(0).write_bytes(tar)
    (run_dir.shards_dir / "000000.parquet").write_bytes(b"index")
    run_dir.shard_stats(0).write_text(json.dumps({"tar_bytes": 2048, "sha256": hashlib.sha256(tar).hexdigest()}))
    return run_dir, tar


def test_an_object_at_the_key_before_the_upload_is_sent_over_not_taken_as_the_shard(s3, bucket, tmp_path):
    """Another job's object already at the shard's names (same size or not): the upload sends the local bytes."""
    from shardgen.dataio.shards.upload import ShardUploader, committed_tar

    run_dir, tar = committed_shard(tmp_path / "run")
    put(s3, f"s3://{bucket}/out/000000.tar", b"u" * 2048)  # the same size, other bytes
    put(s3, f"s3://{bucket}/out/000000.parquet", b"ind")
    ShardUploader(run_dir, f"s3://{bucket}/out", keep_local=False).upload(0)
    assert s3.fs().cat_file(f"s3://{bucket}/out/000000.tar") == tar
    assert s3.fs().cat_file(f"s3://{bucket}/out/000000.parquet") == b"index"
    assert committed_tar(run_dir, 0).read() == tar and not list(run_dir.shards_dir.iterdir())


def test_transient_faults_are_retried_and_the_run_completes(s3, bucket, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("shardgen.dataio.rundir.remote.BACKOFF_S", 0.2)
    lines = [f"prompt {i}" for i in range(8)]
    put(s3, f"s3://{bucket}/p.txt", "".join(p + "\n" for p in lines).encode())
    s3.proxy.fail_next(6)  # 503 SlowDown: more than the S3 client's own attempts (2 in tests) absorb
    outage = [threading.Timer(2.0, s3.proxy.down), threading.Timer(3.0, s3.proxy.up)]  # 1 s, mid-run
    for t in outage:
        t.start()
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path=s3://{bucket}/p.txt",
                      f"output_uri=s3://{bucket}/out", "samples_per_shard=2", *FAST)
    with caplog.at_level(logging.WARNING, logger="shardgen.storage"):
        result = run(cfg)
    for t in outage:  # over before the next test
        t.join()
    assert result.complete and s3.proxy.served_errors == 6
    assert any("retry 1 of" in r.getMessage() for r in caplog.records), "no retry was logged"
    keys = bucket_samples(s3, f"s3://{bucket}/out")
    assert sorted(k for ks in keys.values() for k in ks) == [f"{i:010d}" for i in range(8)]
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert not [p for p in files if SECRET.encode() in p.read_bytes()], "a credential was written into the run"


def test_uploads_failing_past_the_retries_stop_the_run_and_the_next_launch_finishes_them(s3, bucket, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setattr("shardgen.dataio.rundir.remote.RETRIES", 2)
    monkeypatch.setattr("shardgen.dataio.rundir.remote.BACKOFF_S", 0.05)
    out = f"s3://{bucket}/out"
    # a short lease: the claim the failed launch held (this process: alive) is taken over in seconds
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"output_uri={out}", "prompts.limit=6", "samples_per_shard=2",
                      "lease_s=2", "heartbeat_s=0.5", *FAST)
    monkeypatch.setattr("shardgen.dataio.shards.upload.ShardUploader.check", lambda self: None)  # down after it
    monkeypatch.setattr("shardgen.dataio.shards.upload.ShardUploader._claim_folder", lambda self: None)  # its marker
    s3.proxy.down()
    with pytest.raises(StorageError, match=f"{out}/: [a-z ]+000000.tar[a-z' ]* failed 2 times"):
        run(cfg)
    s3.proxy.up()
    committed = len(list((tmp_path / "run" / "shards").glob("*.stats.json")))  # uploads run beside generation
    assert committed >= 1 and not list((tmp_path / "run" / "uploads").glob("*.json"))
    result = run(cfg)
    assert (result.complete, result.generated_here) == (True, 6 - 2 * committed)  # uploaded now, not made again
    keys = bucket_samples(s3, out)
    assert sorted(k for ks in keys.values() for k in ks) == [f"{i:010d}" for i in range(6)]


@pytest.mark.parametrize("case", ["output bucket", "prompt object", "denied"])
def test_permanent_faults_are_one_line_naming_the_url_before_any_model(s3, bucket, tmp_path, monkeypatch, case):
    monkeypatch.setattr("shardgen.run.runner.apply_strategy", lambda *a: pytest.fail("a model was loaded"))
    put(s3, f"s3://{bucket}/p.txt", b"one\ntwo\n")
    prompts, out, url = f"s3://{bucket}/p.txt", f"s3://{bucket}/out", None
    if case == "output bucket":
        out = url = "s3://no-such-bucket-here/run"
    elif case == "prompt object":
        prompts = url = f"s3://{bucket}/missing.txt"
    else:
        url = prompts
        s3.proxy.fail_next(1000, ACCESS_DENIED)
    for dry in ("false", "true"):  # the dry run refuses what the launch refuses
        cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={prompts}", f"output_uri={out}",
                          f"dry_run={dry}", *FAST)
        with pytest.raises(UserError) as e:
            run(cfg)
        msg = str(e.value)
        assert url.rstrip("/") in msg and "\n" not in msg
        assert {"output bucket": "the bucket does not exist", "prompt object": "not found",
                "denied": "access denied"}[case] in msg
        assert not (tmp_path / "run").exists()
    s3.proxy.fail_next(0)


@dataclass
class BucketWatch:
    """Lists ``url`` over and over on a thread while jobs upload into it, reading every tar it lists: ``seen`` maps
    each tar name to the distinct contents read, ``unreadable`` the tars listed that were no whole, readable tar."""

    s3: Any
    url: str
    seen: dict = field(default_factory=dict)
    unreadable: list = field(default_factory=list)
    listings: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import io
        import tarfile

        fs = self.s3.fs()
        while not self.stop.wait(0.1):  # (a server on 2 shared cores: not a busy loop)
            try:
                listed = fs.ls(self.url, detail=True, refresh=True)
            except FileNotFoundError:  # nothing uploaded yet
                listed = []
            self.listings += 1
            for entry in listed:
                name = entry["name"].rsplit("/", 1)[-1]
                if not name.endswith(".tar"):
                    continue
                try:
                    data = fs.cat_file(entry["name"])
                    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                        for member in tar.getmembers():
                            tar.extractfile(member).read()
                except FileNotFoundError:
                    continue
                except Exception as e:
                    self.unreadable.append(f"{name} ({entry['size']} bytes listed): {e}")
                    continue
                if len(data) != entry["size"]:
                    self.unreadable.append(f"{name}: {entry['size']} bytes listed, {len(data)} read")
                self.seen.setdefault(name, set()).add(hashlib.sha256(data).hexdigest())

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.slow
def test_sigkilled_during_uploads_three_times_then_resumed_every_prompt_once_in_the_bucket(s3, bucket, tmp_path,
                                                                                          monkeypatch):
    """``python -m jobs.generate``, prompts in the bucket, shards to it with keep_local=false, SIGKILLed
    inside an upload three times (tests/upload_hook: after a tar is sent, before the stats are, after the stats
    and before the record), then resumed: every prompt exactly once in the bucket, every tar ever listed there
    whole and final, nothing of the shards left on the local disk."""
    import os
    import signal
    import time

    import fsspec
    import webdataset as wds
    from webdataset.gopen import gopen_schemes

    from tests.conftest import ROOT, start_module

    n = 12
    put(s3, f"s3://{bucket}/p.txt", "".join(f"prompt {i}\n" for i in range(n)).encode())
    run_dir, out = tmp_path / "run", f"s3://{bucket}/out"
    args = [f"run_dir={run_dir}", f"prompts.path=s3://{bucket}/p.txt", f"output_uri={out}", "keep_local=false",
            "samples_per_shard=2", *FAST]
    hook = ROOT / "tests" / "upload_hook"
    watch = BucketWatch(s3, out)
    # where each launch is killed, and what the bucket then holds and lacks (a shard half-sent each time)
    stops = [("after:000001.tar", {"000000.stats.json", "000001.tar"}, {"000001.stats.json"}),
             ("before:000001.stats.json", {"000001.tar", "000001.parquet"}, {"000001.stats.json"}),
             ("after:000002.stats.json", {"000001.stats.json", "000002.stats.json"}, set())]
    try:
        for i, (stop, present, absent) in enumerate(stops):
            flag = tmp_path / f"stopped-{i}"
            log = tmp_path / f"launch-{i}.log"
            p = start_module("jobs.generate", args, log, hooks=[hook],
                             env={**os.environ, "SHARDGEN_TEST_UPLOAD_STOP": f"{stop}:{flag}"})
            try:
                deadline = time.time() + 180
                while not flag.exists():
                    assert p.poll() is None, f"launch {i} ended before {stop}: {log.read_text()[-2000:]}"
                    assert time.time() < deadline, f"launch {i} did not reach {stop}: {log.read_text()[-2000:]}"
                    time.sleep(0.05)
                listed = watch.listings
                while watch.listings < listed + 2:  # the bucket as the kill finds it, read whole
                    time.sleep(0.05)
            finally:
                p.send_signal(signal.SIGKILL)
                p.wait()
            names = {x.rsplit("/", 1)[-1] for x in s3.fs().ls(out, refresh=True)}
            assert present <= names and not absent & names, (stop, sorted(names))
        assert not (run_dir / "uploads" / "000002.json").exists()  # killed between its stats and its record
        done = start_module("jobs.generate", args, tmp_path / "launch-last.log")
        assert done.wait(timeout=300) == 0, done.output[-2000:]
    finally:
        watch.close()
    assert not watch.unreadable, watch.unreadable
    assert {"000000.tar", "000001.tar"} <= watch.seen.keys()  # the watch read the tars the kills left
    final = {x.rsplit("/", 1)[-1]: s3.fs().cat_file(x) for x in s3.fs().ls(out, refresh=True) if x.endswith(".tar")}
    assert len(final) == n // 2 and watch.seen.keys() <= final.keys()
    for name, contents in watch.seen.items():  # every tar listed at any time was the final one, whole
        assert contents == {hashlib.sha256(final[name]).hexdigest()}, name
    monkeypatch.setitem(gopen_schemes, "s3", lambda url, mode="rb", bufsize=8192, **kw: fsspec.open(url, mode).open())
    keys = [s["__key__"] for s in wds.WebDataset(f"{out}/{{000000..{n // 2 - 1:06d}}}.tar", shardshuffle=False)]
    assert sorted(keys) == [f"{i:010d}" for i in range(n)]  # every prompt exactly once
    assert sorted(k for ks in bucket_samples(s3, out).values() for k in ks) == sorted(keys)
    left = {p.name: p.read_bytes()[:300] for d in ("shards", "work") for p in (run_dir / d).rglob("*") if p.is_file()}
    assert dir_bytes(run_dir / "shards") == 0 and dir_bytes(run_dir / "work") == 0, left
    assert len(list((run_dir / "uploads").iterdir())) == n // 2


def test_an_upload_killed_before_its_record_is_recorded_next_time_without_sending_it_again(s3, bucket, tmp_path,
                                                                                           monkeypatch):
    from shardgen.dataio.shards.upload import ShardUploader, committed_tar

    run_dir, tar = committed_shard(tmp_path / "run")
    uploader = ShardUploader(run_dir, f"s3://{bucket}/out", keep_local=False)

    def killed(*a):
        raise KeyboardInterrupt  # as a kill between the stats upload and the record

    monkeypatch.setattr("shardgen.dataio.rundir.runfiles.DirFiles.replace", killed)  # the record's write
    with pytest.raises(KeyboardInterrupt):
        uploader.upload(0)
    monkeypatch.undo()
    assert run_dir.shard_file(0).exists() and uploader.pending() == [0]  # nothing deleted before the record
    sent = []
    real = uploader._fs.put_file
    monkeypatch.setattr(uploader._fs, "put_file", lambda *a, **kw: (sent.append(a[0]), real(*a, **kw)))
    assert uploader.resume() == 1 and sent == [] and uploader.pending() == []
    assert dir_bytes(run_dir.shards_dir) == 0  # tar, index and stats deleted once the record is written
    assert committed_tar(run_dir, 0).read() == tar  # what retry_failed and jobs.signals read: from the bucket


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """python's file server answering byte ranges (``Range: bytes=A-B``, as object stores and CDNs do), quietly."""

    def send_head(self):
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if m is None or not os.path.isfile(path):
            return super().send_head()
        data = open(path, "rb").read()
        lo = int(m[1])
        part = data[lo:int(m[2]) + 1 if m[2] else None]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {lo}-{lo + len(part) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        return io.BytesIO(part)

    def log_message(self, *args):
        pass


@pytest.fixture
def web(tmp_path):
    """(a folder, the http:// URL it is served at) by a local http.server on a free port."""
    import functools

    folder = tmp_path / "www"
    folder.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(RangeHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_prompts_over_http_txt_and_parquet_planned_run_and_a_changed_file_refused(web, tmp_path):
    folder, url = web
    lines = [f"a prompt number {i}" for i in range(6)]
    (folder / "p.txt").write_text("".join(p + "\n" for p in lines))
    pq.write_table(pa.table({"prompt": lines}), folder / "p.parquet", row_group_size=2)
    txt = compose_cfg(f"run_dir={tmp_path / 'txt'}", f"prompts.path={url}/p.txt", "samples_per_shard=4", *FAST)
    first, again = run(txt), run(txt)
    assert (first.ok, first.complete, again.generated_here) == (6, True, 0)
    par = compose_cfg(f"run_dir={tmp_path / 'pq'}", "prompts=parquet", f"prompts.path={url}/p.parquet",
                      "samples_per_shard=4", *FAST)
    assert (run(par).ok, run(par).generated_here) == (6, 0)
    assert jobs.verify.main([str(tmp_path / "txt")]) == 0 and jobs.verify.main([str(tmp_path / "pq")]) == 0
    # the same bytes as the local file would give: the images of the http run are those of a local run
    local = run(compose_cfg(f"run_dir={tmp_path / 'local'}", f"prompts.path={folder / 'p.txt'}",
                            "samples_per_shard=4", *FAST))
    assert local.ok == 6
    assert (tmp_path / "local/shards/000000.tar").read_bytes() == (tmp_path / "txt/shards/000000.tar").read_bytes()
    # a row edited in place (the size unchanged), for each format: refused, naming the URL, as a local file is
    (folder / "p.txt").write_text("".join(p + "\n" for p in ["A" + lines[0][1:]] + lines[1:]))
    with pytest.raises(FingerprintMismatch, match=f"{url}/p.txt: not this run's prompt file"):
        run(txt)
    pq.write_table(pa.table({"prompt": ["A" + lines[0][1:]] + lines[1:]}), folder / "p.parquet", row_group_size=2)
    with pytest.raises(FingerprintMismatch, match=f"{url}/p.parquet: not this run's prompt file"):
        run(par)


def test_a_url_whose_filesystem_package_is_missing_is_one_line_naming_it_before_any_model(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: its absence cannot be shown")
    monkeypatch.setattr("shardgen.run.runner.apply_strategy", lambda *a: pytest.fail("a model was loaded"))
    for key, url, shown in (("prompts.path", "gs://a-bucket/p.txt", "gs://a-bucket/p.txt"),
                            ("output_uri", "gs://a-bucket/out", "gs://a-bucket/out/")):
        cfg = compose_cfg(f"run_dir={tmp_path / key}", f"{key}={url}", *FAST)
        with pytest.raises(UserError) as e:
            run(cfg)
        assert str(e.value) == f"{shown}: reading gs:// URLs needs gcsfs, which is not installed: pip install gcsfs"


def test_a_web_server_that_ignores_byte_ranges_is_refused_naming_it(tmp_path):
    import functools

    from shardgen.dataio.rundir import StorageError
    from shardgen.dataio.rundir.remote import open_remote

    (tmp_path / "p.txt").write_bytes(b"x" * 100_000)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None}),
        directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/p.txt"
    try:
        with pytest.raises(StorageError, match=f"{url}: 100000 bytes sent for a range of 10: the server ignores"):
            open_remote(url, buffering=10).raw.read(10)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("key", ["output_uri", "prompts.path"])
def test_a_url_with_a_password_is_refused_before_anything_is_written(tmp_path, key):
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"{key}=https://me:hunter2@example.org/data/p.txt", *FAST)
    with pytest.raises(ConfigError, match=f"{key}: a URL with a password in it would be written"):
        run(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("suffix", ["", "/", "/dir", "/dir/"])
def test_a_bucket_or_prefix_as_the_prompt_file_is_named_so(s3, bucket, tmp_path, suffix):
    put(s3, f"s3://{bucket}/dir/p.txt", b"a cat\n")
    url = f"s3://{bucket}{suffix}"
    with pytest.raises(UserError, match=rf"^{re.escape(url)}: is a bucket or folder \(a prefix of objects\), not a "
                                        r"prompt file\. Set prompts.path to the object's full URL"):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={url}", "prompts.format=txt", *FAST))
    assert not (tmp_path / "run").exists()


def test_a_presigned_urls_signature_is_written_nowhere_in_the_run(web, tmp_path):
    folder, url = web
    (folder / "p.txt").write_text("a cat\na dog\n")
    secret, key_id = "f00dfacec0ffee5ec2e7", "AKIASHARDGENTEST"
    signed = (f"{url}/p.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={key_id}%2F20260101%2Fus-east-1%2Fs3"
              f"&X-Amz-Expires=3600&X-Amz-Signature={secret}")
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path='{signed}'", *FAST)
    assert run(cfg).ok == 2 and run(cfg).generated_here == 0  # read with the signature, resumed
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert {"config.yaml", "plan.json", "prompt_hash.json", "rank000.log"} <= {p.name for p in written}
    leaked = [str(p) for p in written if secret.encode() in p.read_bytes() or key_id.encode() in p.read_bytes()]
    assert leaked == []
    assert f"{url}/p.txt?X-Amz-Algorithm=REDACTED&X-Amz-Credential=REDACTED" in \
        (tmp_path / "run/config.yaml").read_text()


@pytest.mark.parametrize("uri", ["s3://bucket//double//slash/", "s3://bucket/a/./b", "s3://bucket/a/../b/"])
def test_an_output_uri_with_an_empty_or_dot_folder_is_refused_in_one_line_before_anything_is_written(tmp_path, uri):
    for dry in ("false", "true"):
        with pytest.raises(ConfigError) as e:
            run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"output_uri={uri}", f"dry_run={dry}", *FAST))
        assert str(e.value).startswith(f"output_uri={uri}: an empty, '.' or '..' folder name") and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()
