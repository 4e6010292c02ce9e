"""Per-sample failures are recorded with their reason and the run goes on; retry_failed regenerates
exactly those samples; a setup where everything fails stops instead of marking the run failed."""

from __future__ import annotations

import functools
import json

import pytest
from diffusers import FluxPipeline

from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.shards.index import committed_samples
from shardgen.tools.verify import read_shard_members, verify_run
from shardgen.run.tally import BrokenSetupError
from jobs.generate import run
from tests.conftest import compose_cfg, rank_environment, start_module, start_ranks, write_lines
from tests.test_generate import shard_images

PROMPTS = ["a cat", "a nan cat", "a dog", "a boom dog", "a bird", "a fish", "a nan fish", "a cow"]
ARGS = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=4", "samples_per_shard=3")


def faulty(monkeypatch, poison=("nan", "boom")):
    """Make FluxPipeline fail for some prompts: NaN images for 'nan', an exception for 'boom'."""
    real = FluxPipeline.__call__

    @functools.wraps(real)
    def call(self, *args, **kwargs):
        prompts = kwargs["prompt"]
        if "boom" in poison and any("boom" in p for p in prompts):
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        out = real(self, *args, **kwargs)
        for i, p in enumerate(prompts):
            if "nan" in poison and "nan" in p:
                out.images[i] = float("nan")
        return out

    monkeypatch.setattr(FluxPipeline, "__call__", call)


def test_failures_are_recorded_and_retry_failed_regenerates_exactly_them(tmp_path, monkeypatch):
    f = write_lines(tmp_path / "p.txt", PROMPTS)
    clean = run(compose_cfg(f"run_dir={tmp_path / 'clean'}", f"prompts.path={f}", *ARGS))
    assert clean.ok == 8
    with monkeypatch.context() as m:
        faulty(m)
        r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *ARGS))
    assert (r.ok, r.failed, r.complete) == (5, 3, True)
    members = {}
    run_dir = RunDir(tmp_path / "run")
    for shard in range(load_plan(run_dir).num_shards):  # failures live in the index, images in the tar
        members.update(committed_samples(run_dir, shard, read_shard_members(run_dir.shard_file(shard)))[0])
    nan = json.loads(members["0000000001"]["json"])
    boom = json.loads(members["0000000003"]["json"])
    assert nan["status"] == "failed" and nan["error"].startswith("nonfinite")
    assert boom["status"] == "failed" and "illegal memory access" in boom["error"]
    assert "png" not in members["0000000001"] and "png" in members["0000000002"]
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok
    good_before = {k: v for k, v in shard_images(tmp_path / "run").items() if v is not None}

    again = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *ARGS, "retry_failed=true"))
    assert (again.ok, again.failed, again.generated_here) == (8, 0, 3)
    after = shard_images(tmp_path / "run")
    assert after == shard_images(tmp_path / "clean")  # regenerated = what a clean run makes
    assert all(after[k] == v for k, v in good_before.items())
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_everything_failing_stops_the_run(tmp_path, monkeypatch):
    f = write_lines(tmp_path / "p.txt", [f"a boom {i}" for i in range(40)])
    faulty(monkeypatch)
    with pytest.raises(BrokenSetupError, match="every sample of the last 3 batches failed"):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *ARGS))


def _tp_rank(rank: int, cfg_yaml: str, port: int, fail_on_rank1: bool) -> None:
    """Rank ``rank`` of a 2-rank tp job; with ``fail_on_rank1``, rank 1 alone fails on a batch with a 'boom' prompt."""

    from omegaconf import OmegaConf

    from shardgen.run.runner import run_rank
    from shardgen.run.stopping import stop_on_sigterm

    # as a launcher=local rank does: when rank 1 fails, the parent ends rank 0 with SIGTERM, and rank 0 still makes
    # its handed-over batch (shard 0) durable before it exits
    stop_on_sigterm()
    rank_environment(rank, port)
    if rank == 1 and fail_on_rank1:
        faulty(pytest.MonkeyPatch(), poison=("boom",))
    run_rank(OmegaConf.create(cfg_yaml))


@pytest.mark.slow
def test_a_batch_failing_on_one_tp_rank_ends_the_job_and_a_rerun_finishes(tmp_path):
    """The ranks of a tp replica compute each batch together: a batch failing on one of them must not be
    retried there alone (its peer waits in a collective it left). The job stops with an error that says
    what to do, what was durable stays, and the same command, rerun, completes the run."""
    import time

    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    prompts = ["a cat", "a dog", "a bird", "a fish", "a cow", "a boom dog", "a horse", "a frog"]
    f = write_lines(tmp_path / "p.txt", prompts)
    args = (f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "height=16", "width=16", "steps=1",
            "progress=false", "batch_size=4", "samples_per_shard=4", "strategy=tp", "tp_degree=2")
    cfg_yaml = OmegaConf.to_yaml(compose_cfg(*args))
    t0 = time.time()
    with pytest.raises(mp.ProcessRaisedException) as err:
        start_ranks(_tp_rank, (cfg_yaml, free_port(), True), nprocs=2)
    message = str(err.value)
    assert "failed on this rank of a 2-rank model-parallel replica" in message
    assert "illegal memory access" in message and "Re-run the same command" in message
    assert time.time() - t0 < 120, "the job hung instead of stopping"
    plan = load_plan(RunDir(tmp_path / "run"))
    assert len(plan.run.done_shards()) == 1  # the first batch (shard 0) stayed durable

    start_ranks(_tp_rank, (cfg_yaml, free_port(), False), nprocs=2)
    rep = verify_run(load_plan(RunDir(tmp_path / "run")))
    assert rep.ok and rep.samples == 8, rep.defects
    assert all(v is not None for v in shard_images(tmp_path / "run").values())  # nothing recorded as failed


def test_the_watchdog_times_work_in_progress_only():
    """Idle time (waiting for other replicas' shards) is no stall; a busy section past the timeout is."""
    import time

    from shardgen.run.watchdog import STALL_EXIT_CODE, StallWatchdog

    exits = []
    w = StallWatchdog(0.4, exit_fn=exits.append)
    time.sleep(1.0)
    with w.busy("a quick batch"):
        time.sleep(0.2)
    assert exits == []
    with w.busy("a stuck batch"):
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
    assert exits == [STALL_EXIT_CODE]
    w.close()


@pytest.mark.slow
def test_a_hung_batch_ends_the_job_and_a_rerun_finishes(tmp_path):
    """A batch that never returns (a hung GPU) must not hold the job until its time limit: after
    stall_timeout_s the rank says where it hung and exits; what was durable stays, and a rerun completes."""
    import time

    from shardgen.dataio.resume.ledger import read_ledger
    from shardgen.run.watchdog import STALL_EXIT_CODE

    prompts = ["a cat", "a dog", "a bird", "a fish", "a cow", "a hang glider", "a horse", "a frog"]
    f = write_lines(tmp_path / "p.txt", prompts)
    args = [f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "height=16", "width=16", "steps=1", "progress=false",
            "batch_size=4", "samples_per_shard=4"]
    t0 = time.time()
    # 10 s: far above a real 16x16 batch even on a loaded 2-core machine (3 s was seen to trip on the first batch)
    p = start_module("tests.hanging_job", [*args, "stall_timeout_s=10"], tmp_path / "hanging.log")
    assert p.wait(timeout=120) == STALL_EXIT_CODE, p.output[-3000:]
    assert time.time() - t0 < 90
    assert "stalled: shard 000001, batch from row 0 made no progress for" in p.output
    assert "re-run the same command to continue" in p.output
    assert "in _call" in p.output  # the stack dump shows where it hung
    assert read_ledger(load_plan(RunDir(tmp_path / "run"))).done_samples == 4  # shard 0 stayed durable
    r = run(compose_cfg(*args))  # the GPU is fine again
    assert (r.ok, r.complete) == (8, True)
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_the_job_s_time_running_out_hands_its_unfinished_shard_to_the_requeue_at_once(tmp_path, monkeypatch, caplog):
    """submitit's signal that the SLURM job's time is over (UncompletedJobError, raised into the loop by its
    handler) ends the launch; the requeued launch takes the unfinished shard over at once (its claim given up), not
    after the claim's lease, and the run ends with the bytes of one that was never stopped."""
    from submitit.core.utils import UncompletedJobError

    prompts = [f"a small thing number {i}" for i in range(8)]
    f = write_lines(tmp_path / "p.txt", prompts)
    args = ("height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=3", "batch_size=3")
    assert run(compose_cfg(f"run_dir={tmp_path / 'clean'}", f"prompts.path={f}", *args)).ok == 8
    real, calls = FluxPipeline.__call__, []

    @functools.wraps(real)
    def time_over_at_the_second_batch(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise UncompletedJobError("the job's time is over")
        return real(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(FluxPipeline, "__call__", time_over_at_the_second_batch)
        with pytest.raises(UncompletedJobError):
            run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *args))
    assert "released 1 unfinished shard(s) (000001)" in caplog.text
    caplog.clear()
    again = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *args))
    assert (again.ok, again.failed, again.complete) == (8, 0, True)
    assert "taking over shard" not in caplog.text
    assert shard_images(tmp_path / "run") == shard_images(tmp_path / "clean")


def test_a_rank_whose_launcher_is_gone_counts_as_stopping(monkeypatch):
    """``stopping``: a rank whose launching process has ended is being stopped, so an error a peer's exit raises in
    it (a collective's "connection reset") gives up its claims like the stop itself; while the launcher lives it is
    a failure like any other."""
    import os
    import subprocess
    import sys

    from shardgen.run import stopping

    monkeypatch.setattr(stopping, "_LAUNCHER", [])
    monkeypatch.setattr(stopping, "sigterm_received", lambda: False)
    assert not stopping.stopping()
    stopping.note_launcher(os.getpid())
    assert not stopping.stopping()
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stopping.note_launcher(ended.pid)
    assert stopping.stopping()
    from shardgen.dataio.rundir.liveness import process_identity

    if identity := process_identity(os.getpid()):  # the launcher's pid given to another process since: gone too
        boot, namespace, start = identity.split(":")
        stopping.note_launcher(os.getpid(), f"{boot}:{namespace}:{int(start) - 1}")
        assert stopping.stopping()
        stopping.note_launcher(os.getpid(), identity)
        assert not stopping.stopping()


def _refusing_leader_rank(rank: int, cfg_yaml: str, port: int, out: str, step: str) -> None:
    """Rank ``rank`` of a 2-rank tp job whose leader (rank 0) refuses at ``step`` (a function of
    shardgen/run/runner.py only the leader runs); writes what the rank raised."""
    from omegaconf import OmegaConf

    from shardgen.dataio.rundir.storage import RunDirError
    from shardgen.run import runner

    rank_environment(rank, port)

    def refuse(*args, **kwargs):
        raise RunDirError(f"{step}: refused on the leader")

    if rank == 0:
        pytest.MonkeyPatch().setattr(runner, step, refuse)
    try:
        runner.run_rank(OmegaConf.create(cfg_yaml))
        said = {"raised": None}
    except Exception as e:  # noqa: BLE001 - what the rank stops with is the finding
        from parallel.world import echo_of_rank0

        said = {"raised": type(e).__name__, "message": str(e), "echo": echo_of_rank0(e)}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(said, f)


@pytest.mark.parametrize("step", ["start_generating", "_leader_parts", "_write_calibration"])
def test_a_replica_leader_s_refusal_stops_its_other_ranks_with_its_message(tmp_path, step):
    """A tp replica's leader alone marks the run as generating, opens the writer and the claims, and writes the
    calibration record; when one of these refuses, its peer stops with the same error (printed once: the leader says
    it) instead of a gloo traceback from the first batch's collective."""
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    f = write_lines(tmp_path / "p.txt", ["a cat", "a dog"])
    cfg_yaml = OmegaConf.to_yaml(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "height=16",
                                             "width=16", "steps=1", "progress=false", "strategy=tp", "tp_degree=2",
                                             "fp8=true", "calibrate_samples=1"))
    start_ranks(_refusing_leader_rank, (cfg_yaml, free_port(), str(tmp_path), step), nprocs=2)
    leader, peer = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert leader == {"raised": "RunDirError", "message": f"{step}: refused on the leader", "echo": False}
    assert peer == dict(leader, echo=True)
    assert not list((tmp_path / "run" / "shards").glob("*.tar"))
