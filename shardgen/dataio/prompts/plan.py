"""The work plan: the prompt file cut into numbered shards of contiguous row indices, fixed once.

The plan does not copy the rows: it stores, per shard, where its first row starts in the prompt
file (a byte offset and line number; for parquet the row number). The prompt file is checked
unchanged by the run's fingerprint (its SHA-256) on every launch, so a shard's rows are read back
from it when the shard is generated, and only from bytes with the SHA-256 recorded for that shard when it
was planned (``plan/digests.npy``): a prompt file edited in place stops the run before a changed row is used,
while rows appended after the planned bytes extend the run (extend.py). Planning 100M short prompts takes seconds and a few MB
(benchmarks/plan_scale.py; figures in docs/dataset.md).

Also the pure rules every rank must agree on: a sample's key and seed from its row index.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import logging

import numpy as np

from shardgen.dataio.prompts import read as P
from shardgen.dataio.prompts.planscan import (LORA_REJECTS, check_etag, check_unchanged, file_identity, footer_plan,
                                              planned_from_footer, range_digests, read_range, read_rows_at,
                                              row_images, rows_digest, scan_rows, truncation_outcome)
from shardgen.dataio.prompts.formats import prompt_format
from shardgen.dataio.prompts.read import PromptSource
from shardgen.dataio.prompts.rowsettings import RowRules, Shape, shapes_json
from shardgen.dataio.prompts.truncation import TruncationCheck
from shardgen.dataio.rundir.fileio import NotRegularFileError, atomic_write_json, open_regular, read_json
from shardgen.dataio.rundir.layout import PLAN_TEMP_NAME, RunDir
from shardgen.dataio.rundir.liveness import host_name, pid_alive
from shardgen.dataio.rundir.remote import StorageError, identity, is_url, open_input, public_url, sizeof
from shardgen.errors import UserError

log = logging.getLogger("shardgen.plan")
PLAN_VERSION = 2
TRUNCATED_REJECT = "the prompt is longer than a text encoder keeps (prompts.on_truncation=skip)"
STALE_TMP_S = 3600  # a planning temp dir from another host untouched this long belongs to a dead planner
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
    if run_seed < _SHIFTED_SEEDS:
        key = (run_seed << 34) ^ index
    else:  # shifted by 34, a seed's bits above 30 would leave the 64-bit hash: hashed first, they all count
        key = _splitmix64(run_seed) ^ index
    return _splitmix64(key) & 0x7FFFFFFFFFFFFFFF


def image_seed(prompt_seed: int, image: int) -> int:
    """Seed of image ``image`` of a prompt whose first image has ``prompt_seed`` (``sample_seed``): image 0 keeps it
    (a run of one image per prompt makes the samples it always made), each further one a hash of (seed, image)."""
    if image == 0:
        return prompt_seed
    return _splitmix64(_splitmix64(prompt_seed) ^ image) & 0x7FFFFFFFFFFFFFFF


_SHIFTED_SEEDS = 1 << 30  # run seeds below this keep the (run_seed << 34) ^ index layout every run was made with


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20, size: int | None = None) -> str:
    """SHA-256 of a file's bytes (part of the run fingerprint); of its first ``size`` bytes if given."""
    h = hashlib.sha256()
    left = size if size is not None else 1 << 62
    with open_input(path) as f:
        while left and (block := f.read(min(chunk, left))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


class PlanError(UserError, RuntimeError):
    """The run's plan is missing a file or unreadable; the message names the file and the fix. ``fault``: the
    damage alone (the file and what is wrong), for a caller whose fix differs (an extended run's)."""

    def __init__(self, message: str, fault: str | None = None):
        super().__init__(message)
        self.fault = fault or message


@dataclass(frozen=True)
class PlannedRow:
    """One prompt row as a shard reads it."""

    index: int
    line: int
    prompt: str | None
    seed: int
    extra: dict
    reject: str | None
    settings: dict = field(default_factory=dict)
    """The generation settings the row sets (``prompts.row_settings``, rowsettings.py); {}: the run's."""
    prompt_index: int | None = None
    """With images_per_prompt > 1 or rows' own counts: the prompt row this sample is an image of (``index`` is the
    sample's own: prompt_index x images_per_prompt + image, or its place in row order); None with one image per
    prompt (``index`` is the row's)."""
    image: int | None = None
    """With images_per_prompt > 1 or rows' own counts: which image of its prompt, from 0."""

    @property
    def key(self) -> str:
        return sample_key(self.index)


@dataclass(frozen=True)
class Segment:
    """Rows appended to the run's prompt file after it was planned, planned as shards after all earlier
    ones (``plan/ext-NNNNNN/``: plan.json says when and which rows, starts.npy where its shards start)."""

    dir: Path
    meta: dict
    starts: np.ndarray
    digests: np.ndarray | None = None  # (its shards, 32): sha256 of each shard's rows (None: planned before digests)

    @property
    def first_shard(self) -> int:
        return self.meta["first_shard"]

    @property
    def first_row(self) -> int:
        return self.meta["first_row"]

    @property
    def end_row(self) -> int:
        return self.meta["first_row"] + self.meta["num_rows"]


@dataclass(frozen=True)
class Plan:
    """The fixed split of a run's prompt rows into shards (extended, never changed, by appended prompts)."""

    run: RunDir
    num_rows: int
    samples_per_shard: int
    num_shards: int
    num_rejects: int
    prompt_file: str
    meta: dict | None = None            # plan.json
    starts: np.ndarray | None = None    # (first plan's shards, 2): byte offset (parquet: row) and line of each shard's first row
    digests: np.ndarray | None = None   # (first plan's shards, 32): sha256 of each shard's rows (None: older plans)
    prompt_path: str | None = None      # where the prompt file is now (a run may move; its content may not)
    extensions: tuple[Segment, ...] = ()
    images: int = 1                     # images_per_prompt: num_rows and samples_per_shard count samples, each
    # prompt row being ``images`` samples (indices row x images + image); plan.json counts rows. num_rejects: rows
    sample_starts: np.ndarray | None = None  # rows with their own images_per_prompt: shard k's samples are
    # sample_starts[k]..sample_starts[k+1]-1, its rows' images in row order (samples.npy of each segment)
    prompt_rows: int | None = None      # prompt rows planned, where num_rows // images is not it

    @property
    def rows_per_shard(self) -> int:
        """Prompt rows per shard (a shard holds samples_per_shard = rows_per_shard x images samples)."""
        return self.samples_per_shard // self.images

    @property
    def num_prompts(self) -> int:
        """Prompt rows planned (num_rows counts samples)."""
        return self.prompt_rows if self.prompt_rows is not None else self.num_rows // self.images

    @property
    def per_row_images(self) -> bool:
        """Rows set their own images_per_prompt (prompts.row_settings): shards differ in samples."""
        return self.sample_starts is not None

    def _segment(self, shard: int) -> Segment | None:
        """The extension ``shard`` belongs to (None: the first plan)."""
        seg = None
        for ext in self.extensions:
            if ext.first_shard <= shard:
                seg = ext
        return seg

    def shard_range(self, shard: int) -> range:
        """Sample indices of ``shard`` (its rows' indices, with one image per prompt)."""
        if self.sample_starts is not None:
            return range(int(self.sample_starts[shard]), int(self.sample_starts[shard + 1]))
        rows = self.row_range(shard)
        return range(rows.start * self.images, rows.stop * self.images)

    def row_range(self, shard: int) -> range:
        """Prompt row indices of ``shard``."""
        seg = self._segment(shard)
        first_shard, first_row, end = (0, 0, self.meta["num_rows"] if self.meta else self.num_rows) if seg is None \
            else (seg.first_shard, seg.first_row, seg.end_row)
        start = first_row + (shard - first_shard) * self.rows_per_shard
        return range(start, min(start + self.rows_per_shard, end))

    def rows(self, shard: int) -> list[PlannedRow]:
        """The rows of ``shard``, in index order, read from the prompt file."""
        if self.starts is None:  # a version-1 plan: the rows were copied into plan/
            with open_regular(self.run.plan_dir / f"{shard:06d}.jsonl") as f:
                return [PlannedRow(**json.loads(line)) for line in f]
        m = self.meta
        seg = self._segment(shard)
        src = PromptSource(**dict(m["source"], path=self.prompt_path or m["source"]["path"]))
        check_unchanged(src.path, (seg.meta if seg else m)["prompt_size"])
        rng = self.row_range(shard)
        where = self.run.plan_dir if seg is None else seg.dir
        cut = _truncated(self.run, where / "truncated.npy", rng)
        if (seg.digests if seg else self.digests) is None:  # planned before shard digests, or from a remote footer
            check_etag(src.path, m.get("prompt_etag"))
            offset, line = (int(x) for x in (seg or self).starts[shard - (seg.first_shard if seg else 0)])
            rows = list(read_rows_at(src, offset, line, rng.start, len(rng)))
        else:
            rows = self._checked_rows(src, shard, seg, rng)
        self._check_adapters(rows)
        bad = self.image_rejects if "image" in getattr(self.row_rules, "names", ()) else {}
        several, out, index = self.images > 1 or self.per_row_images, [], self.shard_range(shard).start
        for r in rows:
            reject = r.reject or (TRUNCATED_REJECT if r.index in cut else None) or bad.get(str(r.index))
            seed, count = sample_seed(m["run_seed"], r.index, r.seed), row_images(r.settings, self.images)
            out += [PlannedRow(index=index + k, line=r.line, prompt=r.prompt, extra=r.extra, settings=r.settings,
                               reject=reject, seed=image_seed(seed, k), prompt_index=r.index if several else None,
                               image=k if several else None) for k in range(count)]
            index += count
        return out

    def _check_adapters(self, rows: list[P.PromptRow]) -> None:
        """Each row's LoRA files (prompts.row_settings=[loras]) hold what they held when the run was planned, and a
        row planned with usable adapters still has them: a file gone since (a disk not mounted, a bucket down) is a
        LoraError that stops the run with the row still to be made, never a reject committed for good."""
        planned = self.adapters() if any(r.settings.get("loras") for r in rows) else {}
        was_rejected = self.lora_rejects if any(r.reject and r.reject.startswith("loras:") for r in rows) else None
        for r in rows:
            if was_rejected is not None and r.reject and r.reject.startswith("loras:") \
                    and str(r.index) not in was_rejected:
                from shardgen.models.lora import LoraError

                raise LoraError(f"{self.prompt_path or self.meta['source']['path']}:{r.line}: {r.reject} (it was "
                                "usable when the run was planned); put it back and re-run: its rows are still to "
                                "be made")
            for lo in r.settings.get("loras", ()):
                if lo.sha256 not in planned:
                    from shardgen.models.lora import LoraError

                    raise LoraError(f"{self.prompt_path or self.meta['source']['path']}:{r.line}: loras: {lo.path} "
                                    f"(sha256 {lo.sha256[:16]}...) is not the file this row named when the run was "
                                    "planned; restore it, or start a new run_dir")

    def _checked_rows(self, src: PromptSource, shard: int, seg: Segment | None, rng: range) -> list[P.PromptRow]:
        """The rows of ``shard`` parsed from exactly the bytes (parquet: the rows) whose digest the plan recorded:
        a prompt file edited since planning, even to the same size, is refused before any of it is used. Rows
        appended after the planned bytes are outside every planned shard's range: they change no digest."""
        part = seg or self
        i = shard - (seg.first_shard if seg else 0)
        offset, line = (int(x) for x in part.starts[i])
        fmt = prompt_format(src.format)
        if not fmt.lines:  # numbered rows: hashed as read
            rows = list(read_rows_at(src, offset, line, rng.start, len(rng)))
            digest = rows_digest(rows)
        else:
            end = int(part.starts[i + 1][0]) if i + 1 < len(part.starts) else part.meta["rows_end"]
            head_end = int(self.starts[0][0]) if fmt.header else 0  # the header line
            head, data, digest = read_range(src.path, head_end, offset, end)
        if digest != part.digests[i].tobytes():
            raise P.PromptFileError(
                f"{src.path}: the prompt file changed since the run was planned (the rows of shard {shard:06d}, "
                f"lines from {line}, differ from the plan's); the run stops so that no shard mixes two versions of "
                "its input. Restore the original file and re-run (appending rows is allowed: it extends the run), "
                "or start a new run_dir for the new file")
        if not fmt.lines:
            return rows
        with data:
            return list(read_rows_at(src, offset, line, rng.start, len(rng), data, head))

    @property
    def covered(self) -> tuple[int, str | None]:
        """(bytes of the prompt file planned, their SHA-256 when recorded): where an append starts."""
        m = self.extensions[-1].meta if self.extensions else self.meta
        return m["prompt_size"], m.get("prompt_sha256")

    @property
    def planned_hashes(self) -> list[str | None]:
        """The prompt file's SHA-256 as the plan and then each extension planned it (None where not recorded): the
        run's fingerprint names one of them, the last unless a launch stopped between an extension and its
        fingerprint update."""
        return [m.get("prompt_sha256") for m in [self.meta or {}] + [e.meta for e in self.extensions]]

    def lost_extension(self, prompts_sha256: str | None) -> str | None:
        """Why this plan lacks rows that the run's fingerprint (its ``prompts.sha256``) says were planned: an
        extension of appended prompts deleted or lost, which planning again would not cut into the shards already
        committed from it. None when the plan covers them (or a plan too old to say)."""
        hashes = self.planned_hashes
        if prompts_sha256 is None or None in hashes or prompts_sha256 in hashes:
            return None
        size, _ = self.covered
        where = self.run.files.where
        return (f"{where(self.run.fingerprint_path)} names the run's prompt file with rows appended after planning "
                f"(sha256 {prompts_sha256[:16]}...), and the plan covers only the file's first {size} bytes (shards "
                f"0..{self.num_shards - 1}): the extension that planned the appended rows "
                f"({where(self.run.plan_dir)}/ext-{len(self.extensions) + 1:06d}) is missing. Restore "
                "plan/ from a backup, or start a new run_dir: planning those rows again would not cut them into the "
                "shards already committed from them")

    @property
    def row_rules(self) -> RowRules | None:
        """The rules the run's rows were read with (prompts.row_settings; None: none): ``count_shapes(plan.row_rules,
        plan.rows(shard))`` is a shard's shape set, ``row_rules.shape(row.settings)`` one row's shape."""
        rules = ((self.meta or {}).get("source") or {}).get("row_rules")
        return RowRules(**rules) if rules else None

    def adapters(self) -> dict[str, str]:
        """The LoRA files the plan's rows name (sha256 -> path, prompts.row_settings=[loras]), over the plan and its
        extensions; {} when its rows name none."""
        out: dict[str, str] = {}
        for m in [self.meta or {}] + [e.meta for e in self.extensions]:
            out.update(m.get("loras") or {})
        return out

    @functools.cached_property
    def lora_rejects(self) -> dict[str, str] | None:
        """The rows rejected for their LoRA adapters when planned (row index as a string -> reason), over the plan
        and its extensions; None for a plan made before they were recorded."""
        metas = [self.meta or {}] + [e.meta for e in self.extensions]
        if any("lora_rejects" not in m for m in metas):
            return None
        return {k: v for m in metas for k, v in m["lora_rejects"].items()}

    @functools.cached_property
    def image_rejects(self) -> dict[str, str]:
        """The rows whose input image file was unusable when planned (row index as a string -> reason; rejected,
        prompts.row_settings=[image]), over the plan and its extensions; gathered once per Plan."""
        out: dict[str, str] = {}
        for m in [self.meta or {}] + [e.meta for e in self.extensions]:
            out.update(m.get("image_rejects") or {})
        return out

    def shapes(self) -> Counter | None:
        """Rows per ``Shape`` (width, height, frames) over the plan and its extensions, counted while planning
        (rejected rows left out), most rows first; None when the run has no prompts.row_settings (every row has
        the run's shape) or was planned before shapes were counted. The set of shapes a run's calls take: the
        compiled graphs and attention sequence lengths it needs (``count_shapes`` gives one shard's)."""
        parts = [self.meta or {}] + [e.meta for e in self.extensions]
        if any(not isinstance(m.get("shapes"), list) for m in parts):
            return None
        out: Counter = Counter()
        for m in parts:
            for w, h, frames, n in m["shapes"]:
                out[Shape(w, h, frames)] += n
        return Counter(dict(out.most_common()))


def _truncated(run: RunDir, path: Path, rng: range) -> set[int]:
    """The row indices in ``rng`` planned as rejects for being truncated (prompts.on_truncation=skip)."""
    if not run.files.exists(path):
        return set()
    cut = _load_npy(run, path)
    lo, hi = np.searchsorted(cut, [rng.start, rng.stop])
    return set(cut[lo:hi].tolist())


def _plan_error(run: RunDir, path: Path, what: str) -> PlanError:
    """A damaged plan file of ``run``, named where it is (a bucket's object by its URL), and how to rebuild it (an
    extended run's plan cannot be: ``extended_plan_fix``)."""
    fault = f"{run.files.where(path)}: {what}"
    if extension_dirs(run):
        return PlanError(f"{fault}, and {extended_plan_fix(run)}", fault)
    folder = f"every object under {run.files.where(path.parent)}/" if run.store else str(path.parent)
    return PlanError(f"{fault}. The plan is derived from the prompt file, which the run's fingerprint checks: delete "
                     f"{folder} and re-run the same command to rebuild it (committed shards stay valid).", fault)


def extended_plan_fix(run: RunDir) -> str:
    """Why a damaged plan of a run extended with appended prompts is not made again, and what to do instead."""
    return (f"{run.name} was extended with appended prompts ({run.files.where(run.plan_dir)}/ext-*): planning again "
            "would not cut the rows into the same shards. Restore plan/ from a backup, or start a new run_dir")


def last_prompt_path(run: RunDir) -> str | None:
    """Where the last launch found the run's prompt file, its content checked against the fingerprint
    (the path in ``prompt_hash.json``); None when no launch recorded one."""
    try:
        path = json.loads(run.files.read(run.prompt_hash_path)).get("path")
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return path if isinstance(path, str) else None


def load_plan(run: RunDir, prompt_path: str | os.PathLike | None = None) -> Plan | None:
    """The run's plan, or None if it has none yet; PlanError when it is damaged.

    The prompt file is the run's by its content (the fingerprint's SHA-256), not by its path: rows are read
    from ``prompt_path`` (a launch's ``prompts.path``, checked against the fingerprint), else from where the
    last launch found it, else from where it was planned."""
    clean_stale_tmp(run)
    if not has_plan(run):
        return None
    path = run.plan_json_path
    try:
        data = run.files.read(path)
        if data is None:
            raise _plan_error(run, path, "missing")
        meta = json.loads(data)
        kw = {k: meta[k] for k in ("num_rows", "samples_per_shard", "num_shards", "num_rejects", "prompt_file")}
    except (ValueError, KeyError, TypeError) as e:
        raise _plan_error(run, path, f"unreadable ({type(e).__name__}: {e})") from None
    if meta.get("version", 1) == 1:
        return Plan(run=run, **kw)
    # the container the run was planned with (a plan without the key: tar); the tools' RunDir learns it here
    run = dataclasses.replace(run, container=str(meta.get("shard_container") or "tar"))
    starts_path = run.starts_path
    starts = _load_npy(run, starts_path)
    if starts.shape != (kw["num_shards"], 2):
        raise _plan_error(run, starts_path, f"has shape {starts.shape}, plan.json says {kw['num_shards']} shards")
    if meta.get("starts_sha256") not in (None, _digest(starts)):
        raise _plan_error(run, starts_path, "does not match the checksum in plan.json (changed after planning)")
    path = prompt_path or last_prompt_path(run) or meta["source"]["path"]
    extensions = tuple(_load_extensions(run, kw["num_rows"], kw["num_shards"]))
    for ext in extensions:
        kw.update(num_rows=ext.end_row, num_shards=ext.first_shard + ext.meta["num_shards"],
                  num_rejects=kw["num_rejects"] + ext.meta["num_rejects"])
    n = int(meta.get("images_per_prompt") or 1)  # plan.json counts prompt rows; the Plan counts samples
    prompt_rows, sample_starts = kw["num_rows"], None
    if meta.get("per_row_images"):  # each segment's samples per shard, in shard order
        parts = []
        for where, m in [(run.plan_dir, meta), *((e.dir, e.meta) for e in extensions)]:
            part = _load_npy(run, where / "samples.npy")
            if part.ndim != 1 or m.get("samples_sha256") != _digest(part) or (part < 1).any():
                raise _plan_error(run, where / "samples.npy", "does not match the checksum in plan.json (changed "
                                                              "after planning)")
            parts.append(part)
        counts = np.concatenate(parts)
        if counts.shape != (kw["num_shards"],):
            raise _plan_error(run, run.plan_dir / "samples.npy",
                              f"has {counts.shape} shards, the plan {kw['num_shards']}")
        sample_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        kw["num_rows"] = int(sample_starts[-1])
    else:
        kw["num_rows"] *= n
    kw["samples_per_shard"] *= n
    return Plan(run=run, meta=meta, starts=starts, digests=_load_digests(run, run.plan_dir, meta, len(starts)),
                prompt_path=str(path), extensions=extensions, images=n, sample_starts=sample_starts,
                prompt_rows=prompt_rows, **kw)


def has_plan(run: RunDir) -> bool:
    """Whether the run has a plan to load: in its directory the plan/ folder (plan.json missing from it is damage);
    in a bucket the published plan.json (plan files without it are a planner's still under way, or a dead one's)."""
    return run.files.exists(run.plan_json_path) if run.store else run.plan_dir.exists()


def _load_npy(run: RunDir, path: Path) -> np.ndarray:
    """A plan array of ``run`` (from its store); PlanError naming the file when it is missing or damaged."""
    data = run.files.read(path) if run.store else None  # read outside the try: a bucket's outage is no damage
    try:
        if run.store:
            if data is None:
                raise FileNotFoundError(path)
            return np.load(io.BytesIO(data), allow_pickle=False)
        with open_regular(path) as f:
            return np.load(f, allow_pickle=False)
    except FileNotFoundError:
        raise _plan_error(run, path, "missing") from None
    except NotRegularFileError:
        raise _plan_error(run, path, "not a regular file") from None
    except Exception as e:  # numpy raises ValueError, EOFError, even SyntaxError (a garbled header) for damage
        raise _plan_error(run, path, f"unreadable ({type(e).__name__}: {str(e)[:200]})") from None


def _load_digests(run: RunDir, where: Path, meta: dict, num_shards: int) -> np.ndarray | None:
    """The shard digests of a plan or extension that has them (its plan.json names their checksum; None for
    one planned before digests); PlanError when damaged."""
    if "digests_sha256" not in meta:
        return None
    path = where / "digests.npy"
    digests = _load_npy(run, path)
    if digests.shape != (num_shards, 32) or digests.dtype != np.uint8 \
            or hashlib.sha256(digests.tobytes()).hexdigest() != meta["digests_sha256"] or "rows_end" not in meta:
        raise _plan_error(run, path, "does not match plan.json (changed after planning)")
    return digests


def discard_plan(run: RunDir, why: str) -> None:
    """Remove the run's plan (moved aside first, so a concurrent reader sees it whole or not at all); ``why`` names
    the moved-aside directory while it is being removed."""
    if run.store:
        _discard_stored_plan(run)
        return
    aside = run.root / f".plan-{why}~{host_name()}~{os.getpid()}~{time.time_ns()}"
    try:
        os.rename(run.plan_dir, aside)
    except FileNotFoundError:
        pass  # another job moved it first
    shutil.rmtree(aside, ignore_errors=True)
    run.files.delete(run.plan_digests_path)


def _discard_stored_plan(run: RunDir) -> None:
    """Remove a plan kept in a bucket: plan.json first, so that readers see no plan from then on (``has_plan``),
    then the other files of plan/ and of its extensions, and the plan's digests."""
    extensions = extension_dirs(run)
    run.files.delete(run.plan_json_path)
    for folder in [run.plan_dir, *extensions]:
        for name in sorted(run.files.names(folder), key=lambda n: n != "plan.json"):
            run.files.delete(folder / name)
    run.files.delete(run.plan_digests_path)


def extension_dirs(run: RunDir) -> list[Path]:
    """The run's plan extensions (``plan/ext-NNNNNN``), in order. In a bucket, which has no folders to list, those
    published (their plan.json created) numbered from 1 without a gap, as they are made."""
    if not run.store:
        return sorted(p for p in run.plan_dir.glob("ext-*") if p.name[4:].isdigit())
    found: list[Path] = []
    while run.files.exists(run.plan_dir / f"ext-{len(found) + 1:06d}" / "plan.json"):
        found.append(run.plan_dir / f"ext-{len(found) + 1:06d}")
    return found


def _load_extensions(run: RunDir, num_rows: int, num_shards: int) -> Iterator[Segment]:
    """Each extension, checked to follow the rows and shards before it without a gap."""
    for k, d in enumerate(extension_dirs(run), 1):
        path = d / "plan.json"
        starts = _load_npy(run, d / "starts.npy")
        try:
            meta = _read_stored_json(run, path) if run.store else read_json(path)
            ok = (d.name == f"ext-{k:06d}" and meta["first_row"] == num_rows and meta["first_shard"] == num_shards
                  and starts.shape == (meta["num_shards"], 2) and meta["starts_sha256"] == _digest(starts))
        except StorageError:
            raise  # a bucket's outage is no damage
        except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
            raise _plan_error(run, path, f"unreadable ({type(e).__name__}: {e})") from None
        if not ok:
            raise _plan_error(run, path, f"does not follow rows 0..{num_rows - 1} and shards 0..{num_shards - 1} "
                                         "before it (or its starts.npy does not match its checksum)")
        num_rows, num_shards = meta["first_row"] + meta["num_rows"], num_shards + meta["num_shards"]
        yield Segment(dir=d, meta=meta, starts=starts, digests=_load_digests(run, d, meta, len(starts)))


def _read_stored_json(run: RunDir, path: Path) -> dict:
    """A plan record from the run's bucket; FileNotFoundError when it is not there."""
    data = run.files.read(path)
    if data is None:
        raise FileNotFoundError(path)
    return json.loads(data)


def _digest(starts: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(starts, dtype=np.int64).tobytes()).hexdigest()


def clean_stale_tmp(run: RunDir) -> None:
    """Remove planning temp dirs left by killed planners (``.plan-HOST-PID-RANDOM``, the names ``new_plan_dir``
    makes; any other ``.plan-*`` is not ours and stays): on this host when the pid is gone, elsewhere when
    untouched for STALE_TMP_S. Never a live planner's, even once a plan exists: a job racing to plan the
    same run is still writing into its own and adopts the winner's plan when its rename loses."""
    if not run.root.exists():
        return
    for d in run.root.glob(".plan-*"):
        if not PLAN_TEMP_NAME.fullmatch(d.name) or d.name.startswith(".plan-damaged~"):
            continue
        host, pid = d.name.split("-")[1:3]
        try:
            dead = (host == _host() and not pid_alive(int(pid))) or time.time() - d.stat().st_mtime > STALE_TMP_S
        except OSError:
            continue
        if dead:
            shutil.rmtree(d, ignore_errors=True)


def _host() -> str:
    return host_name().replace("-", "_")  # "-" separates the temp dir name's fields


def build_plan(run: RunDir, source: PromptSource, *, samples_per_shard: int, run_seed: int,
               truncation: TruncationCheck | None = None, prompt_sha256: str | None = None,
               images_per_prompt: int = 1) -> Plan:
    """Scan the prompt file once (validating every row), write the plan atomically, return it.

    The plan goes into a temporary directory renamed to ``plan/`` at the end, so a bad row half-way
    (the reader raises) leaves no plan behind, and when two jobs race the first rename wins and the
    other adopts it. Memory stays constant in the number of rows. ``truncation`` finds the prompts
    a text encoder will cut, and warns, refuses or plans them as rejects (prompts.on_truncation).
    ``prompt_sha256``: the file's hash, recorded so that prompts appended later are recognised as such.
    ``images_per_prompt``: samples per prompt row; ``samples_per_shard`` is a multiple of it (whole rows a shard).
    """
    run.root.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(run)
    tmp = new_plan_dir(run)
    try:
        before = file_identity(source.path)
        if samples_per_shard % images_per_prompt:
            raise ValueError(f"samples_per_shard={samples_per_shard} is no multiple of images_per_prompt="
                             f"{images_per_prompt}")
        rows_per_shard = samples_per_shard // images_per_prompt
        counts = plan_rows_into(tmp, source, rows_per_shard, truncation, images=images_per_prompt)
        if file_identity(source.path) != before:
            raise P.fail(source.path, 0, "the prompt file changed while it was being planned",
                         "Leave it unchanged while a run uses it (appending is fine once it is planned), and re-run")
        if counts["num_rows"] == 0:
            raise P.fail(source.path, 0, "the prompt file has no rows (only a header, or only a byte-order mark)",
                         "Add prompts, or point prompts.path at the right file")
        atomic_write_json(tmp / "plan.json", dict(
            counts, version=PLAN_VERSION, samples_per_shard=rows_per_shard, prompt_file=public_url(source.path),
            **({"images_per_prompt": images_per_prompt} if images_per_prompt > 1 else {}),
            **({"per_row_images": True} if "samples" in counts else {}),
            prompt_size=sizeof(source.path), prompt_sha256=prompt_sha256, run_seed=run_seed,
            shard_container=run.container,
            **({"prompt_etag": identity(source.path)["etag"]} if is_url(source.path) else {}),
            source=source.as_json()))
        publish_plan(run, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_plan(run, source.path)


def publish_plan(run: RunDir, tmp: Path) -> None:
    """Put the plan made in ``tmp`` in place; a plan another planner put there first is kept (and loaded by the
    caller). In the run directory ``tmp`` is renamed to plan/ (the first rename wins); in a bucket it is
    ``publish_stored``."""
    if run.store:
        publish_stored(run, tmp, run.plan_dir)
        return
    try:
        os.rename(tmp, run.plan_dir)
    except OSError:
        if load_plan(run) is None:
            raise


def publish_stored(run: RunDir, tmp: Path, target: Path) -> bool:
    """Write the plan files made in ``tmp`` into the run's bucket as the folder ``target`` (plan/, or an
    extension's); False when another planner's plan.json is there first (nothing of this one's written over it).

    A bucket has no rename: each file is written under its key and plan.json last, created only if absent; readers
    take a plan to exist once its plan.json does (``has_plan``), so they never see part of one. Two planners
    writing the other files at once write the same bytes (the fingerprint fixed the prompt file and the settings,
    and planning is deterministic); should they differ, plan.json's checksums of them refuse the plan when loaded."""
    record = target / "plan.json"
    if run.files.exists(record):
        return False
    for p in sorted(tmp.iterdir()):
        if p.name != "plan.json":
            run.files.replace(target / p.name, p.read_bytes())
    return run.files.create(record, (tmp / "plan.json").read_bytes())


def new_plan_dir(run: RunDir) -> Path:
    """A fresh temporary directory for planning in ``run`` (renamed into place when whole; removed by
    ``clean_stale_tmp`` when its planner died)."""
    # a run kept in a bucket plans in this machine's scratch folder, absent on a machine new to the run
    run.root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".plan-{_host()}-{os.getpid()}-", dir=run.root))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the plan is read by every job sharing the run
    return tmp


def plan_rows_into(out: Path, source: PromptSource, samples_per_shard: int, truncation: TruncationCheck | None,
                   offset: int = 0, first_row: int = 0, head_end: int | None = None, images: int = 1) -> dict:
    """Scan the rows from byte ``offset`` (row ``first_row``; parquet: from the start) into shards of
    ``samples_per_shard``: writes ``out/starts.npy``, ``out/digests.npy`` (each shard's sha256, see
    planscan.py) and ``truncated.npy`` when needed; returns the counts for plan.json (num_rows, num_rejects,
    num_shards, starts_sha256, rows_end, digests_sha256, and with prompts.row_settings ``shapes``: rows per shape,
    ``shapes_json``, and ``loras``: the adapter files rows name, sha256 -> path). ``head_end``: where the file's first row starts (csv/tsv: the header before it is hashed
    with each shard); None: where this scan's first shard starts."""
    shapes = Counter() if source.row_rules else None  # (a txt file has no fields: no row settings)
    adapters = {} if source.row_rules and "loras" in source.row_rules["names"] else None
    image_rejects = {} if source.row_rules and "image" in source.row_rules["names"] else None
    # rows with their own images_per_prompt: each shard's samples (samples.npy; a shard holds whole rows)
    samples = [] if source.row_rules and "images_per_prompt" in source.row_rules["names"] else None
    footer = planned_from_footer(source, truncation) and first_row == 0
    if footer:  # a remote parquet file: no row read before the first image
        num_rows, num_rejects, starts, rows_end, digests = footer_plan(source, samples_per_shard)
    elif (scan := prompt_format(source.format).scan) is not None:  # a scan of its own (txt's)
        num_rows, num_rejects, starts, rows_end, digests = scan(source, samples_per_shard, truncation, offset,
                                                                first_row)
    else:
        num_rows, num_rejects, starts, rows_end, digests = scan_rows(source, samples_per_shard, truncation, first_row,
                                                                     shapes, adapters, image_rejects, samples, images)
    cut = truncation_outcome(source, truncation)  # even with no rows: with on_truncation=error the scan may stop early
    if cut is not None:
        np.save(out / "truncated.npy", cut)
        num_rejects += len(cut)
    if digests is None and not footer:  # text formats: each shard's bytes, in one more pass
        if head_end is None:
            head_end = int(starts[0][0]) if len(starts) else 0
        digests = range_digests(source.path, starts, rows_end, head_end if prompt_format(source.format).header else 0)
    np.save(out / "starts.npy", starts)
    counts = dict(num_rows=num_rows, num_rejects=num_rejects, num_shards=len(starts), starts_sha256=_digest(starts),
                  rows_end=rows_end)
    if digests is not None:  # a footer plan has none: the file's ETag (recorded in plan.json) stands for its rows
        np.save(out / "digests.npy", digests)
        counts["digests_sha256"] = hashlib.sha256(digests.tobytes()).hexdigest()
    if shapes is not None:
        counts["shapes"] = shapes_json(shapes)
    if adapters is not None:
        counts["lora_rejects"] = adapters.pop(LORA_REJECTS, {})
        counts["loras"] = adapters
    if image_rejects:
        counts["image_rejects"] = image_rejects
    if samples is not None:
        per_shard = np.asarray(samples[:len(starts)], dtype=np.int64)
        np.save(out / "samples.npy", per_shard)
        counts.update(samples=int(per_shard.sum()), samples_sha256=_digest(per_shard))
    return counts


_EXACT_COUNT_BYTES = 64 << 20  # prompt files up to this size have their lines counted for shard sizing
_SAMPLES = 16                  # larger ones: lines counted in this many 1 MB samples spread over the file


def estimate_rows(source: PromptSource) -> int:
    """About how many rows the prompt file has (lines; parquet: its metadata), for shard sizing only:
    counted in files up to 64 MB, extrapolated from 16 samples of 1 MB spread over larger ones (a
    pass over a 2 GB file would cost seconds for a figure the sizing rounds anyway)."""
    fmt = prompt_format(source.format)
    if fmt.count_rows is not None:
        n = fmt.count_rows(source.path)
    else:
        size = sizeof(source.path)
        with open_input(source.path) as f:
            if size <= _EXACT_COUNT_BYTES:
                data = f.read()
                n = data.count(b"\n") + (not data.endswith(b"\n"))  # a last line without a newline
            else:
                seen = lines = 0
                for k in range(_SAMPLES):
                    f.seek((size - (1 << 20)) * k // (_SAMPLES - 1))
                    block = f.read(1 << 20)
                    seen, lines = seen + len(block), lines + block.count(b"\n")
                n = round(size * lines / seen)
        if fmt.header:  # the header line is not a prompt (quoted newlines still overcount)
            n = max(0, n - 1)
    return min(n, source.limit) if source.limit is not None else n


def idle_warning(num_shards: int, replicas: int, samples_per_shard: int) -> str | None:
    """A warning when this launch has more replicas than shards (the extra ones have nothing to do)."""
    if num_shards >= replicas:
        return None
    return (f"{replicas} replicas but only {num_shards} shard(s) of {samples_per_shard}: {replicas - num_shards} "
            f"replica(s) will have nothing to do. Lower samples_per_shard (or leave it unset to size shards "
            "for the ranks) on a new run_dir.")
