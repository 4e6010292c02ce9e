"""Several ranks and several jobs on one run, for real (gloo on CPU, separate processes):
identical output whatever the world size, exactly-once under SIGKILL, concurrent jobs, elastic resume."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.resume.ledger import read_ledger
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import verify_run
from jobs.generate import run
from tests.conftest import Forked, compose_cfg, start_module
from tests.test_generate import shard_images

pytestmark = pytest.mark.slow
N_PROMPTS = 48
COMMON = ("height=16", "width=16", "steps=2", "samples_per_shard=8", f"prompts.limit={N_PROMPTS}", "batch_size=4",
          "heartbeat_s=1", "lease_s=30")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    """Images of an uninterrupted one-rank run."""
    d = tmp_path_factory.mktemp("ref") / "run"
    assert run(compose_cfg(f"run_dir={d}", "progress=false", *COMMON)).ok == N_PROMPTS
    return shard_images(d)


def start_job(run_dir: Path, *overrides: str, log: Path) -> Forked:
    """``python -m jobs.generate`` as its own process group (so the whole job can be killed)."""
    args = [f"run_dir={run_dir}", "progress=false", *COMMON, *overrides, "hydra.verbose=shardgen"]
    return start_module("jobs.generate", args, log, new_session=True)


def finish_job(run_dir: Path, *overrides: str, log: Path, timeout: float = 240) -> None:
    p = start_job(run_dir, *overrides, log=log)
    assert p.wait(timeout=timeout) == 0, log.read_text()[-3000:]


def assert_complete_and_identical(run_dir: Path, reference: dict[str, bytes]) -> None:
    rep = verify_run(load_plan(RunDir(run_dir)))
    assert rep.ok, rep.defects
    assert rep.samples == N_PROMPTS
    assert shard_images(run_dir) == reference


def durable_samples(run_dir: Path) -> int:
    plan = load_plan(RunDir(run_dir))
    return 0 if plan is None else read_ledger(plan).done_samples


def handed_over(log_text: str) -> int:
    """Samples the replicas handed to their writers (DEBUG lines of shardgen/run/shardrun.py)."""
    return sum(int(n) for n in re.findall(r"handed over (\d+) samples", log_text))


@pytest.mark.soak  # ~70 s; tests/test_integrity_faults.py kills at every chosen point deterministically
def test_sigkill_at_random_moments_loses_at_most_a_batch_per_replica(tmp_path, reference):
    """3 kills of the whole 2-rank job at random instants (tests/test_integrity_faults.py kills at chosen points);
    every rerun continues; the end result equals the uninterrupted run, and each kill lost at most one batch
    (4 samples) per replica."""
    rng = random.Random(1234)
    run_dir, kills, losses = tmp_path / "run", 0, []
    while kills < 3:
        log = tmp_path / f"log{kills}"
        before = durable_samples(run_dir)
        p = start_job(run_dir, "launcher=local", "launcher.nprocs=2", log=log)
        while p.poll() is None and "handed over" not in log.read_text():  # start-up takes seconds: skip it
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        if p.poll() is not None:  # finished before the kill: start over on a fresh run
            assert p.returncode == 0, log.read_text()[-3000:]
            assert_complete_and_identical(run_dir, reference)
            run_dir = tmp_path / f"run{kills}"
            continue
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        kills += 1
        lost = handed_over(log.read_text()) - (durable_samples(run_dir) - before)
        losses.append(lost)
        assert lost <= 2 * 4, f"kill {kills} lost {lost} samples (more than one batch per replica)"
    finish_job(run_dir, "launcher=local", "launcher.nprocs=2", log=tmp_path / "final")
    assert_complete_and_identical(run_dir, reference)
    print(f"samples lost per kill: {losses}")


def test_two_concurrent_jobs_share_one_run(tmp_path, reference):
    """Two jobs started together on one run directory split its samples, none made twice. On a loaded machine one job
    may finish the run before the other has loaded its model: then the pair is started over on a fresh run (the
    sharing was not exercised), at most 3 times."""
    for attempt in range(3):
        run_dir, logs = tmp_path / f"run{attempt}", [tmp_path / f"log{attempt}-{i}" for i in range(2)]
        jobs = [start_job(run_dir, log=log) for log in logs]
        for log, p in zip(logs, jobs):
            assert p.wait(timeout=240) == 0, log.read_text()[-3000:]
        assert_complete_and_identical(run_dir, reference)
        worked = [handed_over(log.read_text()) for log in logs]
        assert sum(worked) == N_PROMPTS  # no sample was made twice
        if all(w > 0 for w in worked):
            return
    pytest.fail(f"in 3 attempts one job did all the work each time: {worked}")


def test_run_started_with_two_ranks_resumes_with_three(tmp_path, reference):
    """Kill a 2-rank job part-way (once its replicas have handed over 12+ samples), finish it with 3 ranks: the
    bytes equal the one-process run's, so neither the world size nor its change moves a pixel (the SIGKILL test
    finishes its runs with 2 ranks)."""
    for attempt in range(5):  # the whole job takes about a second: if it wins the race, start over on a fresh run
        run_dir, log = tmp_path / f"run{attempt}", tmp_path / f"log2-{attempt}"
        p = start_job(run_dir, "launcher=local", "launcher.nprocs=2", log=log)
        deadline = time.time() + 120
        while p.poll() is None and handed_over(log.read_text()) < 12 and time.time() < deadline:
            time.sleep(0.02)  # the log, not the ledger, is polled: it is cheap, so the kill lands mid-run
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if 0 < durable_samples(run_dir) < N_PROMPTS:
            break
    else:
        pytest.fail("in 5 attempts the kill never landed between the first and the last durable sample: "
                    + log.read_text()[-3000:])
    finish_job(run_dir, "launcher=local", "launcher.nprocs=3", log=tmp_path / "log3")
    assert_complete_and_identical(run_dir, reference)
