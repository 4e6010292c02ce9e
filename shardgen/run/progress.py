"""The progress bar of a run: images (or videos)/s and ETA over the whole run, not just this replica."""

from __future__ import annotations

import contextlib
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from shardgen.dataio.prompts import Plan
from shardgen.dataio.resume import read_ledger

RESYNC_S = 10.0  # how often the bar re-reads the run directory to count the other replicas' work


class Progress:
    """A tqdm bar over all samples of the plan, advanced by this replica and resynced from disk."""

    def __init__(self, plan: Plan, unit: str = "img"):
        """``unit``: what a sample is, for the rate ("img", "video")."""
        self.plan = plan
        self._stats_cache: dict = {}
        done = read_ledger(plan, stats_cache=self._stats_cache).done_samples
        self.bar = tqdm(total=plan.num_rows, initial=done, unit=unit, desc="generate", dynamic_ncols=True,
                        file=sys.stderr, smoothing=0.1,
                        mininterval=0.1 if sys.stderr.isatty() else 30.0)  # a log file gets a line per 30 s
        self._last_sync = time.monotonic()
        # while the bar is drawn, log lines go through tqdm.write: on their own line, the bar redrawn below them
        self._logs = contextlib.ExitStack()
        self._logs.enter_context(logging_redirect_tqdm())

    def advance(self, n: int) -> None:
        """Count ``n`` samples handed to the writer by this replica."""
        self.bar.update(n)
        if time.monotonic() - self._last_sync > RESYNC_S:
            self._resync()

    def _resync(self) -> None:
        self._last_sync = time.monotonic()
        done = read_ledger(self.plan, stats_cache=self._stats_cache).done_samples
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        """Show the run's final count (other replicas included) and close the bar."""
        try:
            self._resync()
        finally:
            self.bar.close()
            self._logs.close()
