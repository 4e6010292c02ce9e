"""Every tool on a run kept in a bucket (``run_dir=s3://bucket/prefix``, tests/s3_server.py's server), as on a run in
a directory: jobs.report and jobs.preview (their pages also put in the bucket), jobs.dedup, jobs.signals (indexes
rewritten in the bucket with their upload records, a kill between the two leaving a sound run), retry_failed,
dry_run, prompts appended to the prompt file, jobs.verify --repair of a tar deleted by hand, shard_paths read by
webdataset and by ``datasets``, and a run whose prefix was copied elsewhere."""

from __future__ import annotations

import io
import json

import pytest

from jobs.generate import run
from shardgen.dataio.rundir.layout import RunDir
from tests.conftest import compose_cfg, write_lines
from tests.test_bucket_run import FAST, bucket_images, bucket_objects
from tests.test_generate import shard_images


@pytest.fixture
def url(bucket) -> str:
    return f"s3://{bucket}/runs/r1"


def _key(url: str, name: str = "") -> str:
    """The s3fs path of ``name`` in the run at ``url``."""
    return url.removeprefix("s3://") + (f"/{name}" if name else "")


def _etags(fs, url: str) -> dict[str, str]:
    """Object name (relative to the run) -> ETag, for every object of the run."""
    root = _key(url)
    return {p[len(root) + 1:]: meta["ETag"] for p, meta in fs.find(root, detail=True).items()}


def _out(capsys) -> str:
    return capsys.readouterr().out


def test_report_preview_and_dedup_of_a_bucket_run(tmp_path, url, s3, capsys, monkeypatch):
    from PIL import Image

    from jobs.dedup import main as dedup
    from jobs.preview import main as preview
    from jobs.report import main as report

    monkeypatch.chdir(tmp_path)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10", "signals=[phash]")).complete
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", *FAST, "prompts.limit=10", "signals=[phash]")).complete
    scratch, fs = RunDir.at(url).root, s3.fs()
    capsys.readouterr()

    assert report([url]) == 0  # the page beside the run's files in the bucket, and on this machine
    assert _out(capsys) == f"wrote {url}/report.html (and on this machine: {scratch / 'report.html'})\n"
    page = fs.cat_file(_key(url, "report.html")).decode()
    assert page == (scratch / "report.html").read_text()
    assert "<title>shardgen run r1</title>" in page and f"<p class='path'>{url}</p>" in page
    assert "<td>images (ok)</td><td>10</td>" in page and "<td>shards committed</td><td>3 of 3</td>" in page
    assert page.count("<img") == 10  # the contact sheet, read from the bucket's tars
    assert report([url, "--out", str(tmp_path / "r.html")]) == 0  # --out: that file only
    assert _out(capsys) == f"wrote {tmp_path / 'r.html'}\n"

    assert preview([url, "--n", "6", "--cols", "3", "--size", "32"]) == 0
    assert _out(capsys) == f"wrote {url}/preview.png (and on this machine: {scratch / 'preview.png'}) (6 samples)\n"
    assert Image.open(io.BytesIO(fs.cat_file(_key(url, "preview.png")))).size == (96, 2 * (32 + 48))

    for argv in (["--max-distance", "64"], ["--max-distance", "64", "--json"], []):  # the lines of the local run
        assert dedup([url, *argv]) == 0
        bucket_lines = _out(capsys)
        assert dedup([str(local), *argv]) == 0
        assert bucket_lines == _out(capsys)
    assert dedup([url, "--max-distance", "64", "--json"]) == 0
    assert json.loads(_out(capsys)) == [[f"{i:010d}" for i in range(10)]]  # 64 bits apart at most: one group
    assert not (tmp_path / "s3:").exists()


def test_compare_and_calibration_of_bucket_runs_name_them_by_url_and_any_machine_s_report_shows_them(
        tmp_path, bucket, s3, capsys, monkeypatch):
    from jobs.compare import main as compare
    from jobs.report import main as report

    monkeypatch.chdir(tmp_path)
    ref, other = f"s3://{bucket}/runs/ref", f"s3://{bucket}/runs/fp8"
    assert run(compose_cfg(f"run_dir={ref}", *FAST, "prompts.limit=6")).complete
    assert run(compose_cfg(f"run_dir={other}", *FAST, "prompts.limit=6", "fp8=true", "calibrate_samples=2")).complete
    capsys.readouterr()
    assert compare([other, ref]) == 0
    scratch = RunDir.at(other).root
    line, *wrote = _out(capsys).splitlines()
    assert line.startswith(f"6 samples compared with {ref}: PSNR median ")  # the reference's URL, not a scratch path
    assert wrote == [f"wrote {other}/compare.json (and on this machine: {scratch / 'compare.json'})",
                     f"wrote {other}/compare_samples.jsonl (and on this machine: {scratch / 'compare_samples.jsonl'})"]
    fs = s3.fs()
    summary = json.loads(fs.cat_file(_key(other, "compare.json")))
    assert (summary["run"], summary["reference"], summary["compared"]) == (other, ref, 6)
    assert len(fs.cat_file(_key(other, "compare_samples.jsonl")).splitlines()) == 6

    monkeypatch.setenv("SHARDGEN_CACHE", str(tmp_path / "another-machine"))  # none of the run's scratch files
    assert report([other]) == 0
    page = fs.cat_file(_key(other, "report.html")).decode()
    assert "jobs.compare" in page and f"against {ref}" in page  # the figures, read from the bucket
    assert "calibration (calibrate_samples)" in page and "passed ({&#x27;fp8&#x27;: True})" in page  # the job's too
    assert _earlier_verdict(other)["passed"]  # a launch on another machine takes the job's verdict from the bucket
    from jobs.preview import main as preview

    assert preview([other, "--n", "2"]) == 0  # its folder on this machine made for the page, as for the report
    assert fs.exists(_key(other, "preview.png"))
    assert not (tmp_path / "s3:").exists()


def test_a_verdict_taken_from_this_machine_s_copy_is_put_back_in_the_bucket(url, s3, monkeypatch):
    """The bucket's calibration.json lost (its upload cut short): a relaunch on the machine that keeps its own copy
    takes the verdict from it, calibrates nothing, and puts it back in the bucket for any machine's report."""
    from shardgen.run import generation
    from shardgen.run.runner import run_rank

    def stop(event, worker):
        if event == "start":
            raise KeyboardInterrupt

    gated = (f"run_dir={url}", *FAST, "prompts.limit=6", "fp8=true", "calibrate_samples=2")
    with pytest.raises(KeyboardInterrupt):  # stopped as its second shard starts: the calibration passed
        run_rank(compose_cfg(*gated), on_batch=stop)
    fs, local = s3.fs(), RunDir.at(url).calibration_path
    record = fs.cat_file(_key(url, "calibration.json"))
    fs.rm(_key(url, "calibration.json"))
    assert local.read_bytes() == record
    calibrated, real = [], generation.generate_batch
    monkeypatch.setattr(generation, "generate_batch", lambda pipe, s, rows, *a: calibrated.extend(rows)
                        or real(pipe, s, rows, *a))
    assert run(compose_cfg(*gated)).complete
    assert calibrated == [] and fs.cat_file(_key(url, "calibration.json")) == record


def _earlier_verdict(url: str) -> dict | None:
    """The calibration a relaunch of the bucket run ``url`` (fp8, calibrate_samples=2) on this machine would take."""
    from types import SimpleNamespace

    import torch

    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.pick import pick
    from shardgen.quality.gate import Bounds, earlier_verdict, made_for
    from shardgen.run.generation import GenSettings

    cfg = compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=6", "fp8=true", "calibrate_samples=2")
    plan, settings = load_plan(RunDir.at(url)), GenSettings.from_cfg(cfg, "dp")
    now = made_for(plan, SimpleNamespace(device=torch.device("cpu")), settings, 1, pick(Bounds, cfg))
    return earlier_verdict(plan, settings, now)


def test_signals_are_added_to_a_bucket_run_as_to_a_local_one_and_a_kill_midway_leaves_it_sound(
        tmp_path, url, s3, capsys, monkeypatch):
    import shardgen.dataio.shards.uploaded as uploaded
    from jobs.dedup import main as dedup
    from jobs.signals import main as signals
    from jobs.verify import main as verify
    from shardgen.tools import read_index_columns

    monkeypatch.chdir(tmp_path)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10")).complete
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", *FAST, "prompts.limit=10")).complete
    fs = s3.fs()
    tars = {n: tag for n, tag in _etags(fs, url).items() if n.endswith(".tar")}
    capsys.readouterr()

    def killed(meta):  # the index is uploaded, its record still names the old one beside it
        raise SystemExit("killed")

    with monkeypatch.context() as m:
        m.setattr(uploaded, "etag_of", killed)
        with pytest.raises(SystemExit):
            signals([url, "signals=[phash]"])
    record = json.loads(fs.cat_file(_key(url, "uploads/000000.json")))
    assert set(record["replacing"]) == {"000000.parquet"}
    assert verify([url]) == 0, _out(capsys)  # both indexes are the shard's: none reads as written over
    again = run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10"))
    assert (again.complete, again.generated_here) == (True, 0)  # the launch kept the shard
    capsys.readouterr()

    assert signals([url, "signals=[phash]"]) == 0
    assert _out(capsys).splitlines()[-1] == (f"{url}: phash added to 6 images in 2 shard(s); 1 of 3 committed "
                                             "shards had them already")
    assert signals([url, "--signals", "phash"]) == 0
    assert _out(capsys).splitlines()[-1] == (f"{url}: phash added to 0 images in 0 shard(s); 3 of 3 committed "
                                             "shards had them already")
    assert signals([str(local), "signals=[phash]"]) == 0
    capsys.readouterr()
    bucket_run, local_run = RunDir.at(url), RunDir.at(local)
    assert read_index_columns(bucket_run, ["key", "phash"]) == read_index_columns(local_run, ["key", "phash"])
    assert len(set(read_index_columns(bucket_run, ["phash"])["phash"]) - {None}) == 10
    assert "replacing" not in json.loads(fs.cat_file(_key(url, "uploads/000001.json")))
    assert {n: tag for n, tag in _etags(fs, url).items() if n.endswith(".tar")} == tars  # the tars untouched
    assert verify([url]) == 0, _out(capsys)
    capsys.readouterr()
    assert dedup([url]) == 0
    assert _out(capsys).startswith("0 near-duplicate group(s) among 10 images")


def test_signals_are_added_to_a_run_whose_shards_are_kept_only_at_output_uri(tmp_path, bucket, capsys):
    """keep_local=false: the indexes are rewritten in the bucket, with their records in run_dir/uploads."""
    from jobs.dedup import main as dedup
    from jobs.signals import main as signals
    from jobs.verify import main as verify

    run_dir = tmp_path / "run"
    assert run(compose_cfg(f"run_dir={run_dir}", f"output_uri=s3://{bucket}/drop", "keep_local=false", *FAST,
                           "prompts.limit=10")).complete
    capsys.readouterr()
    assert signals([str(run_dir), "signals=[phash]"]) == 0
    assert _out(capsys).splitlines()[-1] == (f"{run_dir}: phash added to 10 images in 3 shard(s); 0 of 3 committed "
                                             "shards had them already")
    assert not list((run_dir / "shards").iterdir())  # nothing kept locally
    assert verify([str(run_dir)]) == 0
    capsys.readouterr()
    assert dedup([str(run_dir)]) == 0
    assert _out(capsys).startswith("0 near-duplicate group(s) among 10 images")


def test_retry_failed_on_a_bucket_run_makes_exactly_the_failed_samples_again(tmp_path, url, monkeypatch):
    from tests.test_failures import PROMPTS, faulty

    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.txt", PROMPTS)
    with monkeypatch.context() as m:
        faulty(m)
        first = run(compose_cfg(f"run_dir={url}", f"prompts.path={prompts}", *FAST))
    assert (first.ok, first.failed, first.complete) == (5, 3, True)
    good = {k: v for k, v in bucket_images(RunDir.at(url)).items() if v is not None}
    again = run(compose_cfg(f"run_dir={url}", f"prompts.path={prompts}", *FAST, "retry_failed=true"))
    assert (again.ok, again.failed, again.generated_here) == (8, 0, 3)
    clean = tmp_path / "clean"
    assert run(compose_cfg(f"run_dir={clean}", f"prompts.path={prompts}", *FAST)).ok == 8
    after = bucket_images(RunDir.at(url))
    assert after == shard_images(clean) and all(after[k] == v for k, v in good.items())


def test_a_dry_run_of_a_bucket_run_names_its_url_and_writes_nothing(tmp_path, url, s3, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10", "dry_run=true")).shards == 3
    assert _out(capsys).splitlines()[0] == f"dry run of {url}: no model loaded, nothing written"
    assert bucket_objects(s3.fs(), url) == []
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=6")).complete
    before = _etags(s3.fs(), url)
    capsys.readouterr()
    dry = run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=6", "dry_run=true"))
    assert (dry.run_dir, dry.prompts, dry.done_samples) == (url, 6, 6)
    assert "  shards    2 of 4 samples; 6 samples already done" in _out(capsys).splitlines()
    assert _etags(s3.fs(), url) == before


def test_prompts_appended_to_a_bucket_runs_prompt_file_become_new_shards(tmp_path, url, s3, monkeypatch):
    from jobs.verify import main as verify

    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.txt", [f"a thing {i}" for i in range(10)])
    assert run(compose_cfg(f"run_dir={url}", f"prompts.path={prompts}", *FAST)).complete
    before = _etags(s3.fs(), url)
    with open(prompts, "a", encoding="utf-8") as f:
        f.write("".join(f"an appended thing {i}\n" for i in range(10, 16)))
    r = run(compose_cfg(f"run_dir={url}", f"prompts.path={prompts}", *FAST))
    assert (r.complete, r.ok, r.total, r.generated_here) == (True, 16, 16, 6)
    after = _etags(s3.fs(), url)
    assert {n: after[n] for n in before if n.startswith("shards/")} == \
        {n: t for n, t in before.items() if n.startswith("shards/")}  # the earlier shards untouched
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", f"prompts.path={prompts}", *FAST)).complete
    assert bucket_images(RunDir.at(url)) == shard_images(local)
    assert verify([url]) == 0


def test_an_extended_bucket_run_whose_store_fails_while_its_plan_is_read_is_told_so_not_to_start_over(
        tmp_path, url, monkeypatch):
    """The extension's plan.json unreadable past the store's retries is an outage (one line: re-run once it
    answers), not damage ("restore plan/ from a backup, or start a new run_dir"); the plan stays whole."""
    from shardgen.dataio.resume.repair import load_plan_or_discard
    from shardgen.dataio.rundir.remote import StorageError
    from shardgen.dataio.rundir.runfiles import BucketFiles
    from shardgen.dataio.rundir.storage import RunDirError

    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.txt", [f"a thing {i}" for i in range(4)])
    assert run(compose_cfg(f"run_dir={url}", f"prompts.path={prompts}", *FAST)).complete
    with open(prompts, "a", encoding="utf-8") as f:
        f.write("an appended thing\n")
    assert run(compose_cfg(f"run_dir={url}", f"prompts.path={prompts}", *FAST)).ok == 5
    real = BucketFiles.read

    def failing(self, path, *a, **kw):
        if path.parent.name == "ext-000001" and path.name == "plan.json":
            raise StorageError(f"{self.where(path)}: reading failed 7 times; the storage is unreachable or failing")
        return real(self, path, *a, **kw)

    monkeypatch.setattr(BucketFiles, "read", failing)
    with pytest.raises(StorageError, match="the storage is unreachable"):
        load_plan_or_discard(RunDir.at(url))
    monkeypatch.setattr(BucketFiles, "read", real)
    assert load_plan_or_discard(RunDir.at(url)).num_rows == 5
    bucket_run = RunDir.at(url)  # damaged for real: named by its URL, never by the machine's scratch folder
    bucket_run.files.replace(bucket_run.plan_dir / "ext-000001" / "plan.json", b"{garbage")
    with pytest.raises(RunDirError) as e:
        load_plan_or_discard(bucket_run)
    ext = f"{url}/plan/ext-000001"
    assert str(e.value).startswith(f"{ext}/plan.json: unreadable (JSONDecodeError")
    assert str(bucket_run.root) not in str(e.value), str(e.value)
    assert f"{url} was extended with appended prompts ({url}/plan/ext-*)" in str(e.value)
    # one fix, not two: deleting the extension and re-running would not cut its rows into the same shards
    assert "delete every object" not in str(e.value) and str(e.value).endswith("or start a new run_dir")


def test_verify_repair_of_a_tar_deleted_from_the_bucket_has_it_made_again_and_loses_nothing_else(
        tmp_path, url, s3, capsys, monkeypatch):
    from jobs.status import main as status
    from jobs.verify import main as verify

    monkeypatch.chdir(tmp_path)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10")).complete
    fs = s3.fs()
    images, before = bucket_images(RunDir.at(url)), _etags(fs, url)
    fs.rm(_key(url, "shards/000001.tar"))
    capsys.readouterr()
    assert verify([url]) == 1
    out = _out(capsys)
    assert (f"  DEFECT shard 000001: {url}/shards/000001.tar missing from the bucket since its upload "
            f"({url}/uploads/000001.json): --repair has the shard generated and uploaded again") in out
    assert f"To repair: python -m jobs.verify {url} --repair, then re-run the generate command" in out
    assert verify([url, "--repair"]) == 1
    assert "  REPAIRED shard 000001: removed; the next launch generates it again" in _out(capsys)
    assert status([url, "--json"]) == 0
    st = json.loads(_out(capsys))
    assert (st["shards"]["done"], st["results"]["ok"]) == (2, 6)
    again = run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10"))
    assert (again.complete, again.generated_here) == (True, 4)
    assert bucket_images(RunDir.at(url)) == images  # the same bytes made again
    after = _etags(fs, url)
    kept = [n for n in before if n.startswith(("shards/000000", "shards/000002", "uploads/000000", "uploads/000002",
                                               "plan/", "fingerprint"))]
    assert len(kept) >= 8 and {n: after[n] for n in kept} == {n: before[n] for n in kept}  # nothing else rewritten
    capsys.readouterr()
    assert verify([url]) == 0
    assert "OK: every prompt index exactly once" in _out(capsys)


def test_shard_paths_of_a_bucket_run_are_read_by_webdataset_and_datasets(tmp_path, url, s3, capfd, monkeypatch):
    import webdataset as wds
    from datasets import load_dataset

    from shardgen.tools.loading import hf_features, shard_paths

    monkeypatch.chdir(tmp_path)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10")).complete
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", *FAST, "prompts.limit=10")).complete
    pipes = shard_paths(url)
    assert len(pipes) == 3 and all(p.startswith("pipe:") and p.endswith(f" {url} {i}") for i, p in enumerate(pipes))
    samples = list(wds.WebDataset(pipes, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:010d}" for i in range(10)]
    assert {s["__key__"]: s["png"] for s in samples} == shard_images(local)

    urls = shard_paths(url, reader="datasets")
    assert urls == [f"{url}/shards/{i:06d}.tar" for i in range(3)]
    ds = load_dataset("webdataset", data_files={"train": urls}, split="train", features=hf_features(url),
                      cache_dir=str(tmp_path / "hf"))
    assert sorted(ds["__key__"]) == [f"{i:010d}" for i in range(10)]
    assert [row["json"]["index"] for row in ds] == list(range(10))

    s3.fs().pipe_file(_key(url, "shards/000001.tar"), b"not the shard")  # written over: never read as the shard
    capfd.readouterr()
    with pytest.raises(Exception, match="exit 2|empty file"):  # which webdataset notices first: no byte came
        list(wds.WebDataset(pipes[1:2], shardshuffle=False))
    assert (f"error: {url}/shards/000001.tar: 13 bytes that are not the 25600 bytes uploaded for this run "
            f"({url}/uploads/000001.json)") in capfd.readouterr().err


def test_a_bucket_shard_reaches_its_reader_through_a_file_in_chunks_and_only_as_recorded(tmp_path, url, s3,
                                                                                        monkeypatch):
    """``write_shard`` (the ``pipe:`` command's body) copies the tar to its reader in bounded chunks from a temporary
    file once it is checked, never holding it whole; an object of the recorded size with other bytes writes nothing,
    and no temporary file stays behind either way."""
    import io

    from shardgen.dataio.rundir.storage import RunDirError
    from shardgen.dataio.shards import uploaded
    from shardgen.tools.loading import write_shard

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(uploaded.tempfile, "tempdir", None)  # TMPDIR read again
    monkeypatch.setattr(uploaded, "CHUNK", 4096)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=4")).complete
    tar = s3.fs().cat_file(_key(url, "shards/000000.tar"))
    writes: list[int] = []

    class Reader(io.BytesIO):
        def write(self, b):
            writes.append(len(b))
            return super().write(b)

    out = Reader()
    write_shard(url, 0, out)
    assert out.getvalue() == tar and max(writes) <= 4096 and len(writes) >= len(tar) // 4096
    s3.fs().pipe_file(_key(url, "shards/000000.tar"), tar[:-1] + bytes([tar[-1] ^ 1]))
    out = Reader()
    with pytest.raises(RunDirError, match=f"{len(tar)} bytes that are not the {len(tar)} bytes uploaded"):
        write_shard(url, 0, out)
    assert out.getvalue() == b"" and list((tmp_path / "tmp").iterdir()) == []


def test_a_bucket_run_copied_to_another_prefix_is_read_verified_and_continued_there(tmp_path, url, s3, capsys,
                                                                                   monkeypatch):
    import webdataset as wds

    from jobs.status import main as status
    from jobs.verify import main as verify
    from shardgen.tools.loading import shard_paths

    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.txt", [f"a thing {i}" for i in range(10)])
    assert run(compose_cfg(f"run_dir={url}", f"prompts.path={prompts}", *FAST)).complete
    images = bucket_images(RunDir.at(url))
    fs, moved = s3.fs(), url.rsplit("/", 1)[0] + "/moved"
    fs.copy(_key(url), _key(moved), recursive=True)
    fs.rm(_key(url), recursive=True)  # moved: nothing is read from where it was
    tar = fs.cat_file(_key(moved, "shards/000001.tar"))
    _put_in_parts(s3, moved, "shards/000001.tar", tar)  # as `aws s3 sync` copies a large object: another ETag
    capsys.readouterr()
    assert status([moved]) == 0
    assert f"  uploads  3 of 3 committed shards in {moved}/shards/" in _out(capsys).splitlines()
    assert verify([moved]) == 0
    assert _out(capsys).splitlines()[0] == f"{moved}: 3/3 shards, 10/10 samples (10 ok)"
    assert [s["__key__"] for s in wds.WebDataset(shard_paths(moved), shardshuffle=False)] == \
        [f"{i:010d}" for i in range(10)]
    with open(prompts, "a", encoding="utf-8") as f:
        f.write("an appended thing\n")
    r = run(compose_cfg(f"run_dir={moved}", f"prompts.path={prompts}", *FAST))
    assert (r.complete, r.ok, r.generated_here) == (True, 11, 1)
    grown = bucket_images(RunDir.at(moved))
    assert len(grown) == 11 and {k: grown[k] for k in images} == images
    assert fs.find(_key(url)) == []  # nothing written where the run was
    fs.rm(_key(moved, "shards/000000.tar"))  # its own copies are checked, and made again there
    assert verify([moved, "--repair"]) == 1
    assert f"  DEFECT shard 000000: {moved}/shards/000000.tar missing" in _out(capsys)
    assert run(compose_cfg(f"run_dir={moved}", f"prompts.path={prompts}", *FAST)).generated_here == 4
    assert bucket_images(RunDir.at(moved)) == grown
    _put_in_parts(s3, moved, "shards/000001.tar", tar[:-1] + b"x")  # other bytes of its size, in parts: still found
    capsys.readouterr()
    assert verify([moved]) == 1
    assert f"  DEFECT shard 000001: {moved}/shards/000001.tar: {len(tar)} bytes that are not" in _out(capsys)


def _put_in_parts(s3, url: str, name: str, data: bytes) -> None:
    """Write the object ``name`` of the run at ``url`` by a multipart upload (its ETag is then ``<md5>-1``)."""
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client, key = boto3.client("s3", endpoint_url=s3.endpoint), f"{prefix}/{name}"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    part = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=data)
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                     MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]})
    assert s3.fs().info(url.removeprefix("s3://") + "/" + name)["ETag"].strip('"').endswith("-1")


@pytest.mark.parametrize("damage", {"empty": b"", "garbage": b"\x00\xffnot json", "truncated": None})
def test_a_damaged_upload_record_is_named_by_status_and_verify_and_repaired_to_the_same_bytes(
        tmp_path, url, s3, capsys, monkeypatch, damage):
    """A shard's upload record (its done marker) emptied, replaced by garbage or cut short in the bucket: status
    counts the shard damaged, verify names the object, --repair removes the shard, and the next launch makes it
    again with the bytes it had; a claim object of garbage beside it does not stop that launch."""
    from jobs.status import main as status
    from jobs.verify import main as verify

    monkeypatch.chdir(tmp_path)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10")).complete
    fs = s3.fs()
    images = bucket_images(RunDir.at(url))
    record = fs.cat_file(_key(url, "uploads/000001.json"))
    fs.pipe_file(_key(url, "uploads/000001.json"), record[: len(record) // 2] if damage is None else damage)
    fs.pipe_file(_key(url, "claims/000001.g7"), b"\x00garbage")
    capsys.readouterr()
    assert status([url, "--json"]) == 0
    assert json.loads(_out(capsys))["shards"]["damaged"] == 1
    assert verify([url]) == 1
    out = _out(capsys)
    assert "DEFECT shard 000001" in out and "uploads/000001.json" in out, out
    assert verify([url, "--repair"]) == 1
    assert "REPAIRED shard 000001" in _out(capsys)
    again = run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10", "lease_s=2", "heartbeat_s=0.5"))
    assert (again.complete, again.generated_here) == (True, 4)
    assert bucket_images(RunDir.at(url)) == images
    assert verify([url]) == 0
