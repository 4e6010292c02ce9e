"""One claimed shard generated batch by batch: its rows batched by shape, each batch through the pipeline, and the
samples handed to the writer in row order, so that what is durable of a shard is always a prefix of its rows (what
a resume continues after).

``ShardRun`` is one shard's rows and that ordering; ``ShardGenerator`` makes the batches of every shard the replica
works on, with what lasts from shard to shard: the settings (compile=auto changes them between batches), the input
images decoded a batch ahead, and the counts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from shardgen.dataio.shards import Sample, ShardSink, ShardWork
from shardgen.run.generation import GenSettings, ImagePrefetch, generate_batch, shape_batches
from shardgen.run.tally import BatchTally
from shardgen.run.watchdog import StallWatchdog
from shardgen.speed.autocompile import AutoCompile

log = logging.getLogger("shardgen.replica")  # the replica's logger: its lines read the same from every part of it


@dataclass
class ShardRun:
    """One shard being generated: its rows from the first one not yet durable on, which of them to make, and the
    samples made ahead of an earlier row, held until that row is made."""

    shard: int
    n_done: int                     # rows already durable (the checkpoint this run continues from)
    rows: list                      # the shard's rows from ``n_done`` on
    redo: set | None = None         # retry_failed: the row indices to generate again (None: every row)
    work: ShardWork | None = None   # leader: the shard's files, where the sink writes its samples
    carried: dict = field(default_factory=dict)  # retry_failed: the committed samples by key, for the rows kept
    written: int = 0                # rows handed over, from ``n_done`` on
    _ahead: dict = field(default_factory=dict)  # samples made before an earlier row, by position in ``rows``

    @property
    def made(self) -> int:
        """Rows of the shard made so far: durable before this run, handed over, or waiting for an earlier row."""
        return self.n_done + self.written + len(self._ahead)

    def todo(self, rows: list) -> list:
        """The rows of ``rows`` to generate (with ``redo``, only those)."""
        return rows if self.redo is None else [r for r in rows if r.index in self.redo]

    def in_order(self, positions: list[int], samples: list) -> list:
        """Take the samples of the rows at ``positions``; the samples that now follow the ones handed over, in row
        order (batches by shape make rows out of order; the shard's files take them in order)."""
        self._ahead.update(zip(positions, samples))
        ready = []
        while self.written in self._ahead:
            ready.append(self._ahead.pop(self.written))
            self.written += 1
        return ready


@dataclass
class MadeAhead:
    """Batches made before the run's first one with the settings the run goes on with (the quality gate's lossy
    pass over the plan's first rows, shardgen/quality/gate.py), which the run's batch of the same rows takes instead
    of making them again: their samples are the run's own."""

    settings: GenSettings
    batches: dict = field(default_factory=dict)  # the rows' indices -> (the samples, the seconds they took)

    def take(self, settings: GenSettings, rows: list) -> tuple[list, float] | None:
        """(samples, seconds) made ahead for exactly ``rows`` with settings making the same pixels as ``settings``
        and none failed; None: the batch is made now."""
        key = tuple(r.index for r in rows)
        if key not in self.batches or _as_made(settings) != _as_made(self.settings):
            self.batches.clear()  # the run went another way: the samples held are no longer wanted
            return None
        samples, seconds = self.batches.pop(key)
        return (samples, seconds) if all(smp.status == "ok" for smp in samples) else None


def _as_made(s: GenSettings) -> GenSettings:
    """``s`` as far as it decides a batch's pixels: not its mid-sample checkpoints (the calibration makes none), and
    the kernels' tuning only where the blocks are compiled (compile=auto's decider sets it apart from the run's)."""
    s = replace(s, latents=None)
    return s if s.accel.compile else replace(s, accel=replace(s.accel, compile_tuning=False))


@dataclass
class ShardGenerator:
    """Generates the rows of the shards a replica works on, batch by batch; the leader hands the samples to the sink.

    Every rank of a replica runs one: the other ranks compute alongside the leader and hand nothing over.
    """

    pipe: Any
    settings: GenSettings                  # the next batch's (compile=auto changes them between batches)
    batch_size: int
    ranks: int = 1                         # ranks computing each batch together (tp/cp degree)
    leader: bool = True                    # hands the samples over (the other ranks only compute)
    sink: ShardSink | None = None          # leader only
    annotate: Callable[[list], None] = lambda samples: None  # leader: provenance, token counts (dataio/shards/annotate.py)
    on_samples: Callable[[int], None] = lambda n: None       # samples handed over (the progress bar)
    on_batch: Callable[[str], None] = lambda event: None     # "start"/"end" around each batch's pipeline call
    keep_going: Callable[[int], bool] = lambda shard: True   # False once the shard was taken over by another replica
    autocompile: AutoCompile | None = None  # compile=auto on a one-rank replica: decided here, batch by batch
    watchdog: StallWatchdog = field(default_factory=lambda: StallWatchdog(None))  # times each batch
    tally: BatchTally = field(default_factory=BatchTally)  # counts what the batches made
    made_ahead: MadeAhead | None = None    # the calibration's lossy batches (one-rank replicas)
    # rows of the current shard made when its latest batch started, which compile=auto's count of the work left
    # takes off (set before each batch compile=auto decides for)
    done_in_shard: int = field(default=0, init=False)
    _images: ImagePrefetch | None = field(default=None, init=False)  # input images, decoded a batch ahead

    def generate(self, run: ShardRun) -> bool:
        """Generate the rows of ``run`` and hand them over; False when its shard was taken over by another replica
        first."""
        # batches by shape (prompts.row_settings): samples are still handed over in row order, so a resume
        # continues after the shard's n_done; what was made ahead of it is made again
        batches = shape_batches(self.settings, run.rows, self.batch_size)
        for i, batch in enumerate(batches):
            following = batches[i + 1] if i + 1 < len(batches) else []
            with self.watchdog.busy(f"shard {run.shard:06d}, batch from row {run.n_done + batch[0]}"):
                if not self._batch(run, batch, following):
                    return False
        return True

    def close(self) -> None:
        """Stop the input images' thread."""
        if self._images is not None:
            self._images.close()

    def _batch(self, run: ShardRun, positions: list[int], following: list[int]) -> bool:
        """Generate the rows at ``positions`` and hand over the samples now complete in row order; False when
        the shard was taken over by another replica. ``following``: the next batch's positions, whose input images
        are decoded meanwhile."""
        if not self.keep_going(run.shard):
            log.warning("shard %06d was taken over by another replica; leaving it", run.shard)
            return False
        batch = [run.rows[p] for p in positions]
        t0 = time.perf_counter()
        todo = run.todo(batch)
        if self.autocompile and todo:
            self.done_in_shard = run.made
            self.settings = self.autocompile.settings(self.settings)
        ahead = self.made_ahead.take(self.settings, todo) if self.made_ahead is not None and todo else None
        if ahead is None:  # a batch taken as made ahead has no pipeline call to hook
            self.on_batch("start")
        t_gen = time.perf_counter()
        if self._images is None:
            self._images = ImagePrefetch(bool(self.settings.input_image))
        images = self._images.take(todo)
        self._images.ahead(self.settings, run.todo([run.rows[p] for p in following]))
        if ahead is None:
            made = {smp.index: smp for smp in (generate_batch(self.pipe, self.settings, todo, self.ranks, images)
                                               if todo else [])}
            gen_s, earlier_s = time.perf_counter() - t_gen, 0.0
        else:  # made before the run started: timed then
            made, gen_s = {smp.index: smp for smp in ahead[0]}, ahead[1]
            earlier_s = gen_s
        if self.autocompile and todo:
            self.autocompile.observe(self.settings, sum(r.reject is None for r in todo), gen_s)
        if ahead is None:
            self.on_batch("end")
        samples = [made.get(r.index) or Sample.carried(r.key, run.carried[r.key]) for r in batch] if self.leader \
            else list(made.values())
        self.tally.count(list(made.values()), time.perf_counter() - t0 + earlier_s)
        if self.leader:
            self.annotate(list(made.values()))
            ready = run.in_order(positions, samples)
            if ready:
                self.sink.submit(run.work, ready)  # returns once the previous batch is durable
                self.on_samples(len(ready))
            log.debug("handed over %d samples of shard %06d (%d/%d)", len(ready), run.shard,
                      run.n_done + run.written, run.n_done + len(run.rows))
        return True
