"""``launcher=slurm`` on a real SLURM cluster (scripts/slurm_cluster.sh start): jobs, arrays,
preemption and timeouts requeue and resume; misconfigured submissions never reach sbatch."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.resume.ledger import read_ledger
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import verify_run
from shardgen.launch.slurm import SlurmConfigError, validate_slurm
from jobs.generate import run
from tests.conftest import compose_cfg, write_lines
from tests.test_generate import shard_images


def _cluster_reason() -> str | None:
    if not shutil.which("sbatch"):
        return "no SLURM client (sbatch) on this machine: bash scripts/slurm_cluster.sh start"
    if not os.environ.get("SLURM_CONF") and not Path("/etc/slurm/slurm.conf").exists():
        return "SLURM_CONF is not set: eval \"$(bash scripts/slurm_cluster.sh env)\""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if out.returncode != 0 or not out.stdout.strip():
        return f"no SLURM controller answers: {out.stderr.strip()[:200]}"
    return None


needs_cluster = pytest.mark.skipif(_cluster_reason() is not None, reason=str(_cluster_reason()))


def _nodes() -> list[str]:
    """The cluster's nodes that can run jobs, by name."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10).stdout
    return sorted(n for n, st in (line.split() for line in out.splitlines())
                  if not st.startswith(("down", "drain", "fail")))


def _two_nodes_reason() -> str | None:
    why = _cluster_reason()
    if why:
        return why
    nodes = _nodes()
    if len(nodes) < 2:
        return (f"the SLURM cluster has {len(nodes)} usable node(s) ({' '.join(nodes)}): bash scripts/slurm_cluster.sh "
                "start --nodes 2 (needs network namespaces: iproute2 and root)")
    return None


# the one-node versions of tests that tests/test_multinode.py runs across two nodes (a superset of what they check)
one_node_only = pytest.mark.skipif(_two_nodes_reason() is None,
                                   reason="the cluster has two nodes: tests/test_multinode.py runs this across them")
N = 48
COMMON = ("height=16", "width=16", "steps=2", "samples_per_shard=8", f"prompts.limit={N}", "batch_size=4",
          "progress=false", "launcher.cpus_per_task=1", "heartbeat_s=1", "lease_s=20")


_REFERENCE: dict[str, bytes] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The local one-process run's images, made once per session (tests/test_multinode.py imports this fixture: a
    module-scoped fixture of its own would run it again)."""
    if not _REFERENCE:
        d = tmp_path_factory.mktemp("ref") / "run"
        assert run(compose_cfg(f"run_dir={d}", *[c for c in COMMON if not c.startswith("launcher.")])).ok == N
        _REFERENCE.update(shard_images(d))
    return dict(_REFERENCE)


@pytest.fixture(autouse=True)
def prompt_slurm_polls(monkeypatch):
    """submitit asks sacct about a job that ended without a result (a failed or killed one) only every (job age / 2)
    seconds, up to 10 min, then waits 15 s for the result file it never wrote: a test idled up to a minute after each
    such job. Ask every 3 s and wait 3 s (a result file is written on a local disk before its job ends)."""
    import submitit.slurm.slurm

    monkeypatch.setattr(submitit.slurm.slurm.SlurmJob.watcher, "_delay_s", 3)
    monkeypatch.setattr(submitit.slurm.slurm.SlurmJob, "_results_timeout_s", 3)


def slurm(run_dir, *overrides):
    return run(compose_cfg("launcher=slurm", f"run_dir={run_dir}", *COMMON, *overrides))


def assert_complete_and_identical(run_dir: Path, reference) -> None:
    rep = verify_run(load_plan(RunDir(run_dir)))
    assert rep.ok, rep.defects
    assert shard_images(run_dir) == reference


def handed_over(run_dir: Path) -> int:
    """Samples handed to writers over every attempt, from the SLURM logs (DEBUG lines)."""
    text = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*.out"))
    text += "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*.err"))
    return sum(int(n) for n in re.findall(r"handed over (\d+) samples", text))


# --- validation: no cluster needed -----------------------------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    (("strategy=tp", "tp_degree=4", "launcher.nodes=1", "launcher.tasks_per_node=2"), "do not divide the world of 2"),
    (("launcher.gpus_per_node=2", "launcher.tasks_per_node=4"), "each rank needs its own GPU"),
    (({"partition": "gpu\n#SBATCH --wrap=evil"},), "newlines"),
    (({"additional_parameters": {"bad key": 1}},), "not a valid sbatch option"),
    (("launcher.nodes=0",), "launcher.nodes=0"),
    (("strategy=tp", "tp_degree=2", "launcher.nodes=2", "launcher.tasks_per_node=3"), "some would span two nodes"),
    (("prompts=txt", "prompts.path='https://bucket.example/p.txt?X-Amz-Credential=AKIA&X-Amz-Signature=abc123'"),
     r"https://bucket.example/p.txt\?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED carries a secret"),
])
def test_misconfigured_submission_fails_before_sbatch(tmp_path, overrides, needle, monkeypatch):
    import submitit

    monkeypatch.setattr(submitit.AutoExecutor, "__init__", lambda *a, **k: pytest.fail("reached submitit"))
    cfg = compose_cfg("launcher=slurm", f"run_dir={tmp_path / 'run'}", *[o for o in overrides if isinstance(o, str)])
    for o in overrides:  # values the command line grammar would not even accept, set as a program would
        if isinstance(o, dict):
            for k, v in o.items():
                cfg.launcher[k] = v
    with pytest.raises(SlurmConfigError, match=needle):
        run(cfg)
    assert not (tmp_path / "run").exists()


def test_launcher_parameters_reach_the_sbatch_script(tmp_path):
    """What launcher.* asks for is what sbatch receives: an extra sbatch option, the partition, the warning before
    the time limit, and srun ending the job when a rank dies. (Rendered by submitit, nothing submitted.)"""
    import shutil

    from shardgen.launch.slurm import make_executor

    if shutil.which("srun") is None:
        pytest.skip("submitit's SLURM executor needs srun on PATH")
    cfg = compose_cfg("launcher=slurm", f"run_dir={tmp_path / 'run'}", "launcher.partition=gpu",
                      "+launcher.additional_parameters.mail-type=END")
    validate_slurm(cfg)
    script = make_executor(cfg, tmp_path)._executor._make_submission_file_text("python -m x", "uid")
    for line in ("#SBATCH --mail-type=END", "#SBATCH --partition=gpu", "#SBATCH --signal=USR2@90",
                 "#SBATCH --time=240"):
        assert line in script.splitlines(), line
    assert "--kill-on-bad-exit=1 python -m x" in script


def test_a_job_installs_its_signal_handlers_before_importing_torch():
    """submitit installs the handler that checkpoints on SIGUSR2 only after it unpickled the job, which imports the
    job's module: that import must not take torch's seconds, or a preemption or time-limit signal early in a job (on a
    loaded node) kills it instead of requeueing it. The same for the tests' faulty job."""
    code = "import sys, shardgen.launch.slurm, tests.hanging_job; print(sorted({'torch', 'diffusers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("answer,rc,ended", [
    ("JobId=5 JobName=x JobState=RUNNING Reason=None Restarts=0", 0, False),  # the holder may be alive
    ("JobId=5 JobName=x JobState=RUNNING Reason=None Restarts=1", 0, True),  # requeued since: that attempt is over
    ("JobId=5 JobName=x JobState=PENDING Reason=BeginTime Restarts=1", 0, True),
    ("JobId=5 JobName=x JobState=FAILED Reason=NonZeroExitCode Restarts=0", 0, True),
    ("slurm_load_jobs error: Invalid job id specified", 1, True),  # forgotten after it ended
    ("slurm_load_jobs error: Unable to contact slurm controller", 1, False),  # no answer: assume alive
])
def test_a_claim_held_by_another_slurm_job_on_another_node_is_dead_when_slurm_says_so(tmp_path, monkeypatch,
                                                                                       answer, rc, ended):
    """Across nodes a holder's pid cannot be checked: a claim of another SLURM job is taken over at once when
    scontrol says that job's attempt is over (not after its lease), never when SLURM cannot say."""
    from shardgen.dataio.rundir.claims import holder_known_dead

    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho '{answer}' >&{2 if rc else 1}\nexit {rc}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr("shardgen.dataio.rundir.slurm_jobs._ended_cache", {})
    holder = dict(host="node2", pid=4242, job="5", restart=0)
    assert holder_known_dead(holder, dict(host="node1", pid=1, job="6", restart=0)) is ended
    assert holder_known_dead(holder, dict(host="node1", pid=1, job=None, restart=0)) is False  # not under SLURM


# --- on the cluster ------------------------------------------------------------------------

@pytest.mark.slurm
@needs_cluster
def test_a_submission_sbatch_refuses_is_a_message_naming_the_cause(tmp_path):
    """An unknown partition passes every check shardgen can make; sbatch refuses it: a user error quoting sbatch
    (no traceback), nothing submitted, the plan kept for the corrected command."""
    from shardgen.errors import is_user_error

    with pytest.raises(Exception) as e:
        slurm(tmp_path / "run", "launcher.partition=no_such_partition")
    assert is_user_error(e.value), repr(e.value)
    assert "sbatch refused the job" in str(e.value) and "invalid partition" in str(e.value).lower(), str(e.value)
    assert (tmp_path / "run" / "plan" / "plan.json").exists() and not list((tmp_path / "run").rglob("*.tar"))


@pytest.mark.slurm
@needs_cluster
@one_node_only  # on two nodes, test_multinode's dead-rank test ends with this very job (1 node x 2 tasks, compared)
def test_two_task_job_completes_like_the_local_run(tmp_path, reference):
    slurm(tmp_path / "run", "launcher.tasks_per_node=2", "launcher.wait=true", "launcher.time_min=60")
    assert_complete_and_identical(tmp_path / "run", reference)


@pytest.mark.slurm
@needs_cluster
@one_node_only
def test_two_job_array_completes_like_the_local_run(tmp_path, reference):
    jobs = slurm(tmp_path / "run", "launcher.array=2", "launcher.wait=true", "launcher.time_min=60")
    assert len(jobs) == 2
    assert_complete_and_identical(tmp_path / "run", reference)


def _wait(cond, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def _done(run_dir: Path) -> int:
    plan = load_plan(RunDir(run_dir))
    return 0 if plan is None else read_ledger(plan).done_samples


@pytest.mark.slurm
@needs_cluster
@one_node_only
def test_preemption_signal_requeues_and_resumes(tmp_path, reference):
    """scancel --signal=USR2 mid-run (what a preempting cluster sends): the job checkpoints, requeues
    itself, resumes from the run directory and finishes; at most one batch per replica is redone."""
    run_dir = tmp_path / "run"
    logging.getLogger("shardgen").setLevel(logging.DEBUG)  # the jobs log each batch they hand over
    # steps=2 at 16 px is fast: slow each batch down with a bigger image so the signal lands mid-run
    jobs = slurm(run_dir, "launcher.time_min=60", "height=256", "width=256")
    job = jobs[0]
    _wait(lambda: _done(run_dir) >= 8, 180, "the first samples")
    subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True)
    _wait(lambda: _restarts(job.job_id) > 0, 120, "the requeue")
    job.results()  # waits for the requeued job
    rep = verify_run(load_plan(RunDir(run_dir)))
    assert rep.ok, rep.defects
    assert _restarts(job.job_id) >= 1
    redone = handed_over(run_dir) - N
    assert 0 <= redone <= 4, f"{redone} samples were redone (more than one batch)"


def _restarts(job_id) -> int:
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    m = re.search(r"Restarts=(\d+)", out)
    return int(m.group(1)) if m else 0


def slow_first_attempt(monkeypatch, slow_s: float) -> None:
    """Submit tests.hanging_job.HangingJob with every batch ``slow_s`` seconds longer on the job's first attempt; the
    copy a timeout or preemption requeues (GenerateJob.checkpoint) is the plain job, at full speed."""
    import functools

    import shardgen.launch.slurm
    from tests.hanging_job import HangingJob

    monkeypatch.setattr(shardgen.launch.slurm, "GenerateJob",
                        functools.partial(HangingJob, fault="slow", bad_attempts=1, slow_s=slow_s))


def attempt_log(run_dir: Path, job_id) -> str:
    """The first task's log of a one-task job, over all its attempts."""
    return (run_dir / "logs" / "slurm" / str(job_id) / f"{job_id}_0_log.err").read_text(errors="replace")


@pytest.mark.slurm
@needs_cluster
def test_timeout_requeues_until_the_run_is_done(tmp_path, reference, monkeypatch, caplog):
    """A job whose time limit (1 min, the shortest SLURM has) is shorter than the run: SLURM's own warning signal
    before the limit makes it checkpoint and requeue (submitit counts it against launcher.max_num_timeout) until the
    run is complete, with the one-process bytes and at most one batch redone per timeout.

    Not load-sensitive by construction: the first attempt cannot finish (12 batches of 6 s of sleep, more than its
    time limit whatever the machine's speed), so a timeout is certain; the requeued attempts run at full speed (16 px)
    and SLURM, checking on a 30 s tick, sends the warning at the first tick within signal_delay_s + 30 = 35 s of the
    limit: 25-55 s into an attempt (~45 s into a requeued one, which starts ~7-15 s after the tick that requeued it),
    far more than the rest of the run needs even on a loaded machine; 12 timeouts are allowed. (The old version, 2 min
    and signal_delay_s=75, gave requeued attempts ~17 s: at load ~9 some made no progress and the limit ran out.)"""
    run_dir = tmp_path / "run"
    caplog.set_level(logging.DEBUG, logger="shardgen")  # the jobs log each batch they hand over
    slow_first_attempt(monkeypatch, slow_s=6)
    job = slurm(run_dir, "launcher.time_min=1", "launcher.signal_delay_s=5", "launcher.max_num_timeout=12")[0]
    job.results()
    assert_complete_and_identical(run_dir, reference)
    timeouts = _restarts(job.job_id)
    assert timeouts >= 1, "the run finished inside one time limit: the test proves nothing"
    log = attempt_log(run_dir, job.job_id)
    # each time limit's signal was taken for a timeout (not a preemption) and checkpointed the job before it requeued
    assert set(re.findall(r"this job is (timed-out|preempted)", log)) == {"timed-out"}, log[-3000:]
    assert log.count("progress is in the run directory; requeueing") == timeouts, log[-3000:]
    redone = handed_over(run_dir) - N
    assert 0 <= redone <= 4 * timeouts, f"{redone} samples were redone (more than one batch per timeout)"


def test_ctrl_c_while_waiting_stops_the_waiting_and_says_the_jobs_run_on(tmp_path, caplog):
    from types import SimpleNamespace

    from shardgen.launch.slurm import wait_for

    class Waited:
        job_id = "4242_0"

        def results(self):
            raise KeyboardInterrupt

    plan = SimpleNamespace(run=RunDir(tmp_path / "run"))
    with pytest.raises(SystemExit) as stop:
        wait_for([Waited()], plan)
    assert stop.value.code == 130
    said = caplog.text
    assert "SLURM job(s) 4242_0 keep running" in said and "scancel 4242_0" in said and "jobs.status" in said


@pytest.mark.slurm
@needs_cluster
def test_used_up_timeout_limit_is_reported_and_the_run_resumable(tmp_path, monkeypatch, capsys):
    """launcher.max_num_timeout=0: the first timeout ends the job; the report says the limit is used up and how to
    continue; the samples made are kept (and are not failures: nothing is marked for a failure requeue).

    The timeout's signal is sent once the first samples are durable (the USR2 SLURM sends before a time limit;
    submitit takes any signal to a job of time_min <= 10 for a timeout), so progress before it is certain on a loaded
    machine; the real time limit's path is test_timeout_requeues_until_the_run_is_done's."""
    from shardgen.launch.slurm import wait_for

    run_dir = tmp_path / "run"
    slow_first_attempt(monkeypatch, slow_s=2)  # 24 s for the run: it cannot finish between a poll and the signal
    job = slurm(run_dir, "launcher.time_min=10", "launcher.max_num_timeout=0")[0]
    _wait(lambda: _done(run_dir) >= 4, 180, "the first samples")
    subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True)
    wait_for([job], load_plan(RunDir(run_dir)))  # what launcher.wait=true does after submitting
    out = capsys.readouterr().out
    assert "timeout limit used up" in out and "re-run the same command to continue" in out
    assert 0 < _done(run_dir) < N
    assert not (run_dir / "logs" / "failures").exists()  # a used-up timeout limit is not a failure to requeue
    # the samples the timed-out job made are real, not failures recorded while it was stopped
    assert read_ledger(load_plan(RunDir(run_dir))).totals()["failed"] == 0


def _task_pids(job_id, procid: int) -> list[int]:
    """PIDs of the processes of one task (rank) of a job on this node, from their environments."""
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={procid}".encode()}
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if want <= set(env.read_bytes().split(b"\0")) and b"python" in (env.parent / "cmdline").read_bytes():
                pids.append(int(env.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _state(job_id) -> str:
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    m = re.search(r"JobState=(\w+)", out)
    return m.group(1) if m else "GONE"


@pytest.mark.slurm
@needs_cluster
@one_node_only
def test_a_dead_rank_ends_the_job_at_once_and_a_rerun_finishes(tmp_path):
    """SIGKILL one of two ranks mid-run (the OOM killer, a lost GPU): with srun --kill-on-bad-exit the job ends
    at once instead of leaving its other rank to run on into a collective; the same command, rerun, completes."""
    run_dir = tmp_path / "run"
    overrides = ("launcher.tasks_per_node=2", "launcher.time_min=60", "height=256", "width=256")
    job = slurm(run_dir, *overrides)[0]
    _wait(lambda: _done(run_dir) >= 8, 180, "the first samples")
    pids = _task_pids(job.job_id, procid=1)
    assert pids, "rank 1's process was not found on this node"
    for pid in pids:
        os.kill(pid, 9)
    _wait(lambda: _state(job.job_id) not in ("RUNNING", "COMPLETING", "PENDING"), 60, "the job to end")
    assert _state(job.job_id) == "FAILED"
    assert _done(run_dir) < N, "rank 0 ran on and finished the run alone"
    slurm(run_dir, *overrides, "launcher.wait=true")
    rep = verify_run(load_plan(RunDir(run_dir)))
    assert rep.ok and rep.samples == N, rep.defects


@pytest.mark.slurm
@needs_cluster
# a requeued job that recovers: here after an error on one node; on two nodes tests/test_multinode.py raises on the
# second node (the stall's own path, watchdog -> failure mark -> requeue, is the stall-gives-up case's)
@pytest.mark.parametrize("fault,bad_attempts,max_failures", [("hang", 9, 1),
                                                                   pytest.param("raise", 1, 2, marks=one_node_only)],
                         ids=["stall-gives-up", "error-recovers"])
def test_a_failed_or_stalled_rank_requeues_its_job_up_to_max_failures(tmp_path, monkeypatch, capsys, fault,
                                                                      bad_attempts, max_failures):
    """A batch that hangs (a GPU after an Xid error) trips stall_timeout_s, or raises a CUDA error in a tp
    replica; the job requeues itself and the requeued attempt resumes and finishes. A job that stalls every time stops after
    launcher.max_failures requeues and says so, its progress kept."""
    import functools

    import shardgen.launch.slurm
    from tests.hanging_job import HangingJob

    monkeypatch.setattr(shardgen.launch.slurm, "GenerateJob", functools.partial(HangingJob, bad_attempts=bad_attempts,
                                                                      fault=fault))
    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i}" if i != 20 else "a hang glider" for i in range(N)])
    run_dir = tmp_path / "run"
    # an error is retried sample by sample under dp; in a tp replica it ends the job (it cannot be retried alone)
    tp = ("strategy=tp", "tp_degree=2", "launcher.tasks_per_node=2") if fault == "raise" else ()
    # 15 s: a real batch here takes ~0.1 s, but the first of an attempt took over 5 s (a false stall) at load ~40
    jobs = slurm(run_dir, f"prompts.path={prompts}", "stall_timeout_s=15", f"launcher.max_failures={max_failures}",
                 "launcher.time_min=60", "launcher.wait=true", *tp)
    marks = sorted((run_dir / "logs" / "failures").iterdir())
    why = "stalled in shard 000002" if fault == "hang" else "RuntimeError: CUDA error: unspecified launch failure"
    assert all(why in m.read_text() for m in marks), [m.read_text() for m in marks]
    out = capsys.readouterr().out
    if bad_attempts == 1:
        assert _restarts(jobs[0].job_id) == 1 and len(marks) == 1
        rep = verify_run(load_plan(RunDir(run_dir)))
        assert rep.ok and rep.samples == N, rep.defects
        assert read_ledger(load_plan(RunDir(run_dir))).totals()["failed"] == 0
        assert f"job {jobs[0].job_id}: done, run {N} ok" in out
    else:
        assert _restarts(jobs[0].job_id) == max_failures and len(marks) == max_failures + 1
        assert 20 <= _done(run_dir) < N  # the rows before the stall were durable
        assert f"job {jobs[0].job_id}: failed 2 time(s), launcher.max_failures used up; last: rank 0: stalled in " \
               "shard 000002" in out and "re-run the same command" in out
