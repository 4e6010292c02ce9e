"""Prometheus metrics of a run: a textfile-collector file per writing rank in ``metrics/``, rewritten atomically at
each shard commit, and read back (merged) by ``jobs.status RUN --prometheus``.

A rank's file holds this process's counters since it started (a new launch starts them again, which Prometheus
reads as a counter reset); the run's own figures (samples done, shards by state) come from the run directory.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shardgen.dataio.rundir.fileio import atomic_write_bytes, read_regular
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.storage import RunDirError

log = logging.getLogger("shardgen")
LABELS = ("run", "rank", "replica", "host", "job")
STATUSES = ("ok", "failed", "rejected")


def exposition(families: Iterable[Metric]) -> bytes:
    """The Prometheus text format of ``families``."""
    from prometheus_client import CollectorRegistry, generate_latest

    families = list(families)

    class Families:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry)


def _world_of_launch() -> str:
    """Which of a launch's side-by-side worlds this is (launcher=ray: each replica's rank 0 is a rank 0), or ""."""
    from shardgen.config.launchers import REPLICA_SLOT_ENV, replica_slot

    return f"ray-replica{replica_slot()[0]}" if os.environ.get(REPLICA_SLOT_ENV) else ""


@dataclass
class RankMetrics:
    """One writing rank's counters (a replica's leader); ``commit`` updates them and rewrites its file."""

    run: RunDir
    rank: int
    replica: int
    ranks_per_replica: int = 1
    """Devices busy in each batch: device-seconds are the batches' wall seconds times this."""
    job: str = field(default_factory=lambda: os.environ.get("SLURM_JOB_ID", "") or _world_of_launch())
    started: float = field(default_factory=time.time)
    committed: Counter = field(default_factory=Counter)
    shards: int = 0
    claims: int = 0
    generated: int = 0
    gen_s: float = 0.0
    last_commit: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def path(self) -> Path:
        return self.run.metrics_path(self.rank, self.job)

    def claimed(self) -> None:
        """A shard claimed (counted at the next write)."""
        self.claims += 1

    def commit(self, stats: dict, generated: int, gen_s: float) -> None:
        """A shard committed by this rank: add its counts, take the worker's totals, rewrite the file (called from
        the writer thread that committed it)."""
        with self._lock:
            self.committed.update({s: stats.get(s, 0) for s in STATUSES})
            self.shards += 1
            self.generated, self.gen_s, self.last_commit = generated, gen_s, time.time()
            self.write()

    def write(self) -> None:
        """Rewrite the file (at the start, so a rank that never commits shows its zeros, and at each commit)."""
        try:
            self.run.metrics_dir.mkdir(exist_ok=True)
            self.run.check_own_dirs([self.run.metrics_dir])  # a link swapped in since the launch's check
            atomic_write_bytes(self.path, exposition(self.families()))
        except (OSError, RunDirError) as e:  # the metrics are for watching: a full disk shows in the shards' own writes
            log.warning("could not write %s (%s); the next commit tries again", self.path, e)

    def families(self) -> list[Metric]:
        values = [self.run.name, str(self.rank), str(self.replica), socket.gethostname(), self.job]
        device_s = self.gen_s * self.ranks_per_replica
        samples = CounterMetricFamily("shardgen_committed_samples", "Samples in the shards this rank committed, by "
                                      "status", labels=[*LABELS, "status"])
        for status in STATUSES:
            samples.add_metric([*values, status], self.committed[status])
        out = [samples]
        for name, kind, doc, value in (
                ("shardgen_committed_shards", "counter", "Shards this rank committed", self.shards),
                ("shardgen_claims", "counter", "Shards this rank claimed (one per shard it worked on)", self.claims),
                ("shardgen_generated_samples", "counter", "Samples this rank's pipeline calls made", self.generated),
                ("shardgen_device_seconds", "counter", "Wall seconds of this replica's batches times its devices",
                 device_s),
                ("shardgen_device_seconds_per_sample", "gauge", "Device seconds per generated sample",
                 device_s / self.generated if self.generated else 0.0),
                ("shardgen_samples_per_second", "gauge", "Generated samples per second since this process started",
                 self.generated / max(1e-9, time.time() - self.started)),
                ("shardgen_start_time_seconds", "gauge", "When this process started (unix time)", self.started),
                ("shardgen_last_commit_time_seconds", "gauge", "When this rank last committed a shard (unix time)",
                 self.last_commit)):
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=LABELS)
            family.add_metric(values, value)
            out.append(family)
        return out


MAX_PROM_BYTES = 1 << 20  # a rank's file is a few kB; one larger is not shardgen's


def read_rank_metrics(run: RunDir) -> list[Metric]:
    """Every rank file of ``run`` (``metrics/*.prom``), families of the same name merged; an unreadable or damaged
    file is skipped (it is rewritten at its rank's next commit)."""
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    paths = sorted(run.metrics_dir.glob("*.prom")) if run.metrics_dir.is_dir() else []
    for path in paths:
        try:
            text = read_regular(path, follow=False, limit=MAX_PROM_BYTES).decode("utf-8")
            families = list(text_string_to_metric_families(text))
        except (OSError, ValueError, RunDirError):  # a FIFO, a device, a link, too large, damaged: skipped
            continue
        for family in families:
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            into.samples += family.samples
    return list(merged.values())
