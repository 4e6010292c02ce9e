"""Several nodes for real: ``launcher=slurm launcher.nodes=2`` and two-node ``torchrun`` on the local cluster of
``scripts/slurm_cluster.sh start --nodes 2`` (each node a slurmd in its own network and UTS namespaces, so each has
its own host name and address). Ranks on two nodes give the bytes of one process; a rank lost or failing on the
second node ends or requeues the whole job; runs resume across node counts; arrays and preemption span nodes."""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_generate import shard_images
from tests.test_slurm import (COMMON, N, _done, _nodes, _restarts, _state, _task_pids, _two_nodes_reason, _wait,
                              assert_complete_and_identical, prompt_slurm_polls, reference,  # noqa: F401 (fixtures)
                              slurm)

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ["bash", str(ROOT / "scripts" / "slurm_cluster.sh")]


def _namespaces_reason() -> str | None:
    if os.geteuid() != 0:
        return "entering the nodes' namespaces needs root"
    missing = [n for n in ("node1", "node2") if not Path(f"/run/netns/shardgen-{n}").exists()]
    if missing:
        return (f"no network namespace for {', '.join(missing)}: bash scripts/slurm_cluster.sh start --nodes 2 "
                "(needs iproute2 and root)")
    return None


needs_two_nodes = pytest.mark.skipif(_two_nodes_reason() is not None, reason=str(_two_nodes_reason()))
pytestmark = pytest.mark.slurm
FOUR_RANKS = ("launcher.nodes=2", "launcher.tasks_per_node=2", "launcher.time_min=60")
PLACEMENT = re.compile(r"job (\d+) restart (\d+): rank (\d+) of \d+ on (\S+), replica (\d+) = ranks")


def placements(run_dir: Path, restart: int = 0) -> dict[str, dict[int, tuple[str, int]]]:
    """Per submitit job id (``12`` or ``12_0`` in an array), rank -> (node, replica) as the job's ranks logged it
    on the given attempt."""
    found: dict[str, dict[int, tuple[str, int]]] = {}
    for log in (run_dir / "logs" / "slurm").rglob("*_log.err"):
        for _, again, rank, node, replica in PLACEMENT.findall(log.read_text(errors="replace")):
            if int(again) == restart:
                found.setdefault(log.parent.name, {})[int(rank)] = (node, int(replica))
    return found


def handed_over_by_job(run_dir: Path) -> dict[str, int]:
    """Samples each job handed to its writers (DEBUG lines of its log)."""
    return {d.name: sum(int(n) for f in d.glob("*_log.err")
                        for n in re.findall(r"handed over (\d+) samples", f.read_text(errors="replace")))
            for d in (run_dir / "logs" / "slurm").iterdir() if d.is_dir()}


@pytest.fixture(autouse=True)
def _jobs_log_info(caplog):
    """The jobs log at the submitting process's level for shardgen: INFO, so that their ranks say where they run."""
    caplog.set_level(logging.INFO, logger="shardgen")


def with_fault(monkeypatch, fault: str, bad_attempts: int = 99, node: str | None = None) -> None:
    """Submit tests.hanging_job.HangingJob (a fault on some batches) instead of the plain job."""
    import shardgen.launch.slurm
    from tests.hanging_job import HangingJob

    monkeypatch.setattr(shardgen.launch.slurm, "GenerateJob",
                        functools.partial(HangingJob, bad_attempts=bad_attempts, fault=fault, node=node))


# --- SLURM ------------------------------------------------------------------------------------

@needs_two_nodes
def test_dp_ranks_on_two_nodes_give_one_process_bytes(tmp_path, reference):
    """4 ranks on 2 nodes, dp: 4 replicas, ranks 0-1 on the first node. (tp_degree=2 on two nodes, one replica per
    node, is test_rank_raising_on_the_second_node_requeues_the_two_node_job's job: its requeued attempt runs both
    replicas and ends with the one-process bytes.)"""
    node1, node2 = _nodes()[:2]
    dp = slurm(tmp_path / "dp", *FOUR_RANKS)[0]
    dp.results()
    assert_complete_and_identical(tmp_path / "dp", reference)
    assert placements(tmp_path / "dp")[str(dp.job_id)] == {r: (node1 if r < 2 else node2, r) for r in range(4)}


@needs_two_nodes
def test_rank_killed_on_the_second_node_ends_the_job_and_one_node_resumes(tmp_path, reference, monkeypatch):
    """SIGKILL the rank on the second node: srun --kill-on-bad-exit ends the rank on the first at once; the
    run, resumed with launcher.nodes=1, finishes with the one-process bytes. The resuming job takes over the
    dead ranks' shards at once, the one on the other node included (SLURM says its job ended), instead of
    waiting out their lease."""
    run_dir = tmp_path / "run"
    node2 = _nodes()[1]
    with_fault(monkeypatch, "slow")
    long_lease = "lease_s=600"
    job = slurm(run_dir, "launcher.nodes=2", "launcher.tasks_per_node=1", "launcher.time_min=60", long_lease)[0]
    _wait(lambda: _done(run_dir) >= 8, 180, "the first samples")
    pids = [p for p in _task_pids(job.job_id, procid=1)
            if f"SLURMD_NODENAME={node2}".encode() in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
    assert pids, f"rank 1's process was not found on {node2}"
    for pid in pids:
        os.kill(pid, 9)
    t0 = time.time()
    _wait(lambda: _state(job.job_id) not in ("RUNNING", "COMPLETING", "PENDING"), 60, "the job to end")
    assert _state(job.job_id) == "FAILED" and time.time() - t0 < 30
    assert _done(run_dir) < N, "rank 0 ran on and finished the run alone"
    monkeypatch.undo()
    rerun = slurm(run_dir, "launcher.nodes=1", "launcher.tasks_per_node=2", "launcher.time_min=60", long_lease)[0]
    _wait(lambda: _state(rerun.job_id) not in ("RUNNING", "COMPLETING", "PENDING"), 240,
          "the one-node job to take over the dead ranks' shards and finish (not wait out their 600 s lease)")
    assert _state(rerun.job_id) == "COMPLETED"
    assert_complete_and_identical(run_dir, reference)


@needs_two_nodes
def test_rank_raising_on_the_second_node_requeues_the_two_node_job(tmp_path, reference, monkeypatch, capsys):
    """tp_degree=2, one replica per node; the replica on the second node raises a CUDA error on its first attempt:
    the job requeues itself and finishes on both nodes with the one-process bytes (tp across two nodes: ranks 0-1 =
    replica 0 on the first node, ranks 2-3 = replica 1 on the second)."""
    run_dir = tmp_path / "run"
    node1, node2 = _nodes()[:2]
    with_fault(monkeypatch, "raise_any", bad_attempts=1, node=node2)
    job = slurm(run_dir, *FOUR_RANKS, "strategy=tp", "tp_degree=2", "launcher.max_failures=2",
                "launcher.wait=true")[0]
    marks = [m.read_text() for m in (run_dir / "logs" / "failures").iterdir()]
    assert len(marks) == 1 and re.match(r"rank [23]: .*RuntimeError: CUDA error", marks[0]), marks
    assert _restarts(job.job_id) == 1
    assert f"job {job.job_id}: done, run {N} ok" in capsys.readouterr().out
    assert_complete_and_identical(run_dir, reference)
    assert placements(run_dir, restart=1)[str(job.job_id)] == {r: (node1 if r < 2 else node2, r // 2) for r in range(4)}


@needs_two_nodes
def test_one_node_run_resumed_on_two_nodes_then_preempted(tmp_path, reference, monkeypatch, caplog):
    """A run begun by a one-node job (cancelled) is resumed by a two-node job; that job, preempted
    (scancel --signal=USR2), checkpoints, requeues itself, resumes and finishes with the one-process bytes,
    redoing at most one batch per replica."""
    run_dir = tmp_path / "run"
    caplog.set_level(logging.DEBUG, logger="shardgen")  # the jobs log each batch they hand over
    with_fault(monkeypatch, "slow")
    first = slurm(run_dir, "launcher.nodes=1", "launcher.tasks_per_node=1", "launcher.time_min=60")[0]
    _wait(lambda: _done(run_dir) >= 4, 180, "the first samples")
    subprocess.run(["scancel", str(first.job_id)], check=True)
    _wait(lambda: _state(first.job_id) not in ("RUNNING", "COMPLETING", "PENDING"), 60, "the one-node job to end")
    before = _done(run_dir)
    assert 0 < before < N
    job = slurm(run_dir, "launcher.nodes=2", "launcher.tasks_per_node=1", "launcher.time_min=60")[0]
    _wait(lambda: _done(run_dir) > before, 180, "the two-node job's first samples")
    assert _done(run_dir) < N, "the two-node job finished before it could be preempted"
    subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True)
    _wait(lambda: _restarts(job.job_id) > 0, 120, "the requeue")
    job.results()
    assert_complete_and_identical(run_dir, reference)
    assert {node for node, _ in placements(run_dir)[str(job.job_id)].values()} == set(_nodes()[:2])
    redone = handed_over_by_job(run_dir)[str(job.job_id)] - (N - before)
    assert 0 <= redone <= 2 * 4, f"{redone} samples were redone (more than one batch per replica)"


@needs_two_nodes
def test_array_of_one_node_jobs_cooperates_across_nodes(tmp_path, reference, monkeypatch, caplog):
    """launcher.array=2 of one-node jobs: one job per node, both making samples of the same run directory."""
    run_dir = tmp_path / "run"
    caplog.set_level(logging.DEBUG, logger="shardgen")  # the jobs log each batch they hand over
    with_fault(monkeypatch, "slow")  # the first job to start must not finish the run alone
    jobs = slurm(run_dir, "launcher.array=2", "launcher.time_min=60", "launcher.wait=true")
    assert_complete_and_identical(run_dir, reference)
    where = placements(run_dir)
    assert sorted(where[str(j.job_id)][0][0] for j in jobs) == _nodes()[:2], where
    made = handed_over_by_job(run_dir)
    assert all(made[str(j.job_id)] > 0 for j in jobs) and sum(made.values()) >= N, made


# --- torchrun ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(_namespaces_reason() is not None, reason=str(_namespaces_reason()))
def test_torchrun_on_two_nodes_gives_one_process_bytes(tmp_path, reference):
    """torchrun --nnodes 2, one command per node (its namespaces), rendezvous on the first node by name."""
    run_dir, port = tmp_path / "run", _free_port()
    overrides = [f"run_dir={run_dir}", *[c for c in COMMON if not c.startswith("launcher.")]]
    procs = [subprocess.Popen(
        [*CLUSTER, "exec", node, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         "1", "--node-rank", str(rank), "--rdzv-endpoint", f"node1:{port}", "-m", "jobs.generate", *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank, node in enumerate(("node1", "node2"))]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    assert shard_images(run_dir) == reference
