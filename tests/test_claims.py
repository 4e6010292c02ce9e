"""Shard claims, alone: O_EXCL generations, the lease, a dead holder, a take-over seen by the loser; the tests marked
``BOTH`` run against claims in a bucket too (tests/test_bucket_claims.py has the rest of those)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardgen.dataio.rundir.claims import Claimer, holder_known_dead, owner_record, scan_claims
from shardgen.dataio.rundir.layout import RunDir


@pytest.fixture
def run(tmp_path) -> RunDir:
    r = RunDir(tmp_path / "run")
    r.create()
    return r


@pytest.fixture
def claim_store(request, run):
    """A maker of handles on where the test's claims live: None (the run directory's claims/, Claimer's default)
    unless the test is parametrized with "bucket" (``BOTH``): a prefix of a fresh bucket of the test S3 server. Each
    claimer gets a handle of its own, as each replica has."""
    if getattr(request, "param", "dir") == "dir":
        return lambda: None
    from shardgen.dataio.rundir.claimstore import BucketClaims

    url = f"s3://{request.getfixturevalue('bucket')}/run"
    return lambda: BucketClaims(url)


BOTH = pytest.mark.parametrize("claim_store", ["dir", "bucket"], indirect=True)


@pytest.fixture
def claimers(run, claim_store):
    made = []

    def make(replica: int, **kw) -> Claimer:
        kw.setdefault("store", claim_store())
        c = Claimer(run, dict(owner_record(replica), **kw.pop("owner", {})), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_holder_known_dead(monkeypatch):
    import shardgen.dataio.rundir.slurm_jobs as slurm_jobs

    ended: dict[str, bool] = {"8": False, "9": True}  # what scontrol would say of other SLURM jobs
    monkeypatch.setattr(slurm_jobs, "slurm_attempt_ended", lambda job, restart: ended[job])
    me = dict(host="a", pid=1, job="7", restart=1)
    assert not holder_known_dead(None, me)
    assert not holder_known_dead({}, me)  # a claim being written: alive by its mtime
    assert holder_known_dead(dict(host="a", pid=dead_pid(), job=None, restart=0), me)
    assert not holder_known_dead(dict(host="a", pid=os.getpid(), job=None, restart=0), me)
    assert not holder_known_dead(dict(host="b", pid=dead_pid(), job=None, restart=0), me)  # another host: unknown
    assert holder_known_dead(dict(host="b", pid=5, job="7", restart=0), me)  # our job, an earlier attempt
    assert not holder_known_dead(dict(host="b", pid=5, job="8", restart=0), me)  # another job, still running
    assert holder_known_dead(dict(host="b", pid=5, job="9", restart=0), me)  # another job SLURM says has ended


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc to tell a zombie from a process")
def test_a_holder_that_ended_but_is_not_yet_reaped_is_known_dead():
    """A claimant (or a launcher) whose process has exited while its parent has not reaped it yet is a zombie: it
    still answers kill(pid, 0), but it holds nothing any more."""
    from shardgen.dataio.rundir.liveness import pid_alive

    p = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited for: a zombie once it exits
    try:
        deadline = time.monotonic() + 30
        while pid_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(p.pid)
        assert holder_known_dead(dict(host=owner_record(0)["host"], pid=p.pid, job=None, restart=0),
                                 dict(host=owner_record(0)["host"], pid=os.getpid(), job=None, restart=0))
        os.kill(p.pid, 0)  # the zombie still answers the signal test
    finally:
        p.wait()
    assert pid_alive(os.getpid())


@BOTH
def test_one_claim_per_generation_and_the_lease_holds_it(run, claimers, claim_store):
    a, b = claimers(0, lease_s=30, heartbeat_s=10), claimers(1, lease_s=30, heartbeat_s=10)
    assert a.try_claim(0, None) == 1
    assert b.try_claim(0, None) is None  # generation 1 exists: O_EXCL
    assert b.try_claim(0, scan_claims(run, claim_store()).get(0)) is None  # a live, fresh holder
    assert a.still_mine(0)


@BOTH
def test_an_expired_claim_is_taken_over_and_the_loser_notices(run, claimers, claim_store):
    a, b = claimers(0, lease_s=0.5, heartbeat_s=60), claimers(1, lease_s=0.5, heartbeat_s=60)
    assert a.try_claim(3, None) == 1
    time.sleep(0.6)
    assert b.try_claim(3, scan_claims(run, claim_store()).get(3)) == 2
    assert not a.still_mine(3) and b.still_mine(3)
    b.release(3)
    assert scan_claims(run, claim_store()) == {}  # older generations go too


@BOTH
def test_a_dead_holder_is_taken_over_at_once(run, claimers):
    ghost = claimers(0, lease_s=3600, heartbeat_s=60, owner=dict(pid=dead_pid()))
    assert ghost.try_claim(1, None) == 1
    assert claimers(1, lease_s=3600, heartbeat_s=60).try_claim(1, 1) == 2


PROC = pytest.mark.skipif(not os.path.exists("/proc/self/stat") or not os.path.exists("/proc/self/ns/pid"),
                          reason="needs /proc to tell one process from another given the same pid")


def earlier(identity: str) -> str:
    """The identity of a process that had the same pid in the same boot and pid namespace, but started earlier."""
    boot, namespace, start = identity.split(":")
    return f"{boot}:{namespace}:{int(start) - 1}"


@PROC
@BOTH
def test_a_claim_of_an_earlier_process_that_had_this_very_pid_is_taken_over_at_once(run, claimers):
    """A job run again in a fresh container numbers its processes from 1 again: its process may have the pid the
    killed one had, on a host of the same name. That claim is not this process's, and its holder is gone."""
    me = owner_record(0)
    ghost = claimers(0, lease_s=3600, heartbeat_s=60, owner=dict(proc=earlier(me["proc"])))
    assert ghost.try_claim(1, None) == 1
    assert claimers(1, lease_s=3600, heartbeat_s=60).try_claim(1, 1) == 2


@PROC
def test_a_pid_another_process_has_now_is_not_the_holder_s():
    from shardgen.dataio.rundir.liveness import pid_alive, process_identity

    p = subprocess.Popen(["sleep", "60"])
    try:
        now = process_identity(p.pid)
        me = owner_record(0)
        holder = dict(host=me["host"], pid=p.pid, job=None, restart=0)
        assert pid_alive(p.pid, now) and not holder_known_dead(dict(holder, proc=now), me)
        assert not pid_alive(p.pid, earlier(now))  # the pid was reused since the claim was written
        assert holder_known_dead(dict(holder, proc=earlier(now)), me)
        other_boot = "0" * 32 + now[now.index(":"):]
        assert holder_known_dead(dict(holder, proc=other_boot), me)  # recorded before this host rebooted
        boot, namespace, start = now.split(":")
        # a container sharing the host's name but not its pid numbers: the pid says nothing here, the lease decides
        assert not holder_known_dead(dict(holder, pid=dead_pid(), proc=f"{boot}:{int(namespace) + 1}:{start}"), me)
    finally:
        p.kill()
        p.wait()


def test_the_heartbeat_keeps_a_claim_alive(run, claimers):
    a = claimers(0, lease_s=1.0, heartbeat_s=0.2)
    assert a.try_claim(0, None) == 1
    time.sleep(1.5)
    assert claimers(1, lease_s=1.0, heartbeat_s=60).try_claim(0, 1) is None


def test_a_claimer_without_its_own_thread_is_kept_alive_by_beat_and_sees_a_takeover(run, claimers):
    """own_thread=False (sim_cluster.py beats 1,000 simulated replicas from one thread): no heartbeat thread is
    started, beat() renews the claims held, and it notes a shard another replica took over."""
    import threading

    before = [t.name for t in threading.enumerate()].count("shardgen-heartbeat")
    a = claimers(0, lease_s=0.6, heartbeat_s=0.1, own_thread=False)
    assert [t.name for t in threading.enumerate()].count("shardgen-heartbeat") == before
    assert a.try_claim(0, None) == 1 and a.try_claim(1, None) == 1
    past = time.time() - 10
    os.utime(run.claim(0, 1), (past, past))
    os.utime(run.claim(1, 1), (past, past))
    a.beat()  # both claims renewed: their heartbeat is fresh again
    b = claimers(1, lease_s=0.6, heartbeat_s=60)
    assert b.try_claim(0, 1) is None and b.try_claim(1, 1) is None
    os.utime(run.claim(1, 1), (past, past))  # a misses its heartbeats for shard 1: b takes it over
    assert b.try_claim(1, 1) == 2
    a.beat()
    assert 1 in a.lost and not a.still_mine(1) and a.still_mine(0)


def test_an_idle_replica_polls_over_the_shards_left_not_the_whole_plan():
    """At the tail of a 100k-shard run the walk and each idle poll go over the few shards not known done: the plan
    is gone through once per listing of shards/, not once per poll (at 100k shards that was 100k lookups a poll, the
    1,000-replica simulation's tail at load 200-390)."""
    from types import SimpleNamespace

    from shardgen.run.shardwalk import ShardWalk

    class CountingSet(set):
        lookups = 0

        def __contains__(self, item):
            CountingSet.lookups += 1
            return super().__contains__(item)

    n = 100_000
    w = SimpleNamespace(_done=CountingSet(range(n - 5)), _todo=[], _todo_of=None)
    assert ShardWalk._not_done(w, n) == list(range(n - 5, n))
    assert CountingSet.lookups == n  # the listing's pass over the plan
    w._done.update({n - 5, n - 4})  # two more seen committed (a stat of their done marker)
    CountingSet.lookups = 0
    for _ in range(100):  # polls
        left = [s for s in ShardWalk._not_done(w, n) if s not in w._done]
    assert left == [n - 3, n - 2, n - 1] and CountingSet.lookups <= 100 * 5 + 5
    w._done = CountingSet(range(n - 1))  # a new listing: the plan once more
    assert ShardWalk._not_done(w, n) == [n - 1]


def test_a_holder_a_launcher_reported_ended_is_dead_on_any_host(monkeypatch):
    """launcher=ray starts a replica again with its lost actors named (host, pid, when): their claims are taken over
    at once even from another node, but not a later process that reuses the pid there."""
    from shardgen.dataio.rundir.claims import holder_known_dead
    from shardgen.dataio.rundir.liveness import ENDED_ENV

    me = dict(host="node-a", pid=1, job=None, restart=0)
    lost = dict(host="node-b", pid=4242, job=None, restart=0, started=1000.0)
    assert not holder_known_dead(lost, me)
    monkeypatch.setenv(ENDED_ENV, "node-b:4242:1500.5,garbage,node-c:7:9")
    assert holder_known_dead(lost, me)
    assert not holder_known_dead(dict(lost, started=2000.0), me)  # started after the report: another process
    assert not holder_known_dead(dict(lost, host="node-c"), me)


@PROC
@pytest.mark.parametrize("pid", [2**63, 99_999_999_999, 0, -1, True])
def test_a_claim_naming_a_pid_no_process_can_have_is_a_gone_holder_not_a_traceback(pid):
    """A damaged record's pid (past a C int, 0 and below, which ``kill`` takes for process groups): no process of
    this host holds it, so its claim is taken over, and no launch ends in OverflowError."""
    from shardgen.dataio.rundir.liveness import pid_alive

    me = owner_record(0)
    assert not pid_alive(pid)
    assert holder_known_dead(dict(host=me["host"], pid=pid, job=None, restart=0), me) is (pid is not True)


@PROC
@pytest.mark.parametrize("damage", [lambda i: i[:3], lambda i: "garbage", lambda i: i.replace(":", ";"), lambda i: ""])
def test_a_live_holder_whose_recorded_identity_is_damaged_is_judged_by_its_pid(damage):
    """A ``proc`` that is no process identity (cut, garbage) tells nothing: the holder is the live process at its
    pid, not one of another boot."""
    from shardgen.dataio.rundir.liveness import process_identity

    p = subprocess.Popen(["sleep", "60"])
    try:
        me = owner_record(0)
        holder = dict(host=me["host"], pid=p.pid, job=None, restart=0, proc=damage(process_identity(p.pid)))
        assert not holder_known_dead(holder, me)
    finally:
        p.kill()
        p.wait()
