"""Which shard a replica's leader works on next: claims free shards, takes over the claims of dead holders and, with
``retry_failed``, claims committed shards that recorded failures. The claims' own protocol (exclusive create,
heartbeat, takeover by generation) is ``Claimer``'s (shardgen/dataio/rundir/claims.py); this is the order they are
tried in and what a replica remembers between tries.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shardgen.dataio.prompts import Plan
from shardgen.dataio.resume import read_shard_stats
from shardgen.dataio.rundir import Claimer, scan_claims

log = logging.getLogger("shardgen.replica")
WALK_MISSES = 64        # taken shards in a row before a replica lists the run again (ShardWalk.next)
TAKEOVER_CHECKS = 16    # claimed shards a replica with nothing free checks for a dead holder, per poll


def start_offset(index: int, count: int, num_shards: int, owner: dict) -> int:
    """Where a replica starts walking the plan: its job's replicas spread evenly, and SLURM jobs (1,000 one-GPU
    jobs all have replica 0 of 1) spread by a hash of their job id, so no herd on shard 0."""
    job = owner.get("job")
    base = int(hashlib.sha256(str(job).encode()).hexdigest()[:12], 16) % num_shards if job else 0
    return (base + index * num_shards // max(1, count)) % num_shards


@dataclass
class ShardWalk:
    """The shards one replica claims, in order, and what it knows of the others' (a cache of the done ones).

    Every rank keeps one, but only the leader (which holds the claimer) claims; the other ranks only count the shards
    they finished, for ``shards_left``.
    """

    plan: Plan
    claimer: Claimer | None = None          # the leader's claims; None on the other ranks
    index: int = 0                          # this replica's index among its job's ``count`` (start_offset)
    count: int = 1
    poll_s: float = 2.0                     # the first idle poll; it grows while nothing is free
    wait_for_commits: Callable[[], None] = lambda: None  # returns once this replica's queued commits are made
    _cursor: int | None = field(default=None, init=False)  # where the walk for the next shard starts
    _done: set | None = field(default=None, init=False)    # shards known committed (a cache: they stay committed)
    _made: set = field(default_factory=set, init=False)    # shards this replica finished (their commits may be queued)
    _todo: list = field(default_factory=list, init=False)  # shards not known done, ascending (see _not_done)
    _todo_of: Any = field(default=None, init=False)        # the _done set _todo was computed from
    _retried: set = field(default_factory=set, init=False)  # committed shards claimed once for retry_failed

    def next(self) -> tuple[int, int] | None:
        """(shard, claim generation) of the shard to work on next, waiting while others hold the last shards; None
        once every shard is committed.

        At cluster scale every listing of shards/ (100k entries) and every claim attempt is a round trip to a
        shared metadata server, so the common case costs O(1) operations: the replica walks the plan from its
        own offset (spread over the replicas of a job and over jobs), skipping shards known done, and claims
        the first free one (a stat of its done marker, the exclusive create, a stat again). Only after
        ``WALK_MISSES`` shards in a row that were taken does it list shards/ and claims/ again: its known-done
        set is refreshed, it jumps to a random free shard (no herd on one shard), and, when none is free, it
        takes over stalled claims (a few per poll) and waits with a growing, jittered poll, listing only claims/
        meanwhile."""
        run, n = self.plan.run, self.plan.num_shards
        if self._cursor is None:
            self._cursor = start_offset(self.index, self.count, n, self.claimer.owner)
        idle = 0
        while True:
            if self._done is None or len(self._done) >= n:
                self._done = run.done_shards()  # a launch's repair may have removed a done marker: list again
                if len(self._done) >= n:
                    return None
            # while idle (the tail: what is left is held by others) neither the walk nor a listing of shards/ is
            # repeated at each poll: claims/ (one entry per shard in progress) and a stat per shard that left it do
            got = self._walk(n) if idle == 0 else None
            if got is None:
                if idle == 0:
                    self._done = run.done_shards()
                    if len(self._done) >= n:
                        return None
                got = self._refresh_and_claim(n)
            if got is not None:
                self._cursor = (got[0] + 1) % n
                return got
            if len(self._done) >= n:  # the probes above found the last shards committed: no poll to sleep through
                return None
            if self.claimer.held:  # our own last shards are being committed: wait for that, not a poll
                self.wait_for_commits()
            else:  # nothing free: the rest is held by live replicas; poll less often the longer it lasts
                # up to a quarter lease (30 s in production): a poll is a listing of claims/ and up to
                # TAKEOVER_CHECKS claims read, and at the tail of a 1,000-replica run hundreds of replicas poll at
                # once; a dead holder's shard is taken over at most lease_s/4 later for it (docs/scaling.md)
                idle += 1
                cap = max(self.poll_s, self.claimer.lease_s / 4)
                time.sleep(min(cap, self.poll_s * 2 ** (idle // 2)) * random.uniform(0.75, 1.25))

    def next_retry(self) -> tuple[int, int, list[int]] | None:
        """(shard, claim generation, indices to regenerate) of a committed shard with failed samples, each shard
        once; None when none is left."""
        run = self.plan.run
        latest = scan_claims(run)
        for shard in sorted(run.done_shards()):
            stats = read_shard_stats(run, shard)
            if not stats["failed"] or shard in self._retried:
                continue
            gen = self.claimer.try_claim(shard, latest.get(shard))
            if gen is None:
                continue
            self._retried.add(shard)
            return shard, gen, [f["index"] for f in stats["failed_samples"] if f["status"] == "failed"]
        return None

    def finished(self, shard: int) -> None:
        """Note that this replica made all of ``shard`` (its commit may still be queued)."""
        self._made.add(shard)

    def shards_left(self) -> int:
        """Shards neither known committed nor finished by this replica."""
        # the known-done set misses the shards this replica made itself, whose commits may still be queued
        known = self._done if self._done is not None else self.plan.run.done_shards()
        return self.plan.num_shards - len(known | self._made)

    def let_go(self, shard: int) -> None:
        """Forget the claim of a shard another replica took over: its claim files are the new holder's to remove
        (its release removes our older generation with its own)."""
        self.claimer.held.pop(shard, None)

    def settle(self, shard: int, committed_here: bool) -> None:
        """Give up the claim of ``shard`` once its commit ended: committed here, or not (taken over, and the new
        holder commits it, or committed meanwhile)."""
        if committed_here or self.plan.run.is_done(shard):
            # not committed here but done: committed by the holder this replica took it over from, whose release
            # came before our claim; no later holder will release our claim files, so we do (they would stay in
            # claims/ for good)
            self.claimer.release(shard)
        else:
            self.let_go(shard)

    def release_unfinished(self) -> None:
        """Give up the claims of the shards left unfinished, so that a re-run (or another replica) resumes them from
        their checkpoints at once instead of waiting ``lease_s`` for the claims to expire."""
        if self.claimer is None or not self.claimer.held:
            return
        held = sorted(self.claimer.held)
        for shard in held:
            self.claimer.release(shard)
        log.info("released %d unfinished shard(s) (%s): a re-run resumes them from their checkpoints",
                 len(held), ", ".join(f"{s:06d}" for s in held[:8]) + (" ..." if len(held) > 8 else ""))

    def _claim_free(self, shard: int, latest_gen: int | None) -> int | None:
        """Claim ``shard`` unless it is done (its done marker is checked before and after the claim)."""
        run = self.plan.run
        if shard in self._done or shard in self.claimer.held:
            return None
        if run.is_done(shard):
            self._done.add(shard)
            return None
        gen = self.claimer.try_claim(shard, latest_gen)
        if gen is not None and run.is_done(shard):  # committed by someone between check and claim
            self._done.add(shard)
            self.claimer.release(shard)
            return None
        return gen

    def _not_done(self, n: int) -> list[int]:
        """The shards not known done, ascending. Computed from the whole plan only when ``_done`` is a new listing;
        otherwise the last list, filtered: late in a run (nearly all done) and at the tail, where idle replicas poll,
        that is the few shards left, not the 100k of the plan (each poll and each walk would go over all of them)."""
        if self._todo_of is not self._done:
            self._todo = [s for s in range(n) if s not in self._done]
            self._todo_of = self._done
        elif len(self._todo) > 2 * max(0, n - len(self._done)) + 64:  # over half stale: each filter halves the list
            self._todo = [s for s in self._todo if s not in self._done]
        return self._todo

    def _walk(self, n: int) -> tuple[int, int] | None:
        """Claim the first free shard from the cursor on (a claim generation 1); None after WALK_MISSES taken ones."""
        todo = self._not_done(n)
        start = bisect.bisect_left(todo, self._cursor)
        misses = 0
        for shard in itertools.chain(itertools.islice(todo, start, None), itertools.islice(todo, 0, start)):
            if shard in self._done or shard in self.claimer.held:
                continue
            gen = self._claim_free(shard, None)
            if gen is not None:
                return shard, gen
            misses += 1
            if misses >= WALK_MISSES:
                break
        return None

    def _refresh_and_claim(self, n: int) -> tuple[int, int] | None:
        """From fresh listings: a random free shard, else a few claimed ones whose holder may be gone."""
        latest = scan_claims(self.plan.run)
        todo = [s for s in self._not_done(n) if s not in self._done and s not in self.claimer.held]
        free = [s for s in todo if s not in latest]
        random.shuffle(free)
        for shard in free:
            if (gen := self._claim_free(shard, None)) is not None:
                return shard, gen
        claimed = [s for s in todo if s in latest]
        for shard in random.sample(claimed, min(len(claimed), TAKEOVER_CHECKS)):
            if (gen := self._claim_free(shard, latest[shard])) is not None:
                return shard, gen
        return None
