"""Shard claims: which replica works on which shard, so many jobs can share one run directory.

A claim is a file ``claims/NNNNNN.g<gen>`` created with O_CREAT|O_EXCL (atomic on local disks
and on NFSv3+/Lustre, unlike flock). Its mtime is the heartbeat. Taking over a shard means
creating generation gen+1, which only one contender can do; the holder of a lower generation
sees it has lost the shard at its next heartbeat and stops writing. A claim is taken over when
its heartbeat is older than the lease, or at once when its holder is known dead (same host and
its pid is gone, the same SLURM job restarted, or, seen from a SLURM job, the holder's SLURM job ended).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field

from shardgen.dataio.rundir import RunDir

_CLAIM_RE = re.compile(r"^(\d{6})\.g(\d+)$")


def owner_record(replica: int) -> dict:
    """Who is claiming: enough for others to tell whether we are dead."""
    return dict(host=socket.gethostname(), pid=os.getpid(), replica=replica,
                job=os.environ.get("SLURM_JOB_ID"), restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                started=time.time())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_known_dead(record: dict | None, me: dict) -> bool:
    """True when the claim's holder cannot be alive (so waiting for its lease is pointless)."""
    if not record:
        return False
    if record.get("host") == me["host"] and record.get("pid") != me["pid"] and not _pid_alive(int(record["pid"])):
        return True
    job = record.get("job")
    if job and job == me["job"]:
        return int(record.get("restart", 0)) < me["restart"]
    if job and me["job"]:  # another SLURM job, maybe on another node (where its pid means nothing): ask SLURM
        from shardgen.dataio.slurm_jobs import slurm_attempt_ended

        return slurm_attempt_ended(str(job), int(record.get("restart", 0)))
    return False


def scan_claims(run: RunDir) -> dict[int, int]:
    """Highest claim generation per shard."""
    latest: dict[int, int] = {}
    for name in os.listdir(run.claims_dir):
        m = _CLAIM_RE.match(name)
        if m:
            shard, gen = int(m.group(1)), int(m.group(2))
            latest[shard] = max(gen, latest.get(shard, 0))
    return latest


def read_claim(run: RunDir, shard: int, gen: int) -> tuple[dict | None, float | None]:
    """(record, heartbeat mtime) of a claim; (None, None) if it vanished."""
    path = run.claim(shard, gen)
    try:
        mtime = os.stat(path).st_mtime
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, None
    try:
        return json.loads(data), mtime
    except ValueError:
        return {}, mtime  # being written right now: treat as alive by its mtime


@dataclass
class Claimer:
    """Claims shards for one replica and keeps its claims alive from a background thread."""

    run: RunDir
    owner: dict
    lease_s: float = 120.0
    heartbeat_s: float = 15.0
    held: dict[int, int] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="shardgen-heartbeat", daemon=True)
        self._thread.start()

    def try_claim(self, shard: int, latest_gen: int | None) -> int | None:
        """Claim ``shard`` (whose highest claim generation is ``latest_gen``); its new generation or None."""
        if latest_gen is not None:
            record, mtime = read_claim(self.run, shard, latest_gen)
            if mtime is not None and time.time() - mtime < self.lease_s and not holder_known_dead(record, self.owner):
                return None
        gen = (latest_gen or 0) + 1
        try:
            fd = os.open(self.run.claim(shard, gen), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "w") as f:
            json.dump(self.owner, f)
            f.flush()
            os.fsync(f.fileno())
        with self._lock:
            self.held[shard] = gen
        return gen

    def still_mine(self, shard: int) -> bool:
        """False once another replica took the shard over (checked by the heartbeat, and here)."""
        gen = self.held.get(shard)
        return gen is not None and shard not in self.lost and not self.run.claim(shard, gen + 1).exists()

    def release(self, shard: int) -> None:
        """Drop our claim (after commit, or when giving up); older generations go too."""
        with self._lock:
            gen = self.held.pop(shard, None)
            self.lost.discard(shard)
        if gen is None:
            return
        for g in range(gen, 0, -1):
            try:
                os.unlink(self.run.claim(shard, g))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Stop the heartbeat thread (claims stay; they expire or are released)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                held = dict(self.held)
            for shard, gen in held.items():
                if self.run.claim(shard, gen + 1).exists():
                    self.lost.add(shard)
                    continue
                try:
                    os.utime(self.run.claim(shard, gen))
                except FileNotFoundError:
                    self.lost.add(shard)
