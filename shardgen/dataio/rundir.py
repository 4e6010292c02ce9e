"""The run directory: one output directory holds everything needed to resume, audit or extend a run.

Layout (all names zero-padded shard ids)::

    RUN_DIR/
      config.yaml               resolved config of the first launch (later launches: config.<time>.yaml)
      fingerprint.json          what determines the pixels; a resume with other values is refused
      plan/plan.json            prompt file, row count, shard size, shard count (fixed once)
      plan/000000.jsonl         the rows of shard 0 (index, prompt, seed, extra, reject)
      shards/000000.tar         a committed shard (complete, readable)
      shards/000000.stats.json  written last: the shard's done marker
      work/000000.g3.tar        shard 0's partial tar, claim generation 3
      work/000000.g3.ckpt.json  its checkpoint: samples and tar bytes durably written
      claims/000000.g3          the claim of generation 3 (mtime = heartbeat)
      summary.json              totals, rewritten at the end of each launch
      logs/                     per-rank logs (SLURM)

Every file other processes may read is written whole: temp file, fsync, atomic rename.
That holds on NFS and Lustre, where rename within a directory is atomic.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; run files are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode())


def read_json(path: Path) -> Any:
    """Read a JSON file."""
    with open(path, "rb") as f:
        return json.loads(f.read())


def shard_name(shard: int) -> str:
    """Zero-padded shard id: 6 digits, like img2dataset and webdataset brace patterns expect."""
    return f"{shard:06d}"


def run_dir_arg(text: str) -> str:
    """A run directory given on the command line; ``run_dir=PATH`` (how jobs.generate spells it) is
    accepted too, so a command line can be reused between the tools."""
    return text[len("run_dir="):] if text.startswith("run_dir=") else text


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory; no I/O beyond ``create``."""

    root: Path

    @property
    def plan_dir(self) -> Path:
        return self.root / "plan"

    @property
    def shards_dir(self) -> Path:
        return self.root / "shards"

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    @property
    def claims_dir(self) -> Path:
        return self.root / "claims"

    @property
    def fingerprint_path(self) -> Path:
        return self.root / "fingerprint.json"

    @property
    def prompt_hash_path(self) -> Path:
        return self.root / "prompt_hash.json"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    def create(self) -> None:
        """Create the directory skeleton (idempotent)."""
        for d in (self.root, self.shards_dir, self.work_dir, self.claims_dir):
            d.mkdir(parents=True, exist_ok=True)

    def shard_tar(self, shard: int) -> Path:
        return self.shards_dir / f"{shard_name(shard)}.tar"

    def shard_stats(self, shard: int) -> Path:
        return self.shards_dir / f"{shard_name(shard)}.stats.json"

    def plan_rows(self, shard: int) -> Path:
        return self.plan_dir / f"{shard_name(shard)}.jsonl"

    def partial_tar(self, shard: int, gen: int) -> Path:
        return self.work_dir / f"{shard_name(shard)}.g{gen}.tar"

    def checkpoint(self, shard: int, gen: int) -> Path:
        return self.work_dir / f"{shard_name(shard)}.g{gen}.ckpt.json"

    def claim(self, shard: int, gen: int) -> Path:
        return self.claims_dir / f"{shard_name(shard)}.g{gen}"

    def done_shards(self) -> set[int]:
        """Shards whose stats file (the done marker) exists."""
        if not self.shards_dir.exists():
            return set()
        return {int(n[:6]) for n in os.listdir(self.shards_dir) if n.endswith(".stats.json") and n[:6].isdigit()}
