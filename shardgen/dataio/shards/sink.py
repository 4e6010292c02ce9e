"""The background writer: image encoding and tar writes off the generation loop's hot path.

The loop hands over batch k and goes on computing batch k+1 while a writer thread encodes
(on a small thread pool: PIL releases the GIL while compressing) and appends batch k, then
fsyncs and checkpoints it. Before handing over batch k+1 the loop waits for batch k's
checkpoint, so at any instant at most one finished batch per replica is not yet durable:
that bounds what a kill can lose. The time spent in that wait is measured (``wait_s``).

A shard's commit is queued behind its last batch without waiting for it: a short run's shards
hold one batch each, and waiting there left the GPU idle while that batch's images were encoded
(H200, FLUX.1-dev, shards of 4: 0.47 s of every 15 s batch). After a writer error nothing more is
written (a shard whose batch failed is never committed); the caller raises at its next call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from shardgen.dataio.shards.formats import encode_image
from shardgen.dataio.shards.shardwork import Sample, ShardWork
from shardgen.errors import is_user_error

log = logging.getLogger("shardgen.sink")


class ShardSink:
    """Writes batches of samples into ShardWork objects on a background thread."""

    CLOSE_TIMEOUT_S = 60.0  # how long close() waits for the writer's last item before leaving it behind

    def __init__(self, image_format: str = "png", quality: int = 95, threads: int = 2, signals=None,
                 encoder: Callable[[Sample], bytes] | None = None):
        """``signals``: curation signals (shardgen/dataio/shards/signals.py), computed before encoding (images only).
        ``encoder(sample) -> bytes`` replaces the image encoder; its ``ext`` names the member (video runs:
        shardgen/dataio/shards/video.py's VideoEncoder writes ``{key}.mp4``)."""
        self.fmt, self.quality = (encoder.ext if encoder else image_format), quality
        self.signals = signals if encoder is None else None
        self._encoder = encoder or (lambda s: encode_image(s.pixels, self.fmt, self.quality))
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shardgen-encode")
        # unbounded, but submit() waits for everything before it: at most a batch and its shard's commit queued
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0          # items handed over and not yet written (or dropped after an error)
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self.wait_s = 0.0          # time the caller spent blocked on the writer
        self.write_s = 0.0         # time the writer spent encoding + writing
        self._thread = threading.Thread(target=self._run, name="shardgen-writer", daemon=True)
        self._thread.start()

    def submit(self, work: ShardWork, samples: list[Sample]) -> None:
        """Queue a batch for ``work``; waits only until what was handed over before it is durable."""
        self.flush()
        self._enqueue(("batch", work, samples, None))

    def commit(self, work: ShardWork, on_done: Callable[[dict | None], None] | None = None) -> None:
        """Queue ``work.commit()`` behind its batches without waiting for them; ``on_done(stats)`` runs on the
        writer (stats None: the shard was taken over before its commit). Re-raises an earlier writer error."""
        self._raise_if_failed()
        self._enqueue(("commit", work, None, on_done))

    def flush(self) -> None:
        """Wait until everything handed over is durable; re-raise a writer error."""
        t0 = time.perf_counter()
        self.wait_idle(None)
        self.wait_s += time.perf_counter() - t0
        self._raise_if_failed()

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait (from any thread, e.g. a signal handler) until handed-over work is durable; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        """Flush, then stop the threads. A writer still busy after ``CLOSE_TIMEOUT_S`` (close reached through an
        error or a signal while a batch was in hand, on an overloaded filesystem) keeps its encoding pool: shutting
        the pool under it made its next submit fail (seen in the 1,000-replica simulation at load 400), the batch
        then lost to an error nobody read; the daemon thread ends with the item or with the process."""
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._thread.join(timeout=self.CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("the shard writer is still writing after %.0f s; leaving it to finish",
                            self.CLOSE_TIMEOUT_S)
            else:
                self._pool.shutdown(wait=True)

    @property
    def busy(self) -> bool:
        """True while the writer thread may still write (before close, or a writer close left writing)."""
        return self._thread.is_alive()

    def _enqueue(self, item) -> None:
        with self._done:
            self._pending += 1
        self._queue.put(item)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            if is_user_error(self._error):  # e.g. disk full: its message names the path and the fix
                raise self._error
            raise RuntimeError(f"shard writer failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, work, samples, on_done = item
            t0 = time.perf_counter()
            try:
                if self._error is not None:
                    pass  # dropped: a commit behind a batch that failed to write would commit a short shard
                elif kind == "batch":
                    work.write(samples, self._encode_all(samples), self.fmt)
                else:
                    stats = work.commit()
                    if on_done:
                        on_done(stats)
            except BaseException as e:  # surfaced in the caller's thread at its next call
                self._error = e
            self.write_s += time.perf_counter() - t0
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def _encode(self, s: Sample) -> bytes:
        if self.signals:
            s.pixels, s.meta["signals"] = self.signals.apply(s.pixels, s.prompt)
        return self._encoder(s)

    def _encode_all(self, samples: list[Sample]) -> list[bytes | None]:
        futures = [self._pool.submit(self._encode, s) if s.pixels is not None else None for s in samples]
        out = []
        for s, fut in zip(samples, futures):
            if fut is None:
                out.append(None)
                continue
            try:
                out.append(fut.result())
            except Exception as e:  # an encoding error is a per-sample failure, not a crash
                s.status, s.failure, s.pixels = "failed", f"encode: {e!r}", None
                out.append(None)
        return out
