"""The replica loop: claim a shard, continue it from its checkpoint, generate batch by batch, commit.

``ReplicaWorker`` coordinates three parts: which shard next (``ShardWalk``, shardwalk.py), the shard's batches
(``ShardGenerator``, shardrun.py) and what they made (``BatchTally``, tally.py). Only the replica's leader touches
the run directory; the other ranks of a model-parallel replica receive the same shard and rows from it and compute
alongside.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable

from parallel.world import broadcast_object
from shardgen.dataio.prompts import Plan
from shardgen.dataio.resume import checked_rows
from shardgen.dataio.rundir import Claimer, RankMetrics, record_commit
from shardgen.dataio.shards import ShardSink, ShardWork, committed_samples, committed_tar, read_shard_members
from shardgen.errors import ShardgenError, ends_job
from shardgen.run.generation import GenSettings
from shardgen.run.shardrun import MadeAhead, ShardGenerator, ShardRun
from shardgen.run.shardwalk import ShardWalk
from shardgen.run.stopping import stopping
from shardgen.run.tally import BatchTally
from shardgen.run.watchdog import StallWatchdog
from shardgen.speed.autocompile import AutoCompile

log = logging.getLogger("shardgen.replica")


@dataclass
class ReplicaContext:
    """Who this rank is within its replica."""

    index: int = 0            # dp index
    count: int = 1            # replicas in this job
    leader: bool = True
    leader_rank: int = 0      # global rank of the leader
    group: Any = None         # the replica's process group (None: a one-rank replica)
    ranks: int = 1            # ranks in this replica (tp/cp degree)
    peer: int = 0             # this replica's index among its world's (they share collectives: split work)
    peers: int = 1            # replicas in this process's world (launcher=ray starts several worlds side by side)


def expected_here(plan: Plan, shards_left: int, replicas: int) -> int:
    """Samples one of ``replicas`` replicas is expected to make of ``shards_left`` unfinished shards."""
    return shards_left * plan.samples_per_shard // max(1, replicas)


@dataclass
class ReplicaWorker:
    """Works through the run's shards until none is left for anyone.

    A context manager owning its sink, claimer, watchdog and progress bar (each may be None where this rank
    has none): leaving the block stops them all, even when one of them fails to close.
    """

    plan: Plan
    pipe: Any
    settings: InitVar[GenSettings]         # the first batch's: ``batches.settings`` holds the next batch's from here on
    batch_size: int
    ctx: ReplicaContext
    sink: ShardSink | None = None          # leader only
    claimer: Claimer | None = None         # leader only
    on_samples: Callable[[int], None] = lambda n: None  # leader: samples handed over (the progress bar)
    uploader: Any = None                   # leader with output_uri: a ShardUploader, on its own thread
    progress: Any = None                   # leader of replica 0: the progress bar
    on_batch: Callable[[str, "ReplicaWorker"], None] | None = None  # run_rank's hook: "start"/"end" of a batch
    poll_s: float = 2.0                    # the idle poll while others hold the last shards (``walk``)
    retry_failed: bool = False             # after the run is complete, regenerate recorded failures
    watchdog: StallWatchdog = field(default_factory=lambda: StallWatchdog(None))  # times each batch and commit
    annotate: Callable[[list], None] = lambda samples: None  # leader: provenance, token counts (dataio/shards/annotate.py)
    autocompile: AutoCompile | None = None  # compile=auto on a one-rank replica: decided batch by batch by ``batches``
    metrics: RankMetrics | None = None     # leader: the Prometheus file (metrics/), rewritten at each commit
    made_ahead: MadeAhead | None = None    # the quality gate's lossy samples, taken by the batch of their rows
    tally: BatchTally = field(default_factory=BatchTally, init=False)  # what the batches made
    walk: ShardWalk = field(init=False)          # which shard next (the leader claims)
    batches: ShardGenerator = field(init=False)  # generates each shard, batch by batch
    _work: ShardWork | None = field(default=None, init=False)  # leader: the current shard's files
    _old: dict = field(default_factory=dict, init=False)       # retry_failed: the shard's committed samples by key

    def __post_init__(self, settings: GenSettings) -> None:
        self.walk = ShardWalk(self.plan, self.claimer, self.ctx.index, self.ctx.count, self.poll_s,
                              wait_for_commits=lambda: self.sink.flush())
        self.batches = ShardGenerator(self.pipe, settings, self.batch_size, self.ctx.ranks, self.ctx.leader, self.sink,
                                      annotate=self.annotate, on_samples=self.on_samples, on_batch=self._batch_event,
                                      keep_going=self._keep_going, autocompile=self.autocompile,
                                      watchdog=self.watchdog, tally=self.tally, made_ahead=self.made_ahead)
        if self.autocompile is not None:  # compile=auto decides from this worker's work left, and sets its settings
            self.autocompile.remaining = self.remaining_here
            self.batches.settings = self.autocompile.settings(self.batches.settings)

    @property
    def generated(self) -> int:
        """Samples this worker generated (rejected rows are recorded, not generated)."""
        return self.tally.generated

    @property
    def gen_s(self) -> float:
        """Seconds its batches took."""
        return self.tally.gen_s

    def __enter__(self) -> "ReplicaWorker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if exc is not None and (isinstance(exc, (KeyboardInterrupt, ShardgenError)) or ends_job(exc) or stopping()):
            self._release_unfinished()

    def _release_unfinished(self) -> None:
        """After Ctrl-C or SIGTERM (or any error while this process is being stopped: ``stopping``), a stop shardgen
        makes on purpose (out of GPU memory, a setting that cannot work) or submitit's signal that the job's time is
        over, once close() made every handed-over batch durable and stopped the writer: give up the claims of the
        shards left unfinished, so that a re-run, a requeue or another replica resumes them from their checkpoints at
        once instead of waiting ``lease_s`` for the claims to expire. Not when the writer could still be writing (it
        outlived close's timeout): then the lease keeps the shard ours until it is done. A store that cannot be
        written now (the outage that stopped the launch) leaves the claims to expire: the stop's own error is what
        the user sees."""
        if self.claimer is None or not self.claimer.held or (self.sink is not None and self.sink.busy):
            return
        try:
            self.walk.release_unfinished()
        except Exception as e:  # noqa: BLE001 - never replaces the error that ended the launch
            log.warning("could not give up the unfinished shards' claims (%s: %s); they expire after lease_s",
                        type(e).__name__, str(e)[:200])

    def close(self) -> None:
        """Make every handed-over batch durable (the sink commits and releases its shards), wait for the uploads,
        then stop the watchdog, the claims' heartbeat, the progress bar and the input images' thread; each one even
        if an earlier one raises."""
        with contextlib.ExitStack() as stack:  # callbacks run last-in first-out
            parts = (self.batches, self.progress, self.claimer, self.watchdog, self.uploader, self.sink)
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

    def next_shard(self) -> tuple[int, int, int] | None:
        """(shard, claim generation, samples already done), waiting while others hold the last shards
        (``ShardWalk.next``); None once every shard is committed."""
        got = self.walk.next()
        if got is None:
            return None
        shard, gen = got
        self._work = self._open(shard, gen)
        return shard, gen, self._work.n_done

    def _next_retry(self) -> tuple[int, int, int, list[int]] | None:
        """(shard, gen, samples done, indices to regenerate) of a committed shard with failed samples."""
        got = self.walk.next_retry()
        if got is None:
            return None
        shard, gen, failed = got
        run = self.plan.run
        self._old, _ = committed_samples(run, shard, read_shard_members(committed_tar(run, shard), run.container))
        self._work = self._open(shard, gen, replaces=True)
        log.info("shard %06d: regenerating %d failed samples", shard, len(failed))
        return shard, gen, self._work.n_done, failed

    def remaining_here(self) -> int:
        """Samples this replica is still expected to make: the unfinished shards' share of one replica."""
        return max(0, expected_here(self.plan, self.walk.shards_left(), self.ctx.count) - self.batches.done_in_shard)

    def _share(self, obj):
        """The leader's ``obj``, on every rank of the replica."""
        if self.ctx.group is None:
            return obj
        return broadcast_object(obj, src=self.ctx.leader_rank, group=self.ctx.group)

    def _open(self, shard: int, gen: int, replaces: bool = False) -> ShardWork:
        if self.metrics:
            self.metrics.claimed()
        return ShardWork.open(self.plan.run, shard, gen, self.plan.shard_range(shard),
                              still_mine=lambda: self.claimer.still_mine(shard), replaces=replaces,
                              take_commit=lambda: self.claimer.take_commit(shard))

    def process(self, shard: int, gen: int, n_done: int, regenerate: list[int] | None = None) -> None:
        """Generate the shard's rows from ``n_done`` on (only ``regenerate`` ones, carrying the rest over), then
        commit it (the leader, through the sink)."""
        rows = checked_rows(self.plan, shard)[n_done:]
        if self.ctx.leader and n_done:
            log.info("shard %06d: resuming after %d samples (claim g%d)", shard, n_done, gen)
        run = ShardRun(shard, n_done, rows, redo=None if regenerate is None else set(regenerate), work=self._work,
                       carried=self._old)
        if not self.batches.generate(run):
            return
        self.walk.finished(shard)
        if self.ctx.leader:
            with self.watchdog.busy(f"committing shard {shard:06d}"):
                self.sink.commit(self._work, on_done=lambda stats, s=shard: self._committed(s, stats))

    def _batch_event(self, event: str) -> None:
        if self.on_batch:
            self.on_batch(event, self)

    def _keep_going(self, shard: int) -> bool:
        """Whether the replica goes on with ``shard``: the leader's answer, on every rank."""
        return self._share(self._still_ours(shard) if self.ctx.leader else True)

    def _still_ours(self, shard: int) -> bool:
        """The leader: whether ``shard`` is still claimed by this replica. When another replica took it over, what
        was handed over is made durable first, then the shard is left."""
        if self.claimer.still_mine(shard):
            return True
        self.sink.flush()
        self._work.close()
        self.walk.let_go(shard)
        return False

    def _committed(self, shard: int, stats: dict | None) -> None:
        """The sink's word on the commit of ``shard``: its stats, or None when not committed here (taken over, and
        the new holder commits it, or committed meanwhile). For a run kept in a bucket the upload is the commit: it
        is made here, before the claim is given up."""
        if stats is not None and self.uploader is not None and self.uploader.commits:
            self.uploader.upload(shard)
        self.walk.settle(shard, committed_here=stats is not None)
        if stats is None:
            return
        record_commit(self.plan.run, self.ctx.index, stats)  # logs/events.*.jsonl: the report's throughput
        if self.metrics:
            self.metrics.commit(stats, self.generated, self.gen_s)
        log.info("shard %06d committed: %d samples (%d failed, %d rejected)", shard, stats["count"], stats["failed"],
                 stats["rejected"])
        if self.uploader is not None and not self.uploader.commits:
            self.uploader.submit(shard)
