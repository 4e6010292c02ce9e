"""The replica loop: claim a shard, continue it from its checkpoint, generate batch by batch, commit.

Only the replica's leader touches the run directory; the other ranks of a model-parallel
replica receive the same shard and rows from it and compute alongside.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shardgen.dataio.prompts import Plan
from shardgen.dataio.resume import checked_rows, read_shard_stats
from shardgen.dataio.rundir import Claimer, RankMetrics, record_commit, scan_claims
from shardgen.dataio.shards import (Sample, ShardSink, ShardWork, committed_samples, committed_tar,
                                     read_shard_members)
from shardgen.run.generation import GenSettings, ImagePrefetch, generate_batch, shape_batches
from shardgen.run.watchdog import StallWatchdog
from shardgen.speed.autocompile import AutoCompile
from parallel.world import broadcast_object
from shardgen.errors import UserError

log = logging.getLogger("shardgen.replica")
MAX_FAILED_BATCHES = 3  # every sample of this many consecutive batches failing = a broken setup
WALK_MISSES = 64        # taken shards in a row before a replica lists the run again (next_shard)
TAKEOVER_CHECKS = 16    # claimed shards a replica with nothing free checks for a dead holder, per poll


def start_offset(index: int, count: int, num_shards: int, owner: dict) -> int:
    """Where a replica starts walking the plan: its job's replicas spread evenly, and SLURM jobs (1,000 one-GPU
    jobs all have replica 0 of 1) spread by a hash of their job id, so no herd on shard 0."""
    job = owner.get("job")
    base = int(hashlib.sha256(str(job).encode()).hexdigest()[:12], 16) % num_shards if job else 0
    return (base + index * num_shards // max(1, count)) % num_shards


class BrokenSetupError(UserError, RuntimeError):
    """Every sample keeps failing: stop instead of marking the whole run failed."""


@dataclass
class ReplicaContext:
    """Who this rank is within its replica."""

    index: int = 0            # dp index
    count: int = 1            # replicas in this job
    leader: bool = True
    leader_rank: int = 0      # global rank of the leader
    group: Any = None         # the replica's process group (None: a one-rank replica)
    ranks: int = 1            # ranks in this replica (tp/cp degree)


@dataclass
class ReplicaWorker:
    """Works through the run's shards until none is left for anyone.

    A context manager owning its sink, claimer, watchdog and progress bar (each may be None where this rank
    has none): leaving the block stops them all, even when one of them fails to close.
    """

    plan: Plan
    pipe: Any
    settings: GenSettings
    batch_size: int
    ctx: ReplicaContext
    sink: ShardSink | None = None          # leader only
    claimer: Claimer | None = None         # leader only
    on_samples: Callable[[int], None] = lambda n: None
    uploader: Any = None                   # leader with output_uri: a ShardUploader, on its own thread
    progress: Any = None                   # leader of replica 0: the progress bar
    on_batch: Callable[[str, "ReplicaWorker"], None] | None = None  # run_rank's hook: "start"/"end" of a batch
    poll_s: float = 2.0
    retry_failed: bool = False             # after the run is complete, regenerate recorded failures
    watchdog: StallWatchdog = field(default_factory=lambda: StallWatchdog(None))  # times each batch and commit
    annotate: Callable[[list], None] = lambda samples: None  # leader: provenance, token counts (dataio/shards/annotate.py)
    autocompile: AutoCompile | None = None  # compile=auto on a one-rank replica: decided here, batch by batch
    metrics: RankMetrics | None = None     # leader: the Prometheus file (metrics/), rewritten at each commit
    generated: int = 0
    gen_s: float = 0.0
    _failed_batches: int = field(default=0, init=False)
    _retried: set = field(default_factory=set, init=False)
    _old: dict = field(default_factory=dict, init=False)
    _done_in_shard: int = field(default=0, init=False)  # rows of the current shard already made (remaining_here)
    _ahead: dict = field(default_factory=dict, init=False)  # leader: samples made before an earlier row, by position
    _written: int = field(default=0, init=False)            # leader: rows handed over to the sink (from n_done)
    _cursor: int | None = field(default=None, init=False)  # where the walk for the next shard starts
    _done: set | None = field(default=None, init=False)    # shards known committed (a cache: they stay committed)
    _made: set = field(default_factory=set, init=False)    # shards this worker finished (their commits may be queued)
    _todo: list = field(default_factory=list, init=False)  # shards not known done, ascending (see _not_done)
    _todo_of: Any = field(default=None, init=False)        # the _done set _todo was computed from
    _images: ImagePrefetch | None = field(default=None, init=False)  # input images, decoded a batch ahead

    def __post_init__(self) -> None:
        if self.autocompile is not None:  # compile=auto decides from this worker's work left, and sets its settings
            self.autocompile.remaining = self.remaining_here
            self.settings = self.autocompile.settings(self.settings)

    def __enter__(self) -> "ReplicaWorker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self._release_unfinished()

    def _release_unfinished(self) -> None:
        """After Ctrl-C or SIGTERM, once close() made every handed-over batch durable and stopped the writer: give
        up the claims of the shards left unfinished, so that a re-run (or another replica) resumes them from their
        checkpoints at once instead of waiting ``lease_s`` for the claims to expire. Not when the writer could
        still be writing (it outlived close's timeout): then the lease keeps the shard ours until it is done."""
        if self.claimer is None or not self.claimer.held or (self.sink is not None and self.sink.busy):
            return
        held = sorted(self.claimer.held)
        for shard in held:
            self.claimer.release(shard)
        log.info("released %d unfinished shard(s) (%s): a re-run resumes them from their checkpoints",
                 len(held), ", ".join(f"{s:06d}" for s in held[:8]) + (" ..." if len(held) > 8 else ""))

    def close(self) -> None:
        """Make every handed-over batch durable (the sink commits and releases its shards), wait for the uploads,
        then stop the watchdog, the claims' heartbeat and the progress bar; each one even if an earlier one raises."""
        with contextlib.ExitStack() as stack:  # callbacks run last-in first-out
            parts = (self._images, self.progress, self.claimer, self.watchdog, self.uploader, self.sink)
            for part in parts:  # the sink first
                if part is not None:
                    stack.callback(part.close)

    def run(self) -> None:
        """Loop: next shard (shared by the leader), process it; stop when the run is complete.
        With ``retry_failed``, then rewrite each committed shard that recorded failures."""
        if self.metrics:
            self.metrics.write()
        while (assignment := self._share(self.next_shard() if self.ctx.leader else None)) is not None:
            self.process(*assignment)
        while self.retry_failed and (assignment := self._share(self._next_retry() if self.ctx.leader else None)):
            self.process(*assignment)
        if self.sink:
            self.sink.flush()

    def _next_retry(self) -> tuple[int, int, int, list[int]] | None:
        """(shard, gen, samples done, indices to regenerate) of a committed shard with failed samples."""
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
            failed = [f["index"] for f in stats["failed_samples"] if f["status"] == "failed"]
            self._old, _ = committed_samples(run, shard, read_shard_members(committed_tar(run, shard), run.container))
            self._work = self._open(shard, gen, replaces=True)
            log.info("shard %06d: regenerating %d failed samples", shard, len(failed))
            return shard, gen, self._work.n_done, failed
        return None

    def remaining_here(self) -> int:
        """Samples this replica is still expected to make: the unfinished shards' share of one replica."""
        # the walk's known-done set misses the shards this worker made itself, whose commits may still be queued
        known = self._done if self._done is not None else self.plan.run.done_shards()
        left = self.plan.num_shards - len(known | self._made)
        return max(0, left * self.plan.samples_per_shard // max(1, self.ctx.count) - self._done_in_shard)

    def _share(self, obj):
        if self.ctx.group is None:
            return obj
        return broadcast_object(obj, src=self.ctx.leader_rank, group=self.ctx.group)

    def next_shard(self) -> tuple[int, int, int] | None:
        """(shard, claim generation, samples already done), waiting while others hold the last shards.

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
            self._cursor = start_offset(self.ctx.index, self.ctx.count, n, self.claimer.owner)
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
                shard, gen = got
                self._cursor = (shard + 1) % n
                work = self._work = self._open(shard, gen)
                return shard, gen, work.n_done
            if len(self._done) >= n:  # the probes above found the last shards committed: no poll to sleep through
                return None
            if self.claimer.held:  # our own last shards are being committed: wait for that, not a poll
                self.sink.flush()
            else:  # nothing free: the rest is held by live replicas; poll less often the longer it lasts
                # up to a quarter lease (30 s in production, was 8 s): a poll is a listing of claims/ and up to
                # TAKEOVER_CHECKS claims read, and at the tail of a 1,000-replica run hundreds of replicas poll at
                # once; a dead holder's shard is taken over at most lease_s/4 later for it (docs/scaling.md)
                idle += 1
                cap = max(self.poll_s, self.claimer.lease_s / 4)
                time.sleep(min(cap, self.poll_s * 2 ** (idle // 2)) * random.uniform(0.75, 1.25))

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
        that is the few shards left, not the 100k of the plan (each poll and each walk went over all of them)."""
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

    def _open(self, shard: int, gen: int, replaces: bool = False) -> ShardWork:
        if self.metrics:
            self.metrics.claimed()
        return ShardWork.open(self.plan.run, shard, gen, self.plan.shard_range(shard),
                              still_mine=lambda: self.claimer.still_mine(shard), replaces=replaces,
                              take_commit=lambda: self.claimer.take_commit(shard))

    def process(self, shard: int, gen: int, n_done: int, regenerate: list[int] | None = None) -> None:
        """Generate the shard's rows from ``n_done`` on (only ``regenerate`` ones, carrying the rest over)."""
        rows = checked_rows(self.plan, shard)[n_done:]
        redo = None if regenerate is None else set(regenerate)
        if self.ctx.leader and n_done:
            log.info("shard %06d: resuming after %d samples (claim g%d)", shard, n_done, gen)
        self._ahead, self._written = {}, 0
        # batches by shape (prompts.row_settings): samples are still handed over in row order, so a resume
        # continues after the shard's n_done as ever; what was made ahead of it is made again
        batches = shape_batches(self.settings, rows, self.batch_size)
        for i, batch in enumerate(batches):
            following = batches[i + 1] if i + 1 < len(batches) else []
            with self.watchdog.busy(f"shard {shard:06d}, batch from row {n_done + batch[0]}"):
                if not self._batch(shard, n_done, rows, batch, redo, following):
                    return
        self._made.add(shard)
        if self.ctx.leader:
            with self.watchdog.busy(f"committing shard {shard:06d}"):
                self.sink.commit(self._work, on_done=lambda stats, s=shard: self._committed(s, stats))

    def _batch(self, shard: int, n_done: int, rows: list, positions: list[int], redo: set | None,
               following: list[int] = ()) -> bool:
        """Generate the rows at ``positions`` and hand over the samples now complete in row order; False when
        the shard was taken over by another replica. ``following``: the next batch's positions, whose input images
        are decoded meanwhile."""
        if not self._share(self._keep_going(shard)):
            log.warning("shard %06d was taken over by another replica; leaving it", shard)
            return False
        batch = [rows[p] for p in positions]
        t0 = time.perf_counter()
        todo = batch if redo is None else [r for r in batch if r.index in redo]
        if self.on_batch:
            self.on_batch("start", self)
        if self.autocompile and todo:
            self._done_in_shard = n_done + self._written + len(self._ahead)
            self.settings = self.autocompile.settings(self.settings)
        t_gen = time.perf_counter()
        if self._images is None:
            self._images = ImagePrefetch(bool(self.settings.input_image))
        images = self._images.take(todo)
        self._images.ahead(self.settings, [rows[p] for p in following if redo is None or rows[p].index in redo])
        made = {smp.index: smp for smp in (generate_batch(self.pipe, self.settings, todo, self.ctx.ranks, images)
                                           if todo else [])}
        if self.autocompile and todo:
            self.autocompile.observe(self.settings, sum(r.reject is None for r in todo), time.perf_counter() - t_gen)
        if self.on_batch:
            self.on_batch("end", self)
        samples = [made.get(r.index) or Sample.carried(r.key, self._old[r.key]) for r in batch] if self.ctx.leader \
            else list(made.values())
        elapsed = time.perf_counter() - t0
        self.gen_s += elapsed
        generated = [s for s in made.values() if s.status != "rejected"]
        for s in generated:  # the batch's time per generated sample, for the index (not the tar: see Sample.gen_s)
            s.gen_s = elapsed / len(generated)
        self.generated += len(generated)  # pipeline outputs: a rejected row is recorded, not generated
        self._check_broken(list(made.values()))
        if self.ctx.leader:
            self.annotate(list(made.values()))
            self._ahead.update(zip(positions, samples))
            ready = []
            while self._written in self._ahead:  # the samples that now follow the shard's written ones
                ready.append(self._ahead.pop(self._written))
                self._written += 1
            if ready:
                self.sink.submit(self._work, ready)  # returns once the previous batch is durable
                self.on_samples(len(ready))
            log.debug("handed over %d samples of shard %06d (%d/%d)", len(ready), shard,
                      n_done + self._written, n_done + len(rows))
        return True

    def _keep_going(self, shard: int) -> bool:
        if not self.ctx.leader:
            return True
        if self.claimer.still_mine(shard):
            return True
        self.sink.flush()
        self._work.close()
        self.claimer.held.pop(shard, None)
        return False

    def _committed(self, shard: int, stats: dict | None) -> None:
        if stats is None:  # not committed here: taken over (the new holder commits it) or committed meanwhile
            if self.plan.run.is_done(shard):
                # committed by the holder this replica took it over from, whose release came before our claim: no
                # later holder will release our claim files, so we do (they would stay in claims/ for good)
                self.claimer.release(shard)
            else:  # the new holder's release removes our older generation with its own
                self.claimer.held.pop(shard, None)
            return
        self.claimer.release(shard)
        record_commit(self.plan.run, self.ctx.index, stats)  # logs/events.*.jsonl: the report's throughput
        if self.metrics:
            self.metrics.commit(stats, self.generated, self.gen_s)
        log.info("shard %06d committed: %d samples (%d failed, %d rejected)", shard, stats["count"], stats["failed"],
                 stats["rejected"])
        if self.uploader is not None:
            self.uploader.submit(shard)

    def _check_broken(self, samples) -> None:
        generated = [s for s in samples if s.status != "rejected"]
        if generated and all(s.status == "failed" for s in generated):
            self._failed_batches += 1
            if self._failed_batches >= MAX_FAILED_BATCHES:
                raise BrokenSetupError(
                    f"every sample of the last {MAX_FAILED_BATCHES} batches failed, last with: {generated[-1].failure}. "
                    "Stopping so a broken setup does not mark the whole run failed; fix it and re-run the same "
                    "command (the failed samples are recorded; retry_failed=true regenerates them).")
        elif generated:
            self._failed_batches = 0
