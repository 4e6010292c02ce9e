"""A run's small files through runfiles.RunFiles, in its directory (``DirFiles``) and in a bucket of the test S3
server (``BucketFiles``, tests/s3_server.py): the fingerprint's first-writer-wins create, replaces conditional on a
version, the shards' done markers listed after their commits, damaged files read with the errors a run directory
gives, transient errors retried; the plan published into a bucket (first planner wins), uploads, repair, the owner
record, the prompt file's hash and lines appended by racing writers."""

from __future__ import annotations

import json
import threading

import pytest

from shardgen.dataio.resume.fingerprint import FingerprintMismatch, check_or_write_fingerprint, read_fingerprint
from shardgen.dataio.rundir.fileio import json_bytes
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.runfiles import BucketFiles, DirFiles
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.shards.shardwork import committed_stats
from shardgen.dataio.shards.uploaded import only_uploaded, read_record


def by_hand():
    """A client of the test server that is no store's: what a person editing the bucket would use."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.fixture
def url(bucket) -> str:
    return f"s3://{bucket}/run"


@pytest.fixture(params=["dir", "bucket"])
def run(request, tmp_path) -> RunDir:
    """A run whose small files are in its directory, or (``bucket``) under a prefix of a fresh bucket."""
    store = f"s3://{request.getfixturevalue('bucket')}/run" if request.param == "bucket" else ""
    return RunDir(tmp_path / "run", store=store)


def fingerprint(**changed) -> dict:
    return dict({"model.name": "m", "steps": 4, "prompts.sha256": "ab" * 32, "seed": 0}, **changed)


def stats(shard: int) -> dict:
    return dict(shard=shard, count=2, ok=2, failed=0, rejected=0, truncated=0, failures_by_reason={}, shapes={},
                failed_samples=[], tar_bytes=10, sha256="cd" * 32, started=0.0, finished=1.0, wall_s=1.0)


def test_of_two_launches_racing_to_create_the_fingerprint_exactly_one_wins(run, monkeypatch):
    """Two launches with other seeds create the fingerprint at once: one creates it, the other reads the winner's
    and is refused as a resume with other settings would be. Both look for a fingerprint before either creates
    one (a launch that looks once it exists finds a run without samples, which takes its settings instead)."""
    import shardgen.dataio.resume.fingerprint as fp

    barrier, looked, results = threading.Barrier(2), threading.Barrier(2), {}
    first_look, seen = fp.read_fingerprint, set()

    def look_then_wait(r):
        found = first_look(r)
        if threading.get_ident() not in seen:  # each launch's first look: both find none
            seen.add(threading.get_ident())
            looked.wait(30)
        return found

    monkeypatch.setattr(fp, "read_fingerprint", look_then_wait)

    def launch(seed: int) -> None:
        barrier.wait()
        try:
            results[seed] = check_or_write_fingerprint(run, fingerprint(seed=seed))
        except FingerprintMismatch as e:
            results[seed] = e

    threads = [threading.Thread(target=launch, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.undo()
    winner = next(seed for seed, r in results.items() if r is False)
    loser = 3 - winner
    assert isinstance(results[loser], FingerprintMismatch)
    assert f"seed: run has {winner}, this launch has {loser}" in str(results[loser])
    assert read_fingerprint(run) == fingerprint(seed=winner)
    assert check_or_write_fingerprint(run, fingerprint(seed=winner)) is True  # a resume


def test_of_stores_racing_to_create_each_file_exactly_one_wins(run, url):
    """Two stores (as two machines would hold) create the same 20 files at once, in opposite orders."""
    stores = [run.files, BucketFiles(url, run.root) if run.store else DirFiles()]
    run.root.mkdir()
    paths, won = [run.root / f"f{i:02d}.json" for i in range(20)], [{}, {}]
    barrier = threading.Barrier(2)

    def go(i: int) -> None:
        barrier.wait()
        for p in paths if i == 0 else paths[::-1]:
            won[i][p] = stores[i].create(p, f"{i}".encode())

    threads = [threading.Thread(target=go, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in paths:
        assert won[0][p] != won[1][p]
        assert run.files.read(p) == (b"0" if won[0][p] else b"1")


def test_a_replace_if_unchanged_is_refused_once_another_writer_replaced_the_file(run):
    run.root.mkdir()
    path = run.summary_path
    assert run.files.replace_if(path, b"1", None) and not run.files.replace_if(path, b"x", None)
    data, version = run.files.read_versioned(path)
    assert data == b"1" and version == run.files.version(path)
    run.files.replace(path, b"22")  # another writer
    assert not run.files.replace_if(path, b"3", version) and run.files.read(path) == b"22"
    assert run.files.replace_if(path, b"3", run.files.version(path)) and run.files.read(path) == b"3"
    run.files.delete(path)
    run.files.delete(path)  # gone already: no error
    assert run.files.read_versioned(path) == (None, None) and not run.files.exists(path)


def test_done_markers_are_listed_after_their_commits(run):
    """Done markers written as a commit and an upload write them (in a run directory stats files and upload
    records; a run kept in a bucket commits by upload records alone): ``done_shards``, ``is_done``, the committed
    stats and the upload record read back from where they are; in a bucket nothing of them is written to the run
    directory, and a listing of several pages finds them all."""
    assert run.done_shards() == set() and not run.is_done(0)
    if not run.store:
        run.shards_dir.mkdir(parents=True)

    def record(shard: int) -> dict:
        return dict(uri="s3://out/", sha256="cd" * 32, tar_bytes=10, time=0.0, stats=stats(shard), objects={})

    run.uploads_dir.mkdir(parents=True)
    for shard in (0, 2, 5):
        if run.store:
            run.files.replace(run.shard_uploaded(shard), json_bytes(record(shard)))
        else:
            run.files.replace(run.shard_stats(shard), json_bytes(stats(shard)))
    run.files.replace(run.shard_uploaded(7), json_bytes(record(7)))
    if run.store:
        run.files.list_page = 2
    assert run.done_shards() == {0, 2, 5, 7}
    assert [run.is_done(s) for s in range(8)] == [True, False, True, False, False, True, False, True]
    assert committed_stats(run, 2) == stats(2) and committed_stats(run, 7) == stats(7)
    assert only_uploaded(run, 7) and only_uploaded(run, 2) == bool(run.store) and read_record(run, 7) == record(7)
    if run.store:
        assert not run.shards_dir.exists() and list(run.uploads_dir.iterdir()) == []
        assert run.files.requests["list_objects_v2"] >= 3


DAMAGE = {"empty": b"", "blank": b" \n", "garbage": b"\x00\xffnot json", "not standard JSON": b'{"steps": NaN}',
          "a required key missing": json_bytes({"model.name": "m", "steps": 4}),
          "a required key of another type": json_bytes(fingerprint(steps="4"))}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_file_in_a_bucket_is_refused_as_the_same_file_in_a_run_directory(tmp_path, url, damage):
    """The fingerprint and a shard's stats, damaged alike in a directory and in a bucket: the same error class and
    message, naming the object's URL where the directory's names its path."""
    local, remote = RunDir(tmp_path / "a"), RunDir(tmp_path / "b", store=url)
    local.shards_dir.mkdir(parents=True)
    hand = by_hand()
    for run in (local, remote):
        for path in (run.fingerprint_path, run.shard_stats(3)):
            if run.store:
                hand.pipe(run.files.where(path)[len("s3://"):], DAMAGE[damage])
            else:
                path.write_bytes(DAMAGE[damage])

    def error(fn) -> RunDirError:
        with pytest.raises(RunDirError) as e:
            fn()
        return e.value

    for read, path in ((read_fingerprint, local.fingerprint_path),
                       (lambda r: committed_stats(r, 3), local.shard_stats(3))):
        want, got = error(lambda: read(local)), error(lambda: read(remote))
        remote_path = remote.root / path.relative_to(local.root)
        assert type(got) is type(want)
        assert str(got) == str(want).replace(str(path), remote.files.where(remote_path))
        assert remote.files.where(remote_path) in str(got) and "\n" not in str(got)


def test_a_file_larger_than_its_kind_holds_is_refused_unread(run):
    run.root.mkdir()
    run.files.replace(run.config_path, b"x" * 100)
    with pytest.raises(RunDirError, match=r"is 100 bytes, more than a file of its kind holds \(10\)"):
        run.files.read(run.config_path, limit=10)
    assert run.files.read(run.config_path, limit=100) == b"x" * 100


def test_slow_down_answers_are_retried_and_every_operation_still_works(s3, url, tmp_path, caplog):
    """503 SlowDown before each request, more than the S3 client's own attempts (2 in the tests) absorb: each is
    retried with backoff, logged, and the operation does what it does without them."""
    run = RunDir(tmp_path / "run", store=url)
    other = BucketFiles(url, run.root)
    steps = [lambda: run.files.create(run.fingerprint_path, json_bytes(fingerprint())),
             lambda: other.create(run.fingerprint_path, b"{}"),
             lambda: run.files.replace(run.shard_uploaded(1), json_bytes(stats(1))),
             lambda: read_fingerprint(run),
             lambda: run.done_shards(),
             lambda: run.files.delete(run.shard_uploaded(1)),
             lambda: run.is_done(1)]
    results = []
    for step in steps:
        s3.proxy.fail_next(3)
        results.append(step())
        assert s3.proxy.served_errors == 3
    assert results == [True, False, None, fingerprint(), {1}, None, False]
    assert "retry 1 of" in caplog.text


def test_an_unreachable_bucket_is_one_line_naming_the_object(s3, url, tmp_path, monkeypatch):
    import shardgen.dataio.rundir.remote as remote

    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    run = RunDir(tmp_path / "run", store=url)
    s3.proxy.down()
    with pytest.raises(remote.StorageError) as e:
        run.files.read(run.summary_path)
    assert str(e.value).startswith(f"{url}/summary.json: reading run/summary.json failed 2 times")
    assert "\n" not in str(e.value)


def test_summary_and_config_are_written_to_the_bucket_and_nowhere_else(url, tmp_path):
    run = RunDir(tmp_path / "run", store=url)
    run.files.replace(run.summary_path, json_bytes(dict(ok=1)))
    assert run.files.create(run.config_path, b"a: 1\n") and not run.files.create(run.config_path, b"a: 2\n")
    assert json.loads(run.files.read(run.summary_path)) == dict(ok=1) and run.files.read(run.config_path) == b"a: 1\n"
    assert sorted(run.files.names(run.root)) == ["config.yaml", "summary.json"] and not run.root.exists()


def plan_in(run: RunDir, tmp_path, rows: int = 7):
    """The run planned from a txt prompt file of ``rows`` rows, 2 a shard."""
    from shardgen.dataio.prompts.plan import build_plan
    from shardgen.dataio.prompts.read import PromptSource

    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(rows)))
    return build_plan(run, PromptSource(str(path), "txt"), samples_per_shard=2, run_seed=1)


def test_a_plan_made_into_a_bucket_reads_back_as_the_same_plan_made_in_a_directory(tmp_path, url):
    """plan.json, starts.npy and digests.npy are objects of the bucket (no plan/ folder is left locally) and the
    plan read back from them has the rows a plan made in a run directory has."""
    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.resume.repair import load_plan_or_discard, record_plan_digests

    local, remote = RunDir(tmp_path / "a"), RunDir(tmp_path / "b", store=url)
    want, got = plan_in(local, tmp_path), plan_in(remote, tmp_path)
    assert sorted(remote.files.names(remote.plan_dir)) == ["digests.npy", "plan.json", "starts.npy"]
    assert not remote.plan_dir.exists() and sorted(p.name for p in local.plan_dir.iterdir()) == sorted(
        remote.files.names(remote.plan_dir))
    assert got.num_shards == want.num_shards == 4
    assert [r.prompt for s in range(4) for r in got.rows(s)] == [r.prompt for s in range(4) for r in want.rows(s)]
    record_plan_digests(got)
    assert set(json.loads(remote.files.read(remote.plan_digests_path))) == {"plan.json", "starts.npy"}
    assert load_plan_or_discard(remote).num_shards == 4 and load_plan(remote).meta == got.meta


def test_of_planners_racing_into_a_bucket_the_first_plan_published_is_every_ones(tmp_path, url, monkeypatch):
    """A planner that finds plan.json published when its own plan is made writes nothing and adopts it; one whose
    create of plan.json loses adopts the winner's too."""
    run = RunDir(tmp_path / "run", store=url)
    first = plan_in(run, tmp_path)
    winner = run.files.read(run.plan_json_path)
    puts = run.files.requests["put_object"]
    assert plan_in(run, tmp_path, rows=9).num_shards == first.num_shards == 4  # published: adopted, nothing written
    assert run.files.requests["put_object"] == puts and run.files.read(run.plan_json_path) == winner
    looks, real = [False], run.files.exists  # its look for a published plan.json came before the winner's create
    monkeypatch.setattr(run.files, "exists", lambda path: looks.pop() if looks else real(path))
    assert plan_in(run, tmp_path).num_shards == 4 and run.files.read(run.plan_json_path) == winner and not looks


def test_a_plan_discarded_from_a_bucket_is_gone_for_readers_before_its_files_are(tmp_path, url):
    from shardgen.dataio.prompts.plan import discard_plan, has_plan, load_plan

    run = RunDir(tmp_path / "run", store=url)
    plan_in(run, tmp_path)
    deleted = []
    real = run.files.delete
    run.files.delete = lambda path: (deleted.append(path.name), real(path))  # type: ignore[method-assign]
    try:
        discard_plan(run, "replaced")
    finally:
        del run.files.delete
    assert deleted[0] == "plan.json" and set(deleted) >= {"starts.npy", "digests.npy", "plan_digests.json"}
    assert not has_plan(run) and load_plan(run) is None and run.files.names(run.plan_dir) == []


def test_a_plan_published_just_after_a_launch_looked_for_one_is_adopted_not_discarded(run, tmp_path, monkeypatch):
    """Two launches on a fresh run: one looks for a plan just before the other publishes its own. It plans too and
    adopts the published plan; the plan the other launch already works from stays in place, its digests whole. Taking
    it for a missing plan.json would pull it from under that launch, and both would stop on "plan.json was changed
    after the plan was made"."""
    import shardgen.dataio.resume.repair as repair

    first = plan_in(run, tmp_path)
    published = run.files.read(run.plan_json_path)
    repair.record_plan_digests(first)
    looks = [None]  # this launch's look came before the other's publish
    monkeypatch.setattr(repair, "load_plan", lambda *a: looks.pop() if looks else repair.load_plan(*a))
    assert repair.load_plan_or_discard(run) is None and not looks
    monkeypatch.undo()
    assert run.files.read(run.plan_json_path) == published and plan_in(run, tmp_path).num_shards == 4
    monkeypatch.setattr(repair, "_stored_plan_checked", {})
    assert [r.index for r in repair.checked_rows(first, 1)] == [2, 3]
    assert repair.load_plan_or_discard(run).meta == first.meta


def test_a_damaged_plan_is_made_again_with_a_warning_naming_the_file_and_no_fix_to_apply(run, tmp_path, caplog):
    """A damaged starts.npy of a run that was not extended: the launch plans again by itself, and its warning names the
    damaged file (a bucket's by URL) without the plan error's own advice (delete the folder, re-run), which the launch
    has already carried out."""
    import logging

    import shardgen.dataio.resume.repair as repair

    repair.record_plan_digests(plan_in(run, tmp_path))
    run.files.replace(run.starts_path, b"garbage")
    with caplog.at_level(logging.WARNING):
        assert repair.load_plan_or_discard(run) is None
    assert f"{run.files.where(run.starts_path)}: unreadable (" in caplog.text
    assert "planning again from the prompt file" in caplog.text and "delete" not in caplog.text
    assert plan_in(run, tmp_path).num_shards == 4


def test_no_digests_are_recorded_while_a_plan_file_is_missing_and_a_record_of_a_missing_file_is_made_again(
        run, tmp_path, monkeypatch):
    """record_plan_digests while a concurrent launch has removed plan.json (discarding a damaged plan) records
    nothing; a record of a missing plan.json (what that race left) is not held against the plan, and is made again."""
    import hashlib

    import shardgen.dataio.resume.repair as repair

    plan = plan_in(run, tmp_path)
    published = run.files.read(run.plan_json_path)
    run.files.delete(run.plan_json_path)
    repair.record_plan_digests(plan)
    assert run.files.read(run.plan_digests_path) is None
    run.files.replace(run.plan_json_path, published)
    starts = run.files.read(run.starts_path)
    run.files.replace(run.plan_digests_path, json_bytes({
        "plan.json": [-1, hashlib.sha256(b"").hexdigest()],
        "starts.npy": [len(starts), hashlib.sha256(starts).hexdigest()]}))
    monkeypatch.setattr(repair, "_stored_plan_checked", {})
    assert [r.index for r in repair.checked_rows(plan, 0)] == [0, 1]
    repair.record_plan_digests(plan)
    assert json.loads(run.files.read(run.plan_digests_path))["plan.json"] == [
        len(published), hashlib.sha256(published).hexdigest()]


def test_a_plan_changed_in_a_bucket_is_refused_naming_the_object_to_delete(tmp_path, url, monkeypatch):
    import shardgen.dataio.resume.repair as repair

    run = RunDir(tmp_path / "run", store=url)
    plan = plan_in(run, tmp_path)
    repair.record_plan_digests(plan)
    run.files.replace(run.plan_json_path, run.files.read(run.plan_json_path) + b" ")
    monkeypatch.setattr(repair, "_stored_plan_checked", {})
    with pytest.raises(RunDirError) as e:
        repair.checked_rows(plan, 0)
    assert str(e.value) == (f"{url}/plan/plan.json was changed after the plan was made; delete {url}/plan/plan.json "
                            "and re-run: the plan is made again from the prompt file, identically")


def test_a_store_failing_while_the_plan_is_loaded_is_no_damage(s3, tmp_path, url, monkeypatch):
    """Answers that fail past the retries while the plan is read end the launch in one line; the plan stays in the
    bucket, where taking the outage for damage would delete it once the store answers again."""
    import shardgen.dataio.rundir.remote as remote
    from shardgen.dataio.resume.repair import load_plan_or_discard

    run = RunDir(tmp_path / "run", store=url)
    plan_in(run, tmp_path)
    published = run.files.read(run.plan_json_path)
    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    s3.proxy.fail_next(4)  # the first request's two attempts (two connections each: the client retries a 503 once)
    with pytest.raises(remote.StorageError, match="failed 2 times"):
        load_plan_or_discard(run)
    assert run.files.read(run.plan_json_path) == published and load_plan_or_discard(run).num_shards == 4


def test_the_tools_tell_a_failing_store_from_a_damaged_bucket_plan(s3, tmp_path, url, monkeypatch):
    """status, verify and preview (``load_plan_checked``): 503s past the retries are the store's one line; a garbled
    plan.json is named by its URL."""
    import shardgen.dataio.rundir.remote as remote
    from shardgen.dataio.prompts.plan import PlanError
    from shardgen.dataio.resume.repair import load_plan_checked

    run = RunDir(tmp_path / "run", store=url)
    plan_in(run, tmp_path)
    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    s3.proxy.fail_next(4)
    with pytest.raises(remote.StorageError, match="failed 2 times"):
        load_plan_checked(run)
    run.files.replace(run.plan_json_path, b"{garbage")
    with pytest.raises(PlanError, match=f"^{url}/plan/plan.json: unreadable \\(JSONDecodeError.* delete every object "
                                        f"under {url}/plan/ and re-run the same command"):
        load_plan_checked(run)


def test_plan_files_without_a_published_plan_json_are_no_plan(tmp_path, url):
    """A planner that died after writing starts.npy but before plan.json: the next launch sees no plan and makes
    it again over the leftovers."""
    from shardgen.dataio.prompts.plan import has_plan, load_plan

    run = RunDir(tmp_path / "run", store=url)
    run.files.replace(run.starts_path, b"left by a killed planner")
    assert not has_plan(run) and load_plan(run) is None
    assert plan_in(run, tmp_path).num_shards == 4 and load_plan(run).starts.shape == (4, 2)


def test_a_shard_of_a_run_kept_in_a_bucket_is_committed_by_its_upload_there(s3, bucket, url, tmp_path):
    """A run kept in a bucket commits a shard by uploading it into its own shards/ folder: the stats staged beside
    the local tar, tar and index sent, then the upload record (holding the stats: the done marker); the local
    files go.
    A launch finds a shard staged here but committed by another replica meanwhile, and drops its copy unsent; so
    too a tar and index a launch killed between their rename and its stats left (shard 2), once shard 2 is committed
    and no live claim holds it."""
    import hashlib

    from shardgen.dataio.rundir.claims import Claimer, owner_record

    from shardgen.dataio.shards.upload import ShardUploader, staged_shards, upload_state

    run = RunDir(tmp_path / "run", store=url)
    run.shards_dir.mkdir(parents=True)
    tar = b"t" * 2048
    shard_stats = dict(stats(0), tar_bytes=2048, sha256=hashlib.sha256(tar).hexdigest())
    for shard in (0, 1):
        run.shard_file(shard).write_bytes(tar)
        (run.shards_dir / f"{shard:06d}.parquet").write_bytes(b"index")
        DirFiles().replace(run.shard_stats(shard), json_bytes(shard_stats))
    uploader = ShardUploader(run, f"{url}/shards/", keep_local=False)
    assert uploader.commits and uploader.pending() == [0, 1] and not run.is_done(0)
    uploader.upload(0)
    assert s3.fs().cat_file(f"{url}/shards/000000.tar") == tar
    assert not s3.fs().exists(f"{url}/shards/000000.stats.json")  # the upload record is the done marker
    assert read_record(run, 0)["stats"] == shard_stats and uploader.uploaded(0)
    assert run.done_shards() == {0} and staged_shards(run) == {1} and not run.shard_file(0).exists()
    run.files.replace(run.shard_uploaded(1), json_bytes(read_record(run, 0)))  # shard 1 committed by another replica
    run.shard_file(2).write_bytes(tar)  # killed after renaming its tar and index into shards/, before its stats
    (run.shards_dir / "000002.parquet").write_bytes(b"index")
    assert uploader.resume() == 0
    assert sorted(p.name for p in run.shards_dir.iterdir()) == ["000002.parquet", "000002.tar"]  # not committed yet
    run.files.replace(run.shard_uploaded(2), json_bytes(read_record(run, 0)))  # then committed by another replica
    holder = Claimer(run, owner_record(0), lease_s=60, own_thread=False)
    assert holder.try_claim(2, None) == 1  # claimed again, alive: a launch here rewriting it (retry_failed)
    assert uploader.resume() == 0 and len(list(run.shards_dir.iterdir())) == 2
    holder.release(2)
    assert uploader.resume() == 0
    assert staged_shards(run) == set() and list(run.shards_dir.iterdir()) == []
    assert upload_state(run) == dict(uri=f"{url}/shards/", uploaded=3, committed=3)


def test_repair_reads_and_removes_done_markers_in_a_bucket(url, tmp_path):
    """A committed shard whose tar is gone is found by its stats in the bucket, and removing it removes its markers
    there (stats first) and its local files."""
    from shardgen.dataio.resume.repair import committed_shard_problem, remove_committed

    run = RunDir(tmp_path / "run", store=url)
    run.shards_dir.mkdir(parents=True)
    assert committed_shard_problem(run, 0) is None  # nothing committed
    run.files.replace(run.shard_stats(0), json_bytes(stats(0)))
    assert committed_shard_problem(run, 0) == "000000.tar is missing"
    run.shard_file(0).write_bytes(b"x" * 10)
    run.files.replace(run.shard_uploaded(0), b"{}")
    remove_committed(run, 0)
    assert run.files.names(run.shards_dir) == run.files.names(run.uploads_dir) == [] and not run.shard_file(0).exists()


def test_the_owner_record_in_a_bucket_is_every_machines_and_each_directory_holds_a_copy(url, tmp_path):
    """Two machines (two directories, one bucket) start the run: the first record created is the run's, each
    directory holds its bytes, and both name the run alike (its uploads' run id)."""
    from shardgen.dataio.shards.upload import run_id

    one, two = RunDir(tmp_path / "one", store=url), RunDir(tmp_path / "two", store=url)
    one.start()
    record = one.files.read(one.marker_path)
    assert json.loads(record)["shardgen_run"] == 1
    two.start()
    assert one.marker_path.read_bytes() == two.marker_path.read_bytes() == two.files.read(two.marker_path) == record
    assert run_id(one) == run_id(two) is not None
    two.undo_start(None)
    assert not two.files.exists(two.marker_path) and not two.marker_path.exists() and run_id(two) is None


def test_the_prompt_files_hash_is_remembered_in_the_runs_store(run):
    from shardgen.dataio.prompts.plan import last_prompt_path
    from shardgen.dataio.resume.fingerprint import cached_prompt_hash, remember_prompt_hash

    identity = dict(path="/data/prompts.txt", size=10, mtime_ns=1, ctime_ns=1, inode=2)
    assert cached_prompt_hash(run, identity) is None and last_prompt_path(run) is None
    run.root.mkdir()
    remember_prompt_hash(run, "ab" * 32, identity)
    assert cached_prompt_hash(run, identity) == "ab" * 32 and last_prompt_path(run) == "/data/prompts.txt"
    assert cached_prompt_hash(run, dict(identity, size=11)) is None
    assert run.files.exists(run.prompt_hash_path) and run.prompt_hash_path.exists() != bool(run.store)


def test_lines_appended_at_once_by_several_writers_are_all_kept(run, url):
    """Four writers (in a bucket: four stores, as four machines hold) append 5 lines each at once: every line is
    there once, whole; the readers of the change log and of the launches read them from the store."""
    from shardgen.dataio.resume.fingerprint import fingerprint_changes
    from shardgen.dataio.rundir.runlog import read_run_jsonl, record_launch
    from shardgen.tools.runfiles import read_launches

    run.root.mkdir()
    stores = [BucketFiles(url, run.root) if run.store else DirFiles() for _ in range(4)]
    barrier = threading.Barrier(4)

    def go(i: int) -> None:
        barrier.wait()
        for k in range(5):
            stores[i].append(run.fingerprint_changes_path, json.dumps(dict(writer=i, k=k)))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    got = fingerprint_changes(run)
    assert sorted((r["writer"], r["k"]) for r in got) == [(i, k) for i in range(4) for k in range(5)]
    assert [r["k"] for r in got if r["writer"] == 2] == list(range(5))  # each writer's in its order
    record_launch(run, dict(ok=3))
    record_launch(run, dict(ok=4))
    assert [r["ok"] for r in read_launches(run)] == [r["ok"] for r in read_run_jsonl(run, run.launches_path)] == [3, 4]
    assert run.launches_path.exists() != bool(run.store)


def test_an_append_that_keeps_losing_its_race_is_one_line_saying_so(url, tmp_path, monkeypatch):
    import shardgen.dataio.rundir.runfiles as runfiles
    from shardgen.dataio.rundir.remote import StorageError

    monkeypatch.setattr(runfiles, "APPEND_TRIES", 3)
    run = RunDir(tmp_path / "run", store=url)
    monkeypatch.setattr(run.files, "replace_if", lambda path, data, version: False)  # another writer, every time
    with pytest.raises(StorageError) as e:
        run.files.append(run.launches_path, "{}")
    assert str(e.value).startswith(f"{url}/launches.jsonl: other writers kept replacing it") and "\n" not in str(e.value)


def extended_plan_in(run: RunDir, tmp_path):
    """The run planned from 7 rows (2 a shard: shards 0..3), then 5 rows appended and planned as its extension
    (shards 4..6), its fingerprint updated: (the prompt file's path, its PromptSource)."""
    from shardgen.dataio.prompts.plan import build_plan, file_sha256, load_plan
    from shardgen.dataio.prompts.read import PromptSource
    from shardgen.dataio.resume.extend import _plan_extension
    from shardgen.dataio.resume.repair import load_plan_or_discard, record_plan_digests

    path = tmp_path / "prompts.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(7)))
    source, before = PromptSource(str(path), "txt"), (path.stat().st_size, file_sha256(path))
    record_plan_digests(build_plan(run, source, samples_per_shard=2, run_seed=1, prompt_sha256=before[1]))
    with path.open("a") as f:
        f.write("".join(f"prompt {i}\n" for i in range(7, 12)))
    after = (path.stat().st_size, file_sha256(path))
    _plan_extension(run, load_plan(run), source, before, after, None)
    run.files.replace(run.fingerprint_path, json_bytes(fingerprint(**{"prompts.sha256": after[1]})))
    assert load_plan_or_discard(run).num_shards == 7
    return path, source


def test_a_changed_plan_file_of_an_extended_run_is_refused_with_its_one_fix(run, tmp_path, monkeypatch):
    """A plan file changed while an extended run generates: the shard's rows are refused with the extended run's
    fix (restore plan/), not "delete plan.json and re-run", which would lose its plan for good."""
    import shardgen.dataio.resume.repair as repair
    from shardgen.dataio.prompts.plan import load_plan

    extended_plan_in(run, tmp_path)
    plan = load_plan(run)
    data = bytearray(run.files.read(run.starts_path))
    data[-1] ^= 1  # the same size: a sha256 check finds it
    run.files.replace(run.starts_path, bytes(data))
    monkeypatch.setattr(repair, "_stored_plan_checked", {})
    with pytest.raises(RunDirError) as e:
        repair.checked_rows(plan, 0)
    assert str(e.value).startswith(f"{run.files.where(run.starts_path)} was changed after the plan was made; ")
    assert str(e.value).endswith("Restore plan/ from a backup, or start a new run_dir") and "delete" not in str(e.value)


def test_a_plan_whose_extension_was_deleted_is_refused_until_it_is_restored(run, tmp_path):
    """An extended run whose extension is deleted (by hand, or lost with a partial backup): the plan of the first
    rows alone is whole, and a launch would finish the run without the appended rows, moving their
    committed shards to stray/. The launch's plan check, its check of a file appended again and the read-only tools
    refuse it instead, naming the missing extension; restored, it is the whole plan again."""
    import shutil

    from shardgen.dataio.prompts.plan import file_sha256, load_plan
    from shardgen.dataio.resume.extend import extend_if_appended
    from shardgen.dataio.resume.repair import load_plan_checked, load_plan_or_discard

    path, source = extended_plan_in(run, tmp_path)
    ext = run.plan_dir / "ext-000001"
    saved = {name: run.files.read(ext / name) for name in ("starts.npy", "digests.npy", "plan.json")}
    for name in reversed(saved):  # plan.json first: a bucket's extension is published by it
        run.files.delete(ext / name)
    shutil.rmtree(ext, ignore_errors=True)
    missing = f"the extension that planned the appended rows ({run.files.where(ext)}) is missing"
    for load in (load_plan_or_discard, load_plan_checked):
        with pytest.raises(RunDirError, match="Restore plan/ from a backup, or start a new run_dir") as e:
            load(run)
        assert missing in str(e.value) and "covers only the file's first 63 bytes (shards 0..3)" in str(e.value)
    with path.open("a") as f:  # appended again: extending from the first rows would plan the lost ones again
        f.write("prompt 12\n")
    with pytest.raises(RunDirError, match="is missing"):
        extend_if_appended(run, fingerprint(**{"prompts.sha256": file_sha256(path)}), source, path.stat().st_size,
                           lambda: None)
    assert load_plan(run).num_shards == 4 and not run.files.exists(ext / "plan.json")  # nothing planned again
    if not run.store:
        ext.mkdir()
    for name, data in saved.items():
        run.files.replace(ext / name, data)
    assert load_plan_or_discard(run, str(path)).num_shards == 7


def test_prompts_appended_to_a_run_in_a_bucket_are_planned_as_an_extension_there(tmp_path, url):
    """The extension's files are the bucket's (published by its plan.json), the plan read back has the appended
    rows as the directory's does, a second planner of the same extension adopts it, and a discarded plan takes its
    extensions with it."""
    from shardgen.dataio.prompts.plan import discard_plan, extension_dirs, file_sha256, load_plan
    from shardgen.dataio.prompts.read import PromptSource
    from shardgen.dataio.resume.extend import _plan_extension

    plans = {}
    for name, store in (("a", ""), ("b", url)):
        run = RunDir(tmp_path / name, store=store)
        plan = plan_in(run, tmp_path)
        path = tmp_path / "prompts.txt"
        before = (path.stat().st_size, file_sha256(path))
        with path.open("a") as f:
            f.write("".join(f"prompt {i}\n" for i in range(7, 12)))
        after = (path.stat().st_size, file_sha256(path))
        source = PromptSource(str(path), "txt")
        plans[name] = _plan_extension(run, plan, source, before, after, None)
        assert _plan_extension(run, plan, source, before, after, None).num_shards == 7  # a racing job's: adopted
        path.write_text("".join(f"prompt {i}\n" for i in range(7)))  # as the next run finds it
    (tmp_path / "prompts.txt").write_text("".join(f"prompt {i}\n" for i in range(12)))  # the rows both read
    local, remote = plans["a"], plans["b"]
    run = remote.run
    assert extension_dirs(run) == [run.plan_dir / "ext-000001"] and not run.plan_dir.exists()
    assert sorted(run.files.names(run.plan_dir / "ext-000001")) == ["digests.npy", "plan.json", "starts.npy"]
    assert [r.prompt for s in range(7) for r in remote.rows(s)] == [r.prompt for s in range(7) for r in local.rows(s)]
    assert load_plan(run).num_shards == 7
    discard_plan(run, "replaced")
    assert extension_dirs(run) == [] and run.files.names(run.plan_dir / "ext-000001") == [] and load_plan(run) is None
