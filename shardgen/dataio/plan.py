"""The work plan: the prompt file cut into numbered shards of contiguous row indices, fixed once.

Also the pure rules every rank must agree on: a sample's key and seed from its row index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from shardgen.dataio.prompts import PromptRow
from shardgen.dataio.rundir import RunDir, atomic_write_json, read_json

PLAN_VERSION = 1
KEY_DIGITS = 10  # up to 10^10 prompts; webdataset keys must not contain dots


def sample_key(index: int) -> str:
    """The webdataset key of the sample of prompt row ``index``: stable, unique, zero-padded."""
    return f"{index:0{KEY_DIGITS}d}"


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def sample_seed(run_seed: int, index: int, row_seed: int | None = None) -> int:
    """Seed of one sample: the row's own seed if it has one, else a hash of (run seed, index).

    Hashing (not ``run_seed + index``) keeps runs with neighbouring seeds from sharing noise.
    The result fits ``torch.Generator.manual_seed`` (63 bits).
    """
    if row_seed is not None:
        return int(row_seed)
    return _splitmix64((run_seed << 34) ^ index) & 0x7FFFFFFFFFFFFFFF


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes (part of the run fingerprint)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class PlannedRow:
    """One prompt row as the plan stores it."""

    index: int
    line: int
    prompt: str | None
    seed: int
    extra: dict
    reject: str | None

    @property
    def key(self) -> str:
        return sample_key(self.index)


@dataclass(frozen=True)
class Plan:
    """The fixed split of a run's prompt rows into shards."""

    run: RunDir
    num_rows: int
    samples_per_shard: int
    num_shards: int
    num_rejects: int
    prompt_file: str

    def shard_range(self, shard: int) -> range:
        """Row indices of ``shard``."""
        start = shard * self.samples_per_shard
        return range(start, min(start + self.samples_per_shard, self.num_rows))

    def rows(self, shard: int) -> list[PlannedRow]:
        """The rows of ``shard``, in index order."""
        with open(self.run.plan_rows(shard), encoding="utf-8") as f:
            return [PlannedRow(**json.loads(line)) for line in f]


def load_plan(run: RunDir) -> Plan | None:
    """The run's plan, or None if it has none yet."""
    path = run.plan_dir / "plan.json"
    if not path.exists():
        return None
    meta = read_json(path)
    return Plan(run=run, num_rows=meta["num_rows"], samples_per_shard=meta["samples_per_shard"],
                num_shards=meta["num_shards"], num_rejects=meta["num_rejects"], prompt_file=meta["prompt_file"])


def _chunks(rows: Iterable[PromptRow], size: int) -> Iterator[list[PromptRow]]:
    chunk: list[PromptRow] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def build_plan(run: RunDir, rows: Iterable[PromptRow], *, samples_per_shard: int, run_seed: int,
               prompt_file: str) -> Plan:
    """Write the plan from a stream of prompt rows, atomically; return the run's plan.

    The rows are written into a temporary directory renamed to ``plan/`` at the end, so a
    bad row half-way (the reader raises) leaves no plan behind, and when two jobs race the
    first rename wins and the other adopts it. Memory stays constant in the number of rows.
    """
    run.root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".plan-", dir=run.root))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the plan is read by every job sharing the run
    try:
        num_rows = num_rejects = num_shards = 0
        for shard, chunk in enumerate(_chunks(rows, samples_per_shard)):
            lines = []
            for r in chunk:
                num_rejects += r.reject is not None
                lines.append(json.dumps(dict(index=r.index, line=r.line, prompt=r.prompt, extra=r.extra,
                                             reject=r.reject, seed=sample_seed(run_seed, r.index, r.seed)),
                                        ensure_ascii=False))
            (tmp / f"{shard:06d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
            num_rows += len(chunk)
            num_shards = shard + 1
        atomic_write_json(tmp / "plan.json", dict(
            version=PLAN_VERSION, num_rows=num_rows, num_rejects=num_rejects, samples_per_shard=samples_per_shard,
            num_shards=num_shards, prompt_file=str(prompt_file)))
        try:
            os.rename(tmp, run.plan_dir)
        except OSError:
            if load_plan(run) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_plan(run)
