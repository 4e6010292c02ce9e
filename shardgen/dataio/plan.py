"""The work plan: the prompt file cut into numbered shards of contiguous row indices, fixed once.

The plan does not copy the rows: it stores, per shard, where its first row starts in the prompt
file (a byte offset and line number; for parquet the row number). The prompt file is checked
unchanged by the run's fingerprint (its SHA-256) on every launch, so a shard's rows are read back
from it when the shard is generated. Planning 100M short prompts takes seconds and a few MB
(benchmarks/plan_scale.py; figures in docs/dataset.md).

Also the pure rules every rank must agree on: a sample's key and seed from its row index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import logging

import numpy as np

from shardgen.dataio import prompts as P
from shardgen.dataio.rundir import pid_alive as _pid_alive
from shardgen.dataio.rundir import RunDir, atomic_write_json, read_json
from shardgen.dataio.truncation import TruncationCheck
from shardgen.errors import UserError

log = logging.getLogger("shardgen.plan")
PLAN_VERSION = 2
TRUNCATED_REJECT = "the prompt is longer than a text encoder keeps (prompts.on_truncation=skip)"
STALE_TMP_S = 3600  # a planning temp dir from another host untouched this long belongs to a dead planner
_BLOCK = 16 << 20   # txt planning reads the file in blocks of this many bytes
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


class PlanError(UserError, RuntimeError):
    """The run's plan is missing a file or unreadable; the message names the file and the fix."""


@dataclass(frozen=True)
class PlannedRow:
    """One prompt row as a shard reads it."""

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
class PromptSource:
    """The prompt file and how to read it (``prompts.*`` of the config)."""

    path: str
    format: str = "auto"
    field: str = "prompt"
    seed_field: str = "seed"
    on_bad_row: str = "error"
    limit: int | None = None

    @classmethod
    def from_cfg(cls, prompts: Any, path: str | os.PathLike) -> "PromptSource":
        """From a PromptsConfig and the resolved path of its file."""
        return cls(path=str(path), format=P.detect_format(str(path), prompts.format), field=prompts.field,
                   seed_field=prompts.seed_field, on_bad_row=prompts.on_bad_row, limit=prompts.limit)


@dataclass(frozen=True)
class Plan:
    """The fixed split of a run's prompt rows into shards."""

    run: RunDir
    num_rows: int
    samples_per_shard: int
    num_shards: int
    num_rejects: int
    prompt_file: str
    meta: dict | None = None            # plan.json
    starts: np.ndarray | None = None    # (num_shards, 2): byte offset (parquet: row) and line of each shard's first row

    def shard_range(self, shard: int) -> range:
        """Row indices of ``shard``."""
        start = shard * self.samples_per_shard
        return range(start, min(start + self.samples_per_shard, self.num_rows))

    def rows(self, shard: int) -> list[PlannedRow]:
        """The rows of ``shard``, in index order, read from the prompt file."""
        if self.starts is None:  # a version-1 plan: the rows were copied into plan/
            with open(self.run.plan_dir / f"{shard:06d}.jsonl", encoding="utf-8") as f:
                return [PlannedRow(**json.loads(line)) for line in f]
        m = self.meta
        src = PromptSource(**m["source"])
        _check_unchanged(src.path, m["prompt_size"])
        rng = self.shard_range(shard)
        offset, line = (int(x) for x in self.starts[shard])
        cut = self._truncated(rng)
        return [PlannedRow(index=r.index, line=r.line, prompt=r.prompt, extra=r.extra,
                           reject=r.reject or (TRUNCATED_REJECT if r.index in cut else None),
                           seed=sample_seed(m["run_seed"], r.index, r.seed))
                for r in _read_rows_at(src, offset, line, rng.start, len(rng))]

    def _truncated(self, rng: range) -> set[int]:
        """The row indices in ``rng`` planned as rejects for being truncated (prompts.on_truncation=skip)."""
        path = self.run.plan_dir / "truncated.npy"
        if not path.exists():
            return set()
        cut = np.load(path, mmap_mode="r")
        lo, hi = np.searchsorted(cut, [rng.start, rng.stop])
        return set(cut[lo:hi].tolist())


def _plan_error(path: Path, what: str) -> PlanError:
    return PlanError(f"{path}: {what}. The plan is derived from the prompt file, which the run's fingerprint checks: "
                     f"delete {path.parent} and re-run the same command to rebuild it (committed shards stay valid).")


def load_plan(run: RunDir) -> Plan | None:
    """The run's plan, or None if it has none yet; PlanError when it is damaged."""
    clean_stale_tmp(run)
    if not run.plan_dir.exists():
        return None
    path = run.plan_dir / "plan.json"
    try:
        meta = read_json(path)
        kw = {k: meta[k] for k in ("num_rows", "samples_per_shard", "num_shards", "num_rejects", "prompt_file")}
    except FileNotFoundError:
        raise _plan_error(path, "missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise _plan_error(path, f"unreadable ({type(e).__name__}: {e})") from None
    if meta.get("version", 1) == 1:
        return Plan(run=run, **kw)
    starts_path = run.plan_dir / "starts.npy"
    try:
        starts = np.load(starts_path, allow_pickle=False)
    except FileNotFoundError:
        raise _plan_error(starts_path, "missing") from None
    except (ValueError, OSError, EOFError) as e:  # numpy says EOFError for an empty file
        raise _plan_error(starts_path, f"unreadable ({type(e).__name__}: {e})") from None
    if starts.shape != (kw["num_shards"], 2):
        raise _plan_error(starts_path, f"has shape {starts.shape}, plan.json says {kw['num_shards']} shards")
    if meta.get("starts_sha256") not in (None, _digest(starts)):
        raise _plan_error(starts_path, "does not match the checksum in plan.json (changed after planning)")
    return Plan(run=run, meta=meta, starts=starts, **kw)


def _digest(starts: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(starts, dtype=np.int64).tobytes()).hexdigest()


def clean_stale_tmp(run: RunDir) -> None:
    """Remove planning temp dirs left by killed planners (``.plan-HOST-PID-*``): on this host when
    the pid is gone, elsewhere when untouched for STALE_TMP_S. Never a live planner's, even once a
    plan exists: a job racing to plan the same run is still writing into its own and adopts the
    winner's plan when its rename loses."""
    if not run.root.exists():
        return
    for d in run.root.glob(".plan-*"):
        try:
            host, pid = d.name.split("-")[1:3]
            dead = (host == _host() and not _pid_alive(int(pid))) or \
                time.time() - d.stat().st_mtime > STALE_TMP_S
        except (ValueError, OSError):
            dead = True
        if dead:
            shutil.rmtree(d, ignore_errors=True)


def _host() -> str:
    return socket.gethostname().replace("-", "_")  # "-" separates the temp dir name's fields


def build_plan(run: RunDir, source: PromptSource, *, samples_per_shard: int, run_seed: int,
               truncation: TruncationCheck | None = None) -> Plan:
    """Scan the prompt file once (validating every row), write the plan atomically, return it.

    The plan goes into a temporary directory renamed to ``plan/`` at the end, so a bad row half-way
    (the reader raises) leaves no plan behind, and when two jobs race the first rename wins and the
    other adopts it. Memory stays constant in the number of rows. ``truncation`` finds the prompts
    a text encoder will cut, and warns, refuses or plans them as rejects (prompts.on_truncation).
    """
    run.root.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(run)
    tmp = Path(tempfile.mkdtemp(prefix=f".plan-{_host()}-{os.getpid()}-", dir=run.root))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the plan is read by every job sharing the run
    try:
        scan = _scan_txt if source.format == "txt" else _scan_rows
        num_rows, num_rejects, starts = scan(source, samples_per_shard, truncation)
        if num_rows == 0:
            raise P._fail(source.path, 0, "the prompt file has no rows (only a header, or only a byte-order mark)",
                          "Add prompts, or point prompts.path at the right file")
        cut = _truncation_outcome(source, truncation)
        if cut is not None:
            np.save(tmp / "truncated.npy", cut)
            num_rejects += len(cut)
        np.save(tmp / "starts.npy", starts)
        atomic_write_json(tmp / "plan.json", dict(
            version=PLAN_VERSION, num_rows=num_rows, num_rejects=num_rejects, samples_per_shard=samples_per_shard,
            num_shards=len(starts), prompt_file=source.path, prompt_size=os.path.getsize(source.path),
            run_seed=run_seed, source=source.__dict__, starts_sha256=_digest(starts)))
        try:
            os.rename(tmp, run.plan_dir)
        except OSError:
            if load_plan(run) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_plan(run)


# ---------------------------------------------------------------- shard sizing

TARGET_SHARD_BYTES = 300_000_000  # a few hundred MB: big enough for streaming reads, small enough to redo
SHARDS_PER_REPLICA = 4            # when the prompts allow: a replica that finishes early takes another shard
MAX_SAMPLES_PER_SHARD = 100_000
# Bytes per pixel of an encoded sample (generated 1024x1024 images: png ~1.5 MB with compress_level=1; an mp4:
# per pixel of each frame, H.264 at crf 18 ~0.3).
BYTES_PER_PIXEL = {"png": 1.5, "jpg": 0.4, "webp": 0.3, "mp4": 0.3}


def sample_bytes_estimate(*, width: int, height: int, image_format: str, frames: int = 1) -> float:
    """About how many bytes one encoded sample takes in a tar (``image_format`` mp4: a video of ``frames``)."""
    return BYTES_PER_PIXEL.get(image_format, 1.5) * width * height * max(1, frames)


def choose_samples_per_shard(num_rows: int, *, width: int, height: int, image_format: str, replicas: int,
                             batch_size: int, frames: int = 1) -> tuple[int, str]:
    """(samples per shard, why): about TARGET_SHARD_BYTES of images per shard, but at least
    SHARDS_PER_REPLICA shards per replica when the prompts allow, and never below a batch.
    ``image_format`` mp4 with ``frames``: a video run."""
    sample_bytes = sample_bytes_estimate(width=width, height=height, image_format=image_format, frames=frames)
    by_size = max(1, int(TARGET_SHARD_BYTES // sample_bytes))
    by_spread = -(-num_rows // (SHARDS_PER_REPLICA * max(1, replicas)))
    n = min(MAX_SAMPLES_PER_SHARD, max(min(by_size, by_spread), min(batch_size, by_size)))
    what = f"{width}x{height} {image_format}" + (f" of {frames} frames" if image_format == "mp4" else "")
    why = (f"~{sample_bytes / 1e6:.2f} MB per {what} sample: {by_size} fit in "
           f"{TARGET_SHARD_BYTES / 1e6:.0f} MB; {num_rows} prompts over {replicas} replica(s) x {SHARDS_PER_REPLICA} "
           f"shards: {by_spread}; at least a batch ({batch_size})")
    return max(1, n), why


def estimate_rows(source: PromptSource) -> int:
    """About how many rows the prompt file has (lines; parquet: its metadata), for shard sizing only."""
    if source.format == "parquet":
        n = P._parquet_file(source.path).metadata.num_rows
    else:
        n, last = 0, b"\n"
        with open(source.path, "rb") as f:
            while block := f.read(_BLOCK):
                n, last = n + block.count(b"\n"), block[-1:]
        n += last != b"\n"  # a last line without a newline
        if source.format in ("csv", "tsv"):  # the header line is not a prompt (quoted newlines still overcount)
            n = max(0, n - 1)
    return min(n, source.limit) if source.limit is not None else n


def resolve_samples_per_shard(requested: int | None, source: PromptSource, **run) -> int:
    """``requested`` if set, else the choice of ``choose_samples_per_shard`` (logged with its reasons);
    ``run``: width, height, image_format, replicas, batch_size."""
    if requested is not None:
        return requested
    n, why = choose_samples_per_shard(estimate_rows(source), **run)
    log.info("samples_per_shard=%d (chosen: %s; set samples_per_shard=N to choose)", n, why)
    return n


def idle_warning(num_shards: int, replicas: int, samples_per_shard: int) -> str | None:
    """A warning when this launch has more replicas than shards (the extra ones have nothing to do)."""
    if num_shards >= replicas:
        return None
    return (f"{replicas} replicas but only {num_shards} shard(s) of {samples_per_shard}: {replicas - num_shards} "
            f"replica(s) will have nothing to do. Lower samples_per_shard (or leave it unset to size shards "
            "for the ranks) on a new run_dir.")


# ---------------------------------------------------------------- planning scans

def _truncation_outcome(source: PromptSource, check: TruncationCheck | None) -> np.ndarray | None:
    """Warn about or refuse the truncated prompts; with on_truncation=skip, their indices (to reject)."""
    message = check.report(source.path) if check else None
    if message is None:
        return None
    if check.policy == "error":
        raise P.PromptFileError(f"{message}. Shorten them, or set prompts.on_truncation=warn to generate them "
                                "truncated (flagged in each sample's json), or skip to record them as rejects")
    if check.policy == "skip":
        log.warning("%s: recorded as rejects (prompts.on_truncation=skip)", message)
        return np.asarray(sorted(check.truncated), dtype=np.int64)
    log.warning("%s: generated from their first tokens and flagged \"truncated\": true in their json and index "
                "(prompts.on_truncation=skip or error refuses them)", message)
    return None


def _scan_rows(source: PromptSource, per_shard: int, check: TruncationCheck | None = None
               ) -> tuple[int, int, np.ndarray]:
    """Any format: every row through the reader; shard starts from the rows' lines (parquet: row numbers)."""
    rows = P.read_prompts(source.path, format=source.format, field=source.field, seed_field=source.seed_field,
                          on_bad_row=source.on_bad_row)
    n = rejects = 0
    first_lines = []
    try:
        for row in rows:
            if source.limit is not None and row.index >= source.limit:
                break
            if row.index % per_shard == 0:
                first_lines.append(row.line)
            rejects += row.reject is not None
            if check and row.reject is None and len(row.prompt.encode("utf-8")) > check.min_bytes:
                check.offer(row.index, row.line, row.prompt)
            n += 1
    except P.PromptFileError as e:
        if "has no rows" not in str(e):
            raise
    lines = np.asarray(first_lines, dtype=np.int64)
    if source.format == "parquet":
        return n, rejects, np.stack([lines - 1, lines], axis=1) if n else np.zeros((0, 2), np.int64)
    return n, rejects, np.stack([_line_offsets(source.path, lines), lines], axis=1)


def _line_offsets(path: str, lines: np.ndarray) -> np.ndarray:
    """Byte offset where each (1-based, increasing) line of ``lines`` starts."""
    out = np.zeros(len(lines), dtype=np.int64)
    if not len(lines):
        return out
    base = newlines = 0  # bytes and newlines before the current block
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            # line L starts after newline number L-1 (1-based)
            want = (lines >= newlines + 2) & (lines <= newlines + len(nl) + 1)
            out[want] = base + nl[lines[want] - 2 - newlines] + 1
            base, newlines = base + len(block), newlines + len(nl)
    return out


def _scan_txt(source: PromptSource, per_shard: int, check: TruncationCheck | None = None
              ) -> tuple[int, int, np.ndarray]:
    """txt, fast: whole blocks checked with numpy (UTF-8, no empty or blank line); a block where
    a line may be bad goes through the exact per-line reader, for the same rejects and messages."""
    limit = source.limit if source.limit is not None else 1 << 62
    starts, rows, rejects, base, carry = [], 0, 0, 0, b""
    with open(source.path, "rb") as f:
        while rows < limit:
            data = f.read(_BLOCK)
            block = carry + data
            if not data:  # the last line may lack a newline
                carry = b""
            else:
                cut = block.rfind(b"\n") + 1
                block, carry = block[:cut], block[cut:]
            if not block:
                if not data:
                    break
                continue
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + 1
            if not data and (not len(ends) or ends[-1] != len(block)):
                ends = np.append(ends, len(block))
            ends = ends[:limit - rows]
            line_starts = np.concatenate([[0], ends[:-1]])
            first = rows  # index of the block's first row
            js = np.arange(-first % per_shard, len(ends), per_shard)  # the block's rows that start a shard
            starts += zip((base + line_starts[js]).tolist(), (first + js + 1).tolist())
            rejects += _check_block(source, block[:ends[-1]], line_starts, ends, first, base == 0)
            if check:
                _offer_long_lines(check, block, line_starts, ends, first)
            rows += len(ends)
            base += len(block)
            if not data:
                break
    return rows, rejects, np.asarray(starts, dtype=np.int64).reshape(-1, 2)


def _check_block(source: PromptSource, block: bytes, line_starts: np.ndarray, ends: np.ndarray, first: int,
                 at_file_start: bool) -> int:
    """Rejects in a block of whole lines (raises on a bad line unless on_bad_row=skip)."""
    b = np.frombuffer(block, np.uint8)
    # a prompt has a byte that is certainly not whitespace (33..126); a line without one may be blank
    solid = np.cumsum((b > 32) & (b < 127), dtype=np.int32)
    before = np.where(line_starts > 0, solid[np.maximum(line_starts - 1, 0)], 0)
    suspect = solid[ends - 1] - before == 0
    clean = block.isascii() or _utf8(block)
    if clean and not suspect.any() and not (at_file_start and block.startswith(P._BOM)):
        return 0
    rejects = 0
    for i, (s, e) in enumerate(zip(line_starts, ends)):
        raw = block[s:e]
        if at_file_start and i == 0 and raw.startswith(P._BOM):
            raw = raw[len(P._BOM):]
        row = P._emit(source.path, first + i, first + i + 1, source.on_bad_row, P._parse_txt, raw)
        rejects += row.reject is not None
    return rejects


def _offer_long_lines(check: TruncationCheck, block: bytes, line_starts: np.ndarray, ends: np.ndarray,
                      first: int) -> None:
    for j in np.flatnonzero(ends - line_starts - 1 > check.min_bytes).tolist():
        try:
            prompt = P._strip_eol(block[line_starts[j]:ends[j]]).decode("utf-8").lstrip("\ufeff")
        except UnicodeDecodeError:
            continue  # a reject, not a prompt
        if prompt.strip():
            check.offer(first + j, first + j + 1, prompt)


def _utf8(block: bytes) -> bool:
    try:
        block.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---------------------------------------------------------------- reading a shard back

def _check_unchanged(path: str, size: int) -> None:
    try:
        now = os.path.getsize(path)
    except OSError as e:
        raise P._fail(path, 0, f"the prompt file of this run cannot be read ({e.strerror})",
                      "Restore it: the run's shards are read from it") from None
    if now != size:
        raise P._fail(path, 0, f"the prompt file changed since the run was planned ({size} bytes then, {now} now)",
                      "Restore the original file, or start a new run_dir")


def _read_rows_at(src: PromptSource, offset: int, line: int, index: int, count: int) -> Iterator[P.PromptRow]:
    """``count`` rows from row ``index``, which starts at byte ``offset`` (parquet: row) and ``line``."""
    if src.format == "parquet":
        yield from _parquet_rows_at(src, index, count)
        return
    with open(src.path, "rb") as f:
        f.seek(offset)
        if src.format in ("csv", "tsv"):
            yield from _table_rows_at(src, f, line, index, count)
            return
        parse = P._parse_txt if src.format == "txt" else P._parse_jsonl
        args = () if src.format == "txt" else (src.field, src.seed_field)
        for i in range(count):
            raw = f.readline()
            if offset == 0 and i == 0 and raw.startswith(P._BOM):
                raw = raw[len(P._BOM):]
            yield P._emit(src.path, index + i, line + i, src.on_bad_row, parse, raw, *args)


def _table_rows_at(src: PromptSource, f, line: int, index: int, count: int) -> Iterator[P.PromptRow]:
    """csv/tsv records from ``f``'s position: the prompt reader, given the header line then the rest."""
    from itertools import chain, islice

    with open(src.path, "rb") as h:
        header = next(P._raw_lines(h))[1]
    # the reader numbers the header line 1 and this shard's first record line 2
    for r in islice(P._read_table(src.path, chain([header], f), src.format, src.field, src.seed_field,
                                  src.on_bad_row), count):
        yield P.PromptRow(r.index + index, r.line + line - 2, r.prompt, r.seed, r.extra, r.reject)


def _parquet_rows_at(src: PromptSource, index: int, count: int) -> Iterator[P.PromptRow]:
    pf = P._parquet_file(src.path)
    row_groups, first, pos = [], 0, 0  # the row groups that hold rows index..index+count-1
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if pos + n > index and pos < index + count:
            first = pos if not row_groups else first
            row_groups.append(g)
        pos += n
    table = pf.read_row_groups(row_groups).slice(index - first, count)
    for i, rec in enumerate(table.to_pylist()):
        yield P._emit(src.path, index + i, index + i + 1, src.on_bad_row, P._parse_parquet, rec, src.field,
                      src.seed_field)
