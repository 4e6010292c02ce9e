"""The stall watchdog: a rank stuck inside one batch for ``stall_timeout_s`` exits instead of hanging.

A hung GPU (an Xid error often leaves CUDA calls blocked for ever), a peer that never enters a
collective, or a filesystem that stops answering do not kill the process: without this, the rank
keeps its shard claim alive (the heartbeat is a thread of its own) and the job idles until its time
limit. The watchdog only times work in progress (a batch, a commit); waiting for other replicas to
finish their shards is not a stall. On a stall it logs what it was doing, dumps every thread's
stack (where it hung), lets the writers finish what they were handed (bounded), and exits with
``STALL_EXIT_CODE``: the launcher then ends the job (``launcher.kill_on_bad_exit``), or on SLURM
requeues it first (``launcher.max_failures``, via an ``on_stall`` hook); either way the job continues from the
last durable batch.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

log = logging.getLogger("shardgen.watchdog")
STALL_EXIT_CODE = 3


class StallWatchdog:
    """Times each ``busy()`` section from a daemon thread; ``timeout_s=None`` disables it.

    ``on_stall`` hooks run, in order, with what stalled, before the rank exits (the writers drain there, and
    shardgen/launch/slurm.py requeues the job)."""

    def __init__(self, timeout_s: float | None, on_stall: Sequence[Callable[[str], object]] = (),
                 exit_fn: Callable[[int], object] = os._exit):
        self.timeout_s = timeout_s
        self.on_stall = list(on_stall)
        self.exit_fn = exit_fn  # os._exit: the main thread is the one that is stuck, so nothing else can stop it
        self._since: float | None = None
        self._what = ""
        self._stop = threading.Event()
        self._thread = None
        if timeout_s:
            self._thread = threading.Thread(target=self._watch, name="shardgen-watchdog", daemon=True)
            self._thread.start()

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Time the enclosed work (``what`` names it in the stall message)."""
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(5.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._stalled(time.monotonic() - since)
                return

    def _stalled(self, elapsed: float) -> None:
        log.critical("stalled: %s made no progress for %.0f s (stall_timeout_s=%s): a hung GPU, a peer that never "
                     "joined a collective, or a filesystem that stopped answering. Exiting with code %d so the job "
                     "ends instead of holding its shard; re-run the same command to continue (raise stall_timeout_s "
                     "if one batch legitimately takes this long). Where every thread was:", self._what, elapsed,
                     self.timeout_s, STALL_EXIT_CODE)
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        except (AttributeError, ValueError, OSError):  # no real stderr to write to
            pass
        for hook in self.on_stall:
            try:
                hook(f"stalled in {self._what}")
            except Exception as e:  # exiting matters more than what it could not save
                log.error("before exit: %s: %s", type(e).__name__, e)
        self.exit_fn(STALL_EXIT_CODE)  # log handlers flush on every record: nothing is left to flush
