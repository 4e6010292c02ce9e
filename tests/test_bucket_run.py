"""A run kept in a bucket (``run_dir=s3://bucket/prefix``) on the test S3 server (tests/s3_server.py): its plan,
claims, done markers and shards in the bucket, the machine's scratch folder empty of shards at the end; the bytes of
a local run; every prompt exactly once under kills of two launches on two "machines" (scratch folders); a store
without conditional writes, another kind of URL and a bucket without a folder refused in one line."""

from __future__ import annotations

import io
import os
import random
import time
from pathlib import Path

import pytest

from jobs.generate import run
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.tools.verify import read_shard_members, verify_run
from tests.conftest import Forked, compose_cfg, start_module
from tests.test_generate import shard_images

FAST = ("height=32", "width=32", "steps=2", "batch_size=2", "samples_per_shard=4", "progress=false")


def bucket_objects(fs, url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    root = url.removeprefix("s3://").rstrip("/")
    return sorted(p[len(root) + 1:] for p in fs.find(root))


def bucket_images(run: RunDir) -> dict[str, bytes]:
    """key -> image bytes over every committed shard of a run kept in a bucket, read from the bucket."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    out = {}
    for shard in sorted(run.done_shards()):
        data = fs.cat_file(f"{run.store.removeprefix('s3://')}/shards/{shard:06d}.tar")
        for key, mem in read_shard_members(io.BytesIO(data)).items():
            out[key] = next((v for k, v in mem.items() if k in ("png", "jpg", "webp")), None)
    return out


@pytest.fixture
def url(bucket) -> str:
    return f"s3://{bucket}/runs/r1"


def test_a_run_kept_in_a_bucket_gives_the_bytes_of_a_local_run_and_leaves_no_shard_on_the_machine(
        tmp_path, url, s3, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10"))
    assert (result.ok, result.complete) == (10, True)
    assert not (tmp_path / "s3:").exists()
    names = bucket_objects(s3.fs(), url)
    assert [n for n in names if n.startswith("shards/") and n.endswith(".tar")] == \
        ["shards/000000.tar", "shards/000001.tar", "shards/000002.tar"]
    assert {"fingerprint.json", "plan/plan.json", "uploads/000002.json", "shards/000002.parquet"} <= set(names)
    assert not [n for n in names if n.endswith(".stats.json")]  # the upload record (uploads/) holds the stats
    assert not [n for n in names if n.startswith("claims/")]  # released at each commit
    bucket_run = RunDir.at(url)
    assert bucket_run.store == url and bucket_run.done_shards() == {0, 1, 2}
    assert not list((bucket_run.root / "shards").glob("*"))  # the scratch folder keeps no committed shard
    assert verify_run(load_plan(bucket_run)).ok
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", *FAST, "prompts.limit=10")).complete
    assert bucket_images(bucket_run) == shard_images(local)
    again = run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10"))
    assert (again.complete, again.generated_here) == (True, 0)


@pytest.mark.parametrize("run_dir,message", [
    ("gs://bucket/run", "a run kept in a bucket needs an S3-compatible store (run_dir=s3://BUCKET/PREFIX)"),
    ("s3://bucket", "name a folder in the bucket for the run (run_dir=s3://bucket/RUN_NAME)"),
    ("s3://bucket/a//b", "an empty, '.' or '..' folder name (as in //) is a key object stores keep and fsspec "
                         "normalises away, so the run's files would be written and read back under different keys; "
                         "write run_dir=s3://bucket/a/b"),
])
def test_a_url_that_cannot_hold_a_run_is_refused_in_one_line(tmp_path, monkeypatch, run_dir, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunDirError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(compose_cfg(f"run_dir={run_dir}", *FAST, "prompts.limit=2"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run_dir,message", [
    ("gs://bucket/r", "a run kept in a bucket needs an S3-compatible store"),
    ("s3://bucket/./r", "write run_dir=s3://bucket/r"),
])
def test_the_tools_refuse_a_url_no_run_can_be_kept_at_as_generate_does(tmp_path, monkeypatch, capsys, run_dir,
                                                                        message):
    from jobs.status import main as status

    monkeypatch.chdir(tmp_path)
    assert status([run_dir]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_output_uri_beside_a_bucket_run_dir_is_refused_in_one_line(url):
    from shardgen.errors import ConfigError

    with pytest.raises(ConfigError, match="keeps the run in the bucket, its shards under .*/shards/ already"):
        run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=2", "output_uri=s3://elsewhere/x/"))


def test_a_store_that_ignores_conditional_writes_is_refused_before_planning(url, s3):
    from shardgen.dataio.rundir.bucket import ConditionalWritesUnsupported

    s3.proxy.ignore_conditions()
    with pytest.raises(ConditionalWritesUnsupported, match="ignores If-None-Match"):
        run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=2"))
    assert bucket_objects(s3.fs(), url) == []  # nothing planned


def _shards_in(s3, url: str) -> list[str]:
    """The shard tars committed to the bucket run so far (a fresh listing)."""
    fs = s3.fs()
    fs.invalidate_cache()
    return fs.glob(f"{url.removeprefix('s3://')}/shards/*.tar")


def _launch(url: str, scratch: Path, models: Path, *more: str, hook: Path | None = None) -> Forked:
    """A launch on its own "machine": its own scratch folder ($SHARDGEN_CACHE), the session's tiny models; ``hook``
    a folder put first on its path (a sitecustomize); what it prints goes to a log beside the scratch folder."""
    scratch.mkdir(parents=True, exist_ok=True)
    logs = sorted(scratch.parent.glob(f"{scratch.name}-launch-*.log"))
    return start_module("jobs.generate", [f"run_dir={url}", *FAST, "samples_per_shard=3", f"model.cache_dir={models}",
                                          "lease_s=4", "heartbeat_s=0.5", *more],
                        scratch.parent / f"{scratch.name}-launch-{len(logs)}.log",
                        env={**os.environ, "SHARDGEN_CACHE": str(scratch)}, hooks=[hook] if hook else [])


def _paced(tmp_path: Path, seconds: float) -> Path:
    """A sitecustomize folder that makes every batch of the tiny pipeline take ``seconds`` more, so that a shard
    takes longer than the kill below waits after a commit: the tiny model alone finishes a launch's remaining shards
    within a fraction of a second of its first, so on a loaded machine every launch could finish before the kill."""
    hook = tmp_path / "paced"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import functools, time, diffusers\n"
        "_call = diffusers.FluxPipeline.__call__\n"
        "@functools.wraps(_call)\n"  # the job reads the pipeline's signature for the arguments it passes
        "def call(self, *a, **k):\n"
        f"    time.sleep({seconds})\n"
        "    return _call(self, *a, **k)\n"
        "diffusers.FluxPipeline.__call__ = call\n")
    return hook


@pytest.mark.slow
def test_two_launches_killed_again_and_again_on_one_bucket_run_make_every_prompt_once(tmp_path, url, s3):
    n, rng = 12, random.Random(7)
    models = Path(os.environ["SHARDGEN_CACHE"])
    machines = [tmp_path / "machine-a", tmp_path / "machine-b"]
    hook = _paced(tmp_path, 0.5)  # a shard of 3 in batches of 2: 1 s or more
    kills = 0
    for _ in range(3):  # each round killed mid-run: once a shard more is in the bucket, within half a second after it
        before = len(_shards_in(s3, url))
        launches = [_launch(url, m, models, f"prompts.limit={n}", hook=hook) for m in machines]
        deadline = time.monotonic() + 60
        while (len(_shards_in(s3, url)) == before and time.monotonic() < deadline
               and any(p.poll() is None for p in launches)):
            time.sleep(0.1)
        time.sleep(rng.uniform(0, 0.5))
        killed = [p for p in launches if p.poll() is None]
        for p in killed:
            p.kill()
        for p in launches:
            p.wait(timeout=60)
            assert p in killed or p.returncode == 0, p.output[-3000:]  # a launch that failed by itself
        kills += len(killed)
        if not killed:
            break
    for m in machines:  # each machine's next launch: the first finishes the run, the second has nothing to do
        final = _launch(url, m, models, f"prompts.limit={n}")
        assert final.wait(timeout=300) == 0, final.output[-3000:]
    assert kills >= 2
    bucket_run = RunDir.at(url)
    plan = load_plan(bucket_run)
    keys = []
    for shard in range(plan.num_shards):
        data = s3.fs().cat_file(f"{url.removeprefix('s3://')}/shards/{shard:06d}.tar")
        keys += list(read_shard_members(io.BytesIO(data)))
    assert sorted(keys) == [f"{i:010d}" for i in range(n)]  # every prompt exactly once
    assert verify_run(plan).ok
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", *FAST, "samples_per_shard=3", f"prompts.limit={n}")).complete
    assert bucket_images(bucket_run) == shard_images(local)
    for m in machines:  # what a killed launch left in a machine's scratch goes at its next launch
        assert not list(m.glob("runs/*/shards/*"))


def test_the_tools_read_a_run_kept_in_a_bucket_from_its_url(tmp_path, url, capsys, monkeypatch):
    import json

    from jobs.status import main as status
    from jobs.verify import main as verify

    monkeypatch.chdir(tmp_path)
    assert run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=6")).complete
    capsys.readouterr()
    monkeypatch.setenv("SHARDGEN_CACHE", str(tmp_path / "another-machine"))  # none of the run's scratch files
    assert status([url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["run_dir"], st["state"], st["shards"]["done"], st["results"]["ok"]) == (url, "complete", 2, 6), st
    assert [r["samples"] for r in st["replicas"]] == [6] and st["rate"] > 0, st  # the commits' log is the bucket's
    assert status([url, "--prometheus"]) == 0
    assert f'shardgen_run_prompts{{run="{url}"}} 6.0' in capsys.readouterr().out
    assert verify([url]) == 0
    assert "OK" in capsys.readouterr().out
    assert not (tmp_path / "s3:").exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [("strategy=tp", "tp_degree=2"), ("strategy=cp_ulysses", "ulysses_degree=2")],
                         ids=["tp-2", "ulysses-2"])
def test_model_parallel_replicas_on_a_bucket_run_give_the_bytes_of_one_process(tmp_path, url, strategy, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=6", *strategy, "launcher=local", "launcher.nprocs=2"))
    assert RunDir.at(url).done_shards() == {0, 1}
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", *FAST, "prompts.limit=6")).complete
    assert bucket_images(RunDir.at(url)) == shard_images(local)
    assert verify_run(load_plan(RunDir.at(url))).ok


def _uploads(s3, url: str) -> int:
    """Upload records (done shards) in the bucket, read from the server itself (not through the fault proxy)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=f"http://127.0.0.1:{s3.proxy.target}")
    try:
        return len(fs.ls(f"{url.removeprefix('s3://')}/uploads", refresh=True))
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_an_outage_longer_than_the_lease_stops_the_launch_in_one_line_and_the_next_one_completes(tmp_path, url, s3):
    """The store unreachable mid-run for longer than the lease and every request's retries: the launch ends with
    one line saying to re-run (its heartbeat gives its claims up, no thread dies with a traceback); the next launch
    on the same machine completes the run, the shard whose upload the outage cut made again, every prompt once."""
    n = 16
    models = Path(os.environ["SHARDGEN_CACHE"])
    launch = _launch(url, tmp_path / "machine", models, f"prompts.limit={n}", "samples_per_shard=2")
    deadline = time.time() + 240
    while _uploads(s3, url) < 2 and launch.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert launch.poll() is None, launch.output[-3000:]
    s3.proxy.down()  # for longer than lease_s=4 and the retries of a request (about 16 s)
    try:
        rc = launch.wait(timeout=120)
    finally:
        s3.proxy.up()
    err = launch.output
    assert rc != 0 and "Traceback" not in err, err[-3000:]
    assert "the storage is unreachable or failing. Re-run once it answers" in err, err[-3000:]
    assert 2 <= _uploads(s3, url) < n // 2
    final = _launch(url, tmp_path / "machine", models, f"prompts.limit={n}", "samples_per_shard=2")
    assert final.wait(timeout=300) == 0, final.output[-3000:]
    plan = load_plan(RunDir.at(url))
    names = bucket_objects(s3.fs(), url)
    assert [f"shards/{s:06d}.tar" in names for s in range(plan.num_shards)] == [True] * plan.num_shards, names
    keys = []
    for shard in range(plan.num_shards):
        keys += list(read_shard_members(io.BytesIO(s3.fs().cat_file(f"{url.removeprefix('s3://')}/shards/"
                                                                         f"{shard:06d}.tar"))))
    assert sorted(keys) == [f"{i:010d}" for i in range(n)]
    assert verify_run(plan).ok


def test_a_run_throttled_throughout_with_slow_down_answers_completes_with_the_same_bytes(tmp_path, url, s3,
                                                                                        monkeypatch):
    import threading

    monkeypatch.chdir(tmp_path)
    stop, throttled = threading.Event(), []

    def throttle():  # 503 SlowDown to a new connection twice a second for 4 s: fewer than a request's 6 attempts
        for _ in range(8):
            if stop.wait(0.5):
                return
            throttled.append(s3.proxy.served_errors)
            s3.proxy.fail_next(1)

    thread = threading.Thread(target=throttle, daemon=True)
    s3.proxy.fail_next(3)  # the launch's first requests too
    thread.start()
    try:
        result = run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10"))
    finally:
        stop.set()
        thread.join()
        s3.proxy.errors_left = 0
    assert (result.ok, result.complete) == (10, True)
    assert sum(throttled) + s3.proxy.served_errors >= 3  # answered SlowDown, and retried
    local = tmp_path / "local"
    assert run(compose_cfg(f"run_dir={local}", *FAST, "prompts.limit=10")).complete
    assert bucket_images(RunDir.at(url)) == shard_images(local)
    assert verify_run(load_plan(RunDir.at(url))).ok


def test_a_bucket_run_whose_first_launch_stopped_before_any_sample_takes_new_settings(tmp_path, url, s3,
                                                                                       monkeypatch):
    """As a local run does: the first launch stopped while loading its model (the folder's owner record already
    written), so the fixed command with other settings runs the same run_dir instead of being refused."""
    from shardgen.run import runner

    monkeypatch.chdir(tmp_path)
    real = runner.apply_strategy

    def fails_to_load(*args, **kwargs):
        raise OSError("the model's folder is not mounted on this node")

    monkeypatch.setattr(runner, "apply_strategy", fails_to_load)
    with pytest.raises(OSError, match="not mounted"):
        run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=4"))
    assert "shards/_shardgen_run.json" in bucket_objects(s3.fs(), url)
    monkeypatch.setattr(runner, "apply_strategy", real)
    other_steps = tuple(a for a in FAST if not a.startswith("steps=")) + ("steps=1",)
    result = run(compose_cfg(f"run_dir={url}", *other_steps, "prompts.limit=4"))
    assert (result.ok, result.complete) == (4, True)
