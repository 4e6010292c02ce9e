"""launcher=ray on a real local Ray cluster of two nodes (``ray start --head`` and a second ``ray start`` joining it,
each with its own CPUs): model-parallel replicas give the one-process bytes, a lost actor and a killed driver are
resumed to every prompt exactly once, and what cannot run is refused in one line."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import webdataset as wds

from jobs.generate import run
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.resume.ledger import read_ledger
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import verify_run
from tests.conftest import ROOT, compose_cfg, start_module
from tests.test_generate import shard_images

ray = pytest.importorskip("ray", reason="launcher=ray needs Ray (the test extra installs it)")

pytestmark = pytest.mark.slow
FAST = ("height=32", "width=32", "steps=2", "batch_size=2", "samples_per_shard=4", "progress=false")


def _ray(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("ray") or "ray", *args], capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def _cluster(tmp_path_factory):
    """The address of a two-node Ray cluster on this machine (2 CPUs each); stopped afterwards."""
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not on PATH")
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # every address of the cluster on loopback: the drivers reach the head at 127.0.0.1, and the address a node
    # would otherwise advertise (the machine's first interface) is one more path a loaded CI box can lose
    common = ("--num-cpus=2", "--object-store-memory=150000000", "--disable-usage-stats", "--node-ip-address=127.0.0.1")
    env = _env()
    head = _ray("start", "--head", f"--port={port}", "--include-dashboard=false", *common, env=env)
    if head.returncode != 0:
        pytest.skip(f"ray start failed: {head.stderr[-500:]}")
    address = f"127.0.0.1:{port}"
    try:
        _wait_for_head(address, env)
        for _ in range(3):  # on a loaded machine the head's GCS may not answer the joining node at first
            try:
                second = _ray("start", f"--address={address}", *common, env=env)
            except subprocess.TimeoutExpired as e:
                second = subprocess.CompletedProcess(e.cmd, 1, "", f"timed out after {e.timeout} s")
            if second.returncode == 0:
                break
            time.sleep(5)
        assert second.returncode == 0, second.stderr[-2000:]
        yield address
    finally:
        _ray("stop", "--force")


@pytest.fixture
def cluster(_cluster):
    """The cluster's address once its head answers again: a test's killed driver leaves the head ending its job,
    and the next driver to connect meanwhile could miss its handshake."""
    if not _wait_for_head(_cluster, _env()):
        pytest.fail(f"the Ray head at {_cluster} did not answer ray health-check for 240 s")
    return _cluster


def _wait_for_head(address: str, env: dict, timeout_s: float = 240) -> bool:
    """Whether the head's GCS answers (``ray health-check``) within ``timeout_s``: on a loaded machine it comes up
    minutes after ``ray start --head`` returns, and a node joining before that times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if _ray("health-check", f"--address={address}", env=env).returncode == 0:
                return True
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)
    return False


def _args(run_dir: Path, *more: str) -> tuple[str, ...]:
    return (f"run_dir={run_dir}", "device=cpu", *FAST, *more)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, bytes]:
    """The images of a plain one-process run of 10 prompts (3 shards: the last one short)."""
    d = tmp_path_factory.mktemp("ray-ref") / "run"
    assert run(compose_cfg(*_args(d, "prompts.limit=10"))).complete
    return shard_images(d)


def _job(*overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    """``python -m jobs.generate`` as a user types it (forked from the worker's forkserver: start_module); a job
    still running after ``timeout`` fails the test with the end of what it printed (where it waited)."""
    import tempfile

    with tempfile.TemporaryDirectory() as logs:
        p = start_module("jobs.generate", list(overrides), Path(logs) / "out", env=_env(), stderr=Path(logs) / "err")
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"the job still ran after {timeout:g} s; the end of its stderr:\n{p.errors[-4000:]}")
        return subprocess.CompletedProcess(["jobs.generate", *overrides], rc, p.output, p.errors)


# Ray's defaults expect an idle machine: a GCS answering in 5 s, a worker process registering in 60 s. The suite's
# other tests load this one's two cores (a worker imports torch), so the cluster and its drivers wait longer.
LOADED_MACHINE = {"RAY_gcs_rpc_server_connect_timeout_s": "60", "RAY_gcs_rpc_server_reconnect_timeout_s": "300",
                  "RAY_worker_register_timeout_seconds": "300"}


def _env() -> dict:
    """This checkout on the path; Ray's token authentication off for this cluster of one machine (a token an earlier
    local cluster left in ~/.ray would otherwise be asked of the second node and the drivers); Ray's timeouts for a
    loaded machine."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "RAY_AUTH_MODE": "disabled", **LOADED_MACHINE}


@pytest.mark.parametrize("strategy,ranks", [
    (("strategy=tp", "tp_degree=2"), 2), (("strategy=cp_ulysses", "ulysses_degree=2"), 2),
    (("strategy=cp_ring", "ring_degree=2", "cfg_degree=2"), 4), (("strategy=auto",), 1),
    (("strategy=tp", "launcher.ranks_per_replica=3"), 3)], ids=["tp2", "ulysses2", "ring2xcfg2", "auto", "set"])
def test_a_replica_asks_ray_for_one_actor_per_rank_its_strategy_makes(strategy, ranks):
    """The actors of a replica (its placement group's bundles): the product of the strategy's degrees, whatever the
    strategy; the end-to-end run below takes tp as the model-parallel case (the launcher does nothing else per
    strategy: the ranks' groups are the strategy's own, tested under gloo in tests/test_parallel_parity.py)."""
    from shardgen.launch.ray_cluster import ranks_per_replica

    assert ranks_per_replica(compose_cfg("launcher=ray", *strategy)) == ranks


def test_two_model_parallel_replicas_on_two_nodes_give_the_one_process_bytes(tmp_path, cluster, one_process):
    d = tmp_path / "run"
    p = _job(*_args(d, "prompts.limit=10"), "strategy=tp", "tp_degree=2", "launcher=ray", f"launcher.address={cluster}",
             "launcher.replicas=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 Ray replica(s) of 2 rank(s)" in p.stdout
    assert re.search(r"10 images, 0 failed, 0 rejected of 10 samples; generated 10 this launch on 2 Ray replica",
                     p.stdout)
    images = shard_images(d)
    assert images == one_process  # byte for byte, every key once
    logs = sorted(x.name for x in RunDir(d).ray_logs_dir.glob("*.log"))
    assert logs == ["replica000.rank0.log", "replica000.rank1.log", "replica001.rank0.log", "replica001.rank1.log"]
    assert "rank 1/2 on cpu (gloo)" in (RunDir(d).ray_logs_dir / "replica001.rank1.log").read_text()
    assert verify_run(load_plan(RunDir(d))).ok


def _durable(run_dir: Path) -> int:
    plan = load_plan(RunDir(run_dir)) if (run_dir / "plan").is_dir() else None
    return 0 if plan is None else read_ledger(plan).done_samples


def _wait_for(what, timeout: float, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout
    while not what():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the driver ended first (rc {proc.returncode})")
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def test_a_lost_actor_and_a_killed_driver_resume_to_every_prompt_once(tmp_path, cluster):
    """SIGKILL a replica's leader (its shard's claim holder) mid-run: the driver starts the replica again. Then
    SIGKILL the driver: Ray ends its actors, and the same command completes the run, its shards taken over."""
    d, log, n = tmp_path / "run", tmp_path / "driver.log", 40
    heavier = (f"prompts.limit={n}", "height=64", "width=64", "steps=4")
    args = (*_args(d, *heavier), "launcher=ray", f"launcher.address={cluster}", "launcher.replicas=2", "lease_s=30",
            "heartbeat_s=1")
    driver = start_module("jobs.generate", list(args), log, env=_env())
    try:
        _wait_for(lambda: _durable(d) >= 2 and "replica 0: 1 rank(s)" in log.read_text(), 300, driver)
        leader = int(re.search(r"replica 0: 1 rank\(s\) on node \S+ \(pids (\d+)\)", log.read_text()).group(1))
        os.kill(leader, signal.SIGKILL)
        _wait_for(lambda: "replica 0: 1 rank(s)" in log.read_text().partition("replica 0 lost rank 0")[2], 120, driver)
        assert ", restart 1" in log.read_text()
        killed_at = _durable(d)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert 2 <= killed_at < n, log.read_text()[-3000:]  # both kills landed mid-run
    p = _job(*args)
    assert p.returncode == 0, p.stderr[-3000:] + log.read_text()[-3000:]
    assert _durable(d) == n
    tars = sorted(str(t) for t in (d / "shards").glob("*.tar"))
    keys = [s["__key__"] for s in wds.WebDataset(tars, shardshuffle=False)]
    assert sorted(keys) == [f"{i:010d}" for i in range(n)]  # every prompt exactly once
    assert verify_run(load_plan(RunDir(d))).ok
    assert run(compose_cfg(*_args(tmp_path / "ref", *heavier))).complete
    assert shard_images(d) == shard_images(tmp_path / "ref")


def test_sigterm_to_the_driver_ends_its_actors_and_says_how_to_continue(tmp_path, cluster):
    d, log = tmp_path / "run", tmp_path / "driver.log"
    args = (*_args(d, "prompts.limit=40", "height=64", "width=64", "steps=4"), "launcher=ray",
            f"launcher.address={cluster}")
    driver = start_module("jobs.generate", list(args), log, env=_env())
    try:
        _wait_for(lambda: "replica 0: 1 rank(s)" in log.read_text(), 300, driver)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 143, log.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    text = log.read_text()
    assert "stopped by SIGTERM" in text and "re-run the same command to continue" in text
    assert "SIGTERM received" not in text  # Ray's own handler (a stack dump) is not the one that answers


def test_a_cluster_too_small_for_one_replica_is_refused_in_one_line(tmp_path, cluster):
    p = _job(*_args(tmp_path / "run", "prompts.limit=4"), "launcher=ray", f"launcher.address={cluster}",
             "launcher.cpus_per_rank=3", timeout=120)
    assert p.returncode != 0
    assert "no node of the Ray cluster can hold one replica: it needs 1 rank(s) x (3 CPU) on one node" in p.stderr, \
        p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_gpu_ranks_on_a_cpu_cluster_say_to_set_device_cpu(tmp_path, cluster):
    p = _job(f"run_dir={tmp_path / 'run'}", *FAST, "prompts.limit=4", "launcher=ray", f"launcher.address={cluster}",
             "device=cuda", timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "no node of the Ray cluster can hold one replica" in p.stderr, p.stderr[-2000:]
    assert "(set device=cpu for CPU ranks)" in p.stderr, p.stderr[-2000:]


def test_ray_missing_is_one_line_saying_how_to_install(monkeypatch, tmp_path):
    from shardgen.launch import ray_cluster

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as where it is not installed
    with pytest.raises(ray_cluster.RayMissingError, match=r"pip install 'shardgen\[ray\]'"):
        ray_cluster.launch(compose_cfg(*_args(tmp_path / "run", "prompts.limit=4"), "launcher=ray"))
    assert not (tmp_path / "run").exists()


def test_a_cluster_that_misses_a_handshake_is_tried_again_then_refused_in_one_line(tmp_path, caplog, monkeypatch):
    from shardgen.launch import ray_cluster

    monkeypatch.delenv(ray_cluster.GCS_CONNECT_ENV, raising=False)  # restored (unset) afterwards

    class FlakyRay:
        """ray's init and shutdown as a head busy ending another job answers them: ``fails`` refusals first."""

        def __init__(self, fails: int):
            self.fails, self.inits, self.shutdowns = fails, 0, 0

        def init(self, **_):
            self.inits += 1
            if self.inits <= self.fails:
                raise ConnectionError("Failed to connect to GCS within 60 seconds")

        def shutdown(self):
            self.shutdowns += 1

    cfg = compose_cfg(*_args(tmp_path / "run"), "launcher=ray", "launcher.address=10.0.0.1:6379")
    flaky = FlakyRay(fails=2)
    ray_cluster.connect(flaky, cfg, pause_s=0)
    assert (flaky.inits, flaky.shutdowns) == (3, 2)
    assert os.environ[ray_cluster.GCS_CONNECT_ENV] == "30"  # a busy head gets 30 s to answer, not Ray's 5
    monkeypatch.setenv(ray_cluster.GCS_CONNECT_ENV, "7")
    ray_cluster.connect(FlakyRay(fails=0), cfg, pause_s=0)
    assert os.environ[ray_cluster.GCS_CONNECT_ENV] == "7"  # the user's own setting is kept
    assert "connecting to the Ray cluster at 10.0.0.1:6379 failed (Failed to connect to GCS" in caplog.text
    with pytest.raises(ray_cluster.RayClusterError) as e:
        ray_cluster.connect(FlakyRay(fails=3), cfg, pause_s=0)
    assert str(e.value).startswith("cannot reach the Ray cluster at 10.0.0.1:6379 after 3 tries (Failed to connect "
                                   "to GCS within 60 seconds); check launcher.address")


@pytest.mark.parametrize("override,message", [
    ("launcher.replicas=0", "launcher.replicas=0: use 1 or more"),
    ("launcher.max_restarts=-1", "launcher.max_restarts=-1: use 0 (stop at the first loss) or more"),
    ("launcher.cpus_per_rank=0", "CPUs more than 0"),
])
def test_impossible_ray_settings_are_refused_before_anything_starts(tmp_path, override, message):
    from shardgen.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)):
        run(compose_cfg(*_args(tmp_path / "run", "prompts.limit=4"), "launcher=ray", override))
    assert not (tmp_path / "run").exists()


def test_an_address_nothing_answers_at_is_refused_at_once_and_nothing_is_written(tmp_path):
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    p = _job(*_args(tmp_path / "run", "prompts.limit=4"), "launcher=ray", f"launcher.address=127.0.0.1:{port}",
             timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"nothing answers at the Ray cluster address 127.0.0.1:{port}" in p.stderr
    assert time.monotonic() - t0 < 60  # not ray.init's minutes of retries
    assert not (tmp_path / "run").exists()


def test_an_actor_log_planted_as_a_symlink_is_refused_and_its_target_untouched(tmp_path, cluster):
    from shardgen.run.runner import prepare_run

    d, outside = tmp_path / "run", tmp_path / "mine.txt"
    args = (*_args(d, "prompts.limit=4"), "launcher=ray", f"launcher.address={cluster}")
    prepare_run(compose_cfg(*_args(d, "prompts.limit=4")))
    outside.write_text("the user's own file\n")
    RunDir(d).ray_logs_dir.mkdir(parents=True)
    (RunDir(d).ray_logs_dir / "replica000.rank0.log").symlink_to(outside)
    p = _job(*args)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "replica000.rank0.log is a symlink; run files must be regular files. Delete the link" in p.stderr
    assert outside.read_text() == "the user's own file\n"
