"""Reading a run's state back from its directory: shard states, claims, counts, failures.

The run directory is the only source of truth (no pickled state, no database), so progress
bars, ``jobs.status``, ``jobs.verify`` and a requeued job all read it the same way.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from shardgen.dataio.prompts.plan import Plan
from shardgen.dataio.rundir.claims import LEASE_S, claim_state, owner_record, read_claim, scan_claims
from shardgen.dataio.rundir.layout import RunDir, RunDirError, atomic_write_bytes, map_io, read_state
from shardgen.dataio.shards.shardwork import STATS_FIELDS, all_checkpoints


@dataclass
class ShardState:
    """One shard as seen on disk."""

    shard: int
    rows: int
    state: str               # done | running | future (heartbeat ahead of our clock) | stalled | dead | pending | damaged
    samples: int = 0         # committed (done) or checkpointed (in progress)
    claim_age_s: float | None = None
    holder: dict | None = None
    stats: dict | None = None
    started: float | None = None   # in progress: when the shard's first generation started (its checkpoint)
    updated: float | None = None   # in progress: when its last batch became durable (its checkpoint)


@dataclass
class Ledger:
    """A snapshot of a run."""

    plan: Plan
    shards: list[ShardState]
    failures_by_reason: Counter = field(default_factory=Counter)

    @property
    def done_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def count(self, state: str) -> int:
        return sum(s.state == state for s in self.shards)

    def totals(self) -> Counter:
        """ok / failed / rejected / truncated over committed shards (stats written before truncated was
        counted there have none)."""
        c: Counter = Counter()
        for s in self.shards:
            if s.stats:
                c.update({k: s.stats.get(k, 0) for k in ("ok", "failed", "rejected", "truncated")})
        return c

    def finished_at(self) -> float | None:
        """When the last shard was committed, once every shard is; None while the run is not complete."""
        if self.count("done") != len(self.shards):
            return None
        return max((s.stats.get("finished", 0) for s in self.shards if s.stats), default=None)


def read_ledger(plan: Plan, lease_s: float = LEASE_S, stats_cache: dict | None = None,
                persist: bool = False) -> Ledger:
    """Snapshot every shard's state; ``stats_cache`` (shard -> stats) avoids re-reading done shards.

    Each directory is listed once (not once per shard), and the done shards' stats are read by a few threads:
    on NFS or Lustre each read is a round trip, and 100k of them one after the other would take minutes.
    ``persist`` (jobs.status): keep what it needs of each stats file in ``stats_cache.json``, valid while the
    file's size and mtime (from the listing) are unchanged, so a status call reads only new stats."""
    run = plan.run
    cache = stats_cache if stats_cache is not None else {}
    done = run.done_shards()
    claims = scan_claims(run) if run.claims_dir.exists() else {}
    ckpts_of = all_checkpoints(run) if run.work_dir.exists() else {}
    sigs = _stats_signatures(run) if persist else {}
    if persist:
        cache.update(_load_persisted(run, sigs))
    new = _read_stats_parallel(run, sorted(done - cache.keys()))
    cache.update(new)
    if persist and any(v is not None for v in new.values()):
        _persist(run, cache, sigs)
    now, me = time.time(), owner_record(-1)
    shards, reasons = [], Counter()
    plain = not plan.extensions  # one segment: a shard's rows by arithmetic (shard_range 100k times costs a second)
    per, total = plan.samples_per_shard, (plan.meta["num_rows"] if plan.meta else plan.num_rows)
    for shard in range(plan.num_shards):
        rows = min(per, total - shard * per) if plain else len(plan.shard_range(shard))
        if shard in done:
            st = cache.get(shard)
            if st is None:  # shown as damaged; the next launch (or jobs.verify --repair) repairs it
                cache.pop(shard, None)
                shards.append(ShardState(shard, rows, "damaged"))
                continue
            if st.get("failures_by_reason") and isinstance(st["failures_by_reason"], dict):
                reasons.update(st["failures_by_reason"])
            shards.append(ShardState(shard, rows, "done", st["count"], stats=st))
            continue
        best = max(ckpts_of.get(shard, []), key=lambda c: c["n_done"], default=None)
        n = best["n_done"] if best else 0
        times = dict(started=best.get("started"), updated=best.get("updated")) if best else {}
        gen = claims.get(shard)
        if gen is None:
            shards.append(ShardState(shard, rows, "pending", n, **times))
            continue
        record, mtime = read_claim(run, shard, gen)
        age = None if mtime is None else now - mtime
        state = claim_state(record, mtime, now, lease_s, me)
        shards.append(ShardState(shard, rows, "pending" if state == "gone" else state, n, claim_age_s=age,
                                 holder=record if isinstance(record, dict) else {}, **times))
    return Ledger(plan=plan, shards=shards, failures_by_reason=reasons)


STATUS_FIELDS = ("shard", "count", "ok", "failed", "rejected", "truncated", "failures_by_reason", "started",
                 "finished", "wall_s")  # what the status and the ledger's totals use of a shard's stats


def _stats_signatures(run: RunDir) -> dict[int, list[int]]:
    """shard -> [size, mtime_ns] of its stats file, from one listing of shards/."""
    out = {}
    try:
        with os.scandir(run.shards_dir) as it:
            for e in it:
                if e.name.endswith(".stats.json") and e.name[:6].isdigit():
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out[int(e.name[:6])] = [st.st_size, st.st_mtime_ns]
    except FileNotFoundError:
        pass
    return out


def _load_persisted(run: RunDir, sigs: dict[int, list[int]]) -> dict[int, dict]:
    try:
        saved = read_state(run.stats_cache_path)
    except RunDirError:  # none yet, or damaged: the stats are read again
        return {}
    out = {}
    for key, entry in (saved.items() if isinstance(saved, dict) else ()):
        if key.isdigit() and isinstance(entry, dict) and entry.get("sig") == sigs.get(int(key)) \
                and isinstance(entry.get("stats"), dict):
            out[int(key)] = entry["stats"]
    return out


def _persist(run: RunDir, cache: dict, sigs: dict[int, list[int]]) -> None:
    data = {str(s): dict(sig=sigs[s], stats={k: st[k] for k in STATUS_FIELDS if k in st})
            for s, st in cache.items() if st is not None and s in sigs}
    try:
        atomic_write_bytes(run.stats_cache_path, json.dumps(data, separators=(",", ":")).encode())
    except OSError:  # a run directory this user may only read: the next call reads the stats again
        pass


def _read_stats_parallel(run: RunDir, shards: list[int]) -> dict[int, dict | None]:
    """shard -> its stats (None: unreadable), read concurrently."""
    def one(shard: int) -> dict | None:
        try:
            return read_state(run.shard_stats(shard), STATS_FIELDS)
        except RunDirError:
            return None

    return dict(zip(shards, map_io(one, shards)))


def run_lease_s(run: RunDir, default: float = LEASE_S) -> float:
    """The lease the run was configured with (from its resolved config), for status displays."""
    import yaml
    from omegaconf import OmegaConf

    try:
        return float(OmegaConf.load(run.config_path).get("lease_s", default))
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):  # missing or damaged: the default
        return default


def list_work_files(run: RunDir) -> list[str]:
    """Names in work/ (partials and checkpoints)."""
    return sorted(os.listdir(run.work_dir)) if run.work_dir.exists() else []
