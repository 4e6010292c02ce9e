"""Shard claims: which replica works on which shard, so many jobs can share one run directory.

A claim is a file ``claims/NNNNNN.g<gen>`` created with O_CREAT|O_EXCL (atomic on local disks
and on NFSv3+/Lustre, unlike flock), or an object of a bucket created with If-None-Match: * (claimstore.py: where
claims live). Its mtime (an object's LastModified) is the heartbeat. Taking over a shard means
creating generation gen+1, which only one contender can do; the holder of a lower generation
sees it has lost the shard at its next heartbeat and stops writing. A claim is taken over when
its heartbeat is older than the lease, or at once when its holder is known dead (same host and
its pid is gone, the same SLURM job restarted, or, seen from a SLURM job, the holder's SLURM job ended).

Clocks of different hosts disagree: a heartbeat in the future (the holder's or the file server's
clock is ahead) is not trusted for ever. A claimer also times each claim by its own clock: a
heartbeat that has not changed for a whole lease, as seen from here, is expired whatever its
mtime says. A holder whose claim was taken over (e.g. its clock is behind, so its heartbeat
looked old) sees the new generation and leaves the shard without error.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from shardgen.dataio.rundir.claimstore import ClaimStore, claim_name
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.liveness import gone_from_this_host, host_name, process_identity, reported_ended
from shardgen.dataio.rundir.remote import StorageError

# The defaults of the config keys lease_s and heartbeat_s (shardgen/config/schema.py takes them from here)
LEASE_S = 120.0     # a claim whose heartbeat is older than this is taken over
HEARTBEAT_S = 15.0  # how often a holder renews its claims

log = logging.getLogger("shardgen.claims")
FUTURE_TOLERANCE_S = 5.0  # heartbeats this far ahead of our clock are reported as clock skew


def owner_record(replica: int) -> dict:
    """Who is claiming: enough for others to tell whether we are dead (``proc``: this process's identity on its
    host, where /proc tells it, so a later process given the same pid is not taken for it)."""
    proc = process_identity(os.getpid())
    return dict(host=host_name(), pid=os.getpid(), replica=replica,
                job=os.environ.get("SLURM_JOB_ID"), restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                started=time.time(), **({"proc": proc} if proc else {}))


def holder_known_dead(record: dict | None, me: dict) -> bool:
    """True when the claim's holder cannot be alive (so waiting for its lease is pointless)."""
    if not isinstance(record, dict) or not record:
        return False
    if _gone_here(record, me):
        return True
    # e.g. a Ray actor lost on another node
    if reported_ended(record.get("host"), record.get("pid"), record.get("started")):
        return True
    job, restart = record.get("job"), record.get("restart", 0)
    if not isinstance(restart, int):
        return False
    if job and job == me["job"]:
        return restart < me["restart"]
    if job and me["job"]:  # another SLURM job, maybe on another node (where its pid means nothing): ask SLURM
        from shardgen.dataio.rundir.slurm_jobs import slurm_attempt_ended

        return slurm_attempt_ended(str(job), restart)
    return False


def _gone_here(record: dict, me: dict) -> bool:
    """Whether the record's holder ran on this host and is gone: its pid ended, or another process has it now (the
    record's ``proc`` differs: a pid reused, even this process's own pid in a container run again). A record
    without ``proc`` (written where /proc was not readable) is ours when it has our pid; one of another pid namespace
    (a container sharing this host name) is judged by its lease alone."""
    return gone_from_this_host(record.get("host"), record.get("pid"), record.get("proc"),
                               me=(me["host"], me["pid"], me.get("proc")))


def claim_state(record: dict | None, mtime: float | None, now: float, lease_s: float, me: dict) -> str:
    """How a claim looks from here: running | future (heartbeat ahead of our clock) | stalled | dead | gone."""
    if mtime is None:
        return "gone"
    if holder_known_dead(record, me):
        return "dead"
    if mtime - now > FUTURE_TOLERANCE_S:
        return "future"
    return "running" if now - mtime < lease_s else "stalled"


def scan_claims(run: RunDir | None, store: ClaimStore | None = None) -> dict[int, int]:
    """Highest claim generation per shard (in ``store``; by default the run's own: ``RunDir.claims``)."""
    return (store or run.claims).latest()


def read_claim(run: RunDir | None, shard: int, gen: int,
               store: ClaimStore | None = None) -> tuple[dict | None, float | None]:
    """(record, heartbeat mtime) of a claim (in ``store``; by default the run's own: ``RunDir.claims``); (None, None) if
    it vanished."""
    data, mtime = (store or run.claims).read(shard, gen)
    if data is None:  # gone, or not a claim shardgen wrote (a FIFO, a link, a huge file): alive only by its mtime
        return (None if mtime is None else {}), mtime
    try:
        return json.loads(data), mtime
    except ValueError:
        return {}, mtime  # being written right now: treat as alive by its mtime


@dataclass
class Claimer:
    """Claims shards for one replica and keeps its claims alive from a background thread. The claims live in
    ``store`` (claimstore.py); by default the run's own (``RunDir.claims``: its claims/ folder, or its bucket's)."""

    run: RunDir | None
    owner: dict
    lease_s: float = LEASE_S
    heartbeat_s: float = HEARTBEAT_S
    held: dict[int, int] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    own_thread: bool = True  # False: no heartbeat thread; the caller calls beat() every heartbeat_s
    _seen: dict = field(default_factory=dict)  # (shard, gen) -> (heartbeat mtime, our time when it was first seen)
    _renewed: dict = field(default_factory=dict)  # shard -> our time of its claim's last renewal (or creation)
    store: ClaimStore | None = None

    def __post_init__(self):
        if self.store is None:
            if self.run is None:
                raise ValueError("a Claimer needs a run directory or a claim store")
            self.store = self.run.claims
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.own_thread:
            self._thread = threading.Thread(target=self._heartbeat_loop, name="shardgen-heartbeat", daemon=True)
            self._thread.start()

    def try_claim(self, shard: int, latest_gen: int | None) -> int | None:
        """Claim ``shard`` (whose highest claim generation is ``latest_gen``); its new generation or None."""
        if latest_gen is not None and self._alive(shard, latest_gen):
            return None
        gen = (latest_gen or 0) + 1
        if not self.store.create(shard, gen, json.dumps(self.owner).encode()):
            return None
        with self._lock:
            self.held[shard] = gen
            self._renewed[shard] = time.monotonic()
        return gen

    def take_commit(self, shard: int) -> bool:
        """Take the right to commit ``shard``: create its next claim generation ourselves, exclusively, just before
        the commit's renames. A replica taking the shard over creates that same generation, so of a holder alive
        but silent past its lease and the replica that took it over exactly one gets it, however close their
        commits are (a stat-then-rename check leaves a window where both rename). True: the shard is ours to commit
        (the new generation is held, renewed and released like a claim; if we die before the stats are written it
        expires and the shard is taken over, and the launch's repair finishes or removes what the renames left).
        False: it was taken over; we must not commit."""
        with self._lock:
            gen = self.held.get(shard)
            if gen is None or shard in self.lost:
                return False
        if not self.store.create(shard, gen + 1, json.dumps(dict(self.owner, commit=True)).encode()):
            with self._lock:
                self.lost.add(shard)
            return False
        with self._lock:
            self.held[shard] = gen + 1
            self._renewed[shard] = time.monotonic()
        return True

    def _alive(self, shard: int, gen: int) -> bool:
        """Whether claim (shard, gen) still holds: its heartbeat is recent by its mtime, and it has
        changed within a lease as timed by our own clock (a future or frozen mtime expires too)."""
        record, mtime = read_claim(self.run, shard, gen, self.store)
        now = time.time()
        state = claim_state(record, mtime, now, self.lease_s, self.owner)
        if state in ("gone", "dead", "stalled"):
            if state == "stalled":
                log.info("taking over shard %06d: claim g%d by %s has not beaten for %.0f s (lease_s=%s)", shard, gen,
                         _who(record), now - mtime, self.lease_s)
            return False
        seen_mtime, first_seen = self._seen.get((shard, gen), (None, now))
        if seen_mtime != mtime:
            if state == "future" and seen_mtime is None:
                log.warning("claim %s/%s has a heartbeat %.0f s in the future (clocks of %s and this host "
                            "disagree); it is taken over if it does not change for lease_s=%s s", self.store.where,
                            claim_name(shard, gen), mtime - now, _who(record), self.lease_s)
            self._seen[(shard, gen)] = (mtime, now)
            return True
        if now - first_seen < self.lease_s:
            return True
        log.warning("taking over shard %06d: claim g%d by %s has not changed for %.0f s of this host's clock "
                    "(its heartbeat mtime says %s)", shard, gen, _who(record), now - first_seen,
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime)))
        return False

    def still_mine(self, shard: int) -> bool:
        """False once another replica took the shard over (checked by the heartbeat, and here)."""
        gen = self.held.get(shard)
        return gen is not None and shard not in self.lost and not self.store.exists(shard, gen + 1)

    def release(self, shard: int) -> None:
        """Drop our claim (after commit, or when giving up); older generations go too."""
        with self._lock:
            gen = self.held.pop(shard, None)
            self.lost.discard(shard)
            self._renewed.pop(shard, None)
        if gen is None:
            return
        for g in range(gen, 0, -1):
            self.store.remove(shard, g)

    def close(self) -> None:
        """Stop the heartbeat thread (claims stay; they expire or are released)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()

    def beat(self) -> None:
        """One heartbeat: renew every claim held (its heartbeat time), and note those another replica took over or
        that are gone.
        The claimer's thread calls it every ``heartbeat_s``; a driver of many claimers (benchmarks/sim_cluster.py
        beats 1,000 simulated replicas from one thread) may call it instead."""
        with self._lock:
            held = dict(self.held)
        for shard, gen in held.items():
            try:
                if self.store.exists(shard, gen + 1) or not self.store.renew(shard, gen):
                    self._lose(shard, gen)
                    continue
            except StorageError as e:  # the store unreachable past its retries: the claim may lapse meanwhile
                self._unrenewed(shard, gen, e)
                continue
            with self._lock:
                self._renewed[shard] = time.monotonic()

    def _unrenewed(self, shard: int, gen: int, error: StorageError) -> None:
        """A renewal that failed past its retries. The claim still holds until ``lease_s`` after its last renewal;
        from then on another replica may have taken it over, so it is given up (the replica stops writing the
        shard, and the store's outage reaches the launch through its next claim or commit)."""
        with self._lock:
            last = self._renewed.get(shard, time.monotonic())
        if time.monotonic() - last < self.lease_s:
            log.warning("could not renew the claim of shard %06d (%s); it holds for %.0f s more", shard, error,
                        self.lease_s - (time.monotonic() - last))
            return
        log.warning("shard %06d: its claim went unrenewed for lease_s=%s s (%s); leaving the shard to whoever "
                    "takes it over", shard, self.lease_s, error)
        self._lose(shard, gen)

    def _lose(self, shard: int, gen: int) -> None:
        with self._lock:
            if self.held.get(shard) == gen:  # not when take_commit moved us to gen + 1 since the snapshot
                self.lost.add(shard)


def _who(record: dict | None) -> str:
    r = record if isinstance(record, dict) else {}
    return f"host {r.get('host', '?')} pid {r.get('pid', '?')}"
