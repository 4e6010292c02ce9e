"""The per-shard index: ``shards/NNNNNN.parquet``, one row per sample, committed with its tar.

The image tars hold only the samples that have an image (status ``ok``), so every tar has the
same members per key (``png|jpg|webp``, ``txt``, ``json``) and webdataset / Hugging Face
``datasets`` read them with no glue. Failed and rejected samples are recorded here instead (with
their reason and full json record), so the guarantee "every prompt index in exactly one
committed record" reads: in the shard's tar (ok) or in its parquet index (failed, rejected).

While a shard is being written, its rows are appended to ``work/NNNNNN.gK.index.jsonl`` and
fsynced before the shard's checkpoint, one line per sample in index order; a resume keeps the
first ``n_done`` lines (the checkpoint's count), so the index is as crash-consistent as the tar.
At commit the rows become the parquet file (temp file, fsync, rename), before the tar and its
stats (the done marker).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from shardgen.dataio.prompts.samplejson import input_fields
from shardgen.dataio.rundir.fileio import open_regular, temp_path
from shardgen.dataio.rundir.layout import RunDir, shard_name
from shardgen.dataio.shards.formats import image_ext
from shardgen.dataio.shards.uploaded import local_or_fetched, only_uploaded
from shardgen.errors import UserError

# Curation signals (shardgen/dataio/shards/signals.py) and their column types in the index.
SIGNAL_COLUMNS = {"phash": "string", "watermark": "string", "watermark_ok": "bool", "clip_score": "float64"}


def index_path(run: RunDir, shard: int) -> Path:
    """The committed index of ``shard``."""
    return run.shards_dir / f"{shard_name(shard)}.parquet"


def partial_index_path(run: RunDir, shard: int, gen: int) -> Path:
    """The rows of ``shard`` written so far by claim generation ``gen``."""
    return run.work_dir / f"{shard_name(shard)}.g{gen}.index.jsonl"


def schema():
    """The index's arrow schema (fixed, so every shard's file has the same columns and types)."""
    import pyarrow as pa

    fields = [("shard", pa.int32()), ("key", pa.string()), ("index", pa.int64()), ("prompt_index", pa.int64()),
              ("image", pa.int32()), ("line", pa.int64()),
              ("prompt", pa.string()), ("seed", pa.int64()), ("status", pa.string()), ("error", pa.string()),
              ("width", pa.int32()), ("height", pa.int32()), ("image_format", pa.string()),
              ("image_bytes", pa.int64()), ("image_sha256", pa.string()), ("gen_s", pa.float64()),
              ("model", pa.string()), ("strategy", pa.string()), ("tokens", pa.string()), ("truncated", pa.bool_()),
              ("input_image_sha256", pa.string()), ("extra", pa.string())]
    fields += [(name, getattr(pa, "bool_" if t == "bool" else t)()) for name, t in SIGNAL_COLUMNS.items()]
    fields.append(("json", pa.string()))
    return pa.schema(fields)


def index_row(shard: int, members: list[tuple[str, bytes]]) -> dict:
    """The index row of one sample, from its members (image if any, txt, json)."""
    by_ext = {name.partition(".")[2]: data for name, data in members}
    meta = json.loads(by_ext["json"])
    key = members[0][0].partition(".")[0]
    fmt = image_ext(by_ext)
    image = by_ext.get(fmt) if fmt else None
    signals = meta.get("signals") if isinstance(meta.get("signals"), dict) else {}  # only ours (samplejson.py)
    row = dict(shard=shard, key=key, index=meta.get("index"), prompt_index=meta.get("prompt_index"),
               image=meta.get("image"), line=meta.get("line"), prompt=meta.get("prompt"),
               seed=meta.get("seed"), status=meta.get("status", "ok"), error=meta.get("error"),
               width=meta.get("width"), height=meta.get("height"), image_format=fmt,
               image_bytes=len(image) if image is not None else None,
               image_sha256=hashlib.sha256(image).hexdigest() if image is not None else None,
               gen_s=meta.get("gen_s"), model=meta.get("model"), strategy=meta.get("strategy"),
               tokens=json.dumps(meta["tokens"], sort_keys=True) if meta.get("tokens") else None,
               truncated=meta.get("truncated"), input_image_sha256=_input_sha256(meta),
               extra=json.dumps(input_fields(meta), ensure_ascii=False, sort_keys=True),
               json=by_ext["json"].decode("utf-8"))
    row.update({name: signals.get(name) for name in SIGNAL_COLUMNS})
    return row


def _input_sha256(meta: dict) -> str | None:
    """The sha256 of the input image a sample was made from (prompts.row_settings=[image]), None without one."""
    image = meta.get("input_image")
    return image.get("sha256") if isinstance(image, dict) and isinstance(image.get("sha256"), str) else None


class PartialIndex:
    """The index rows of one shard in progress, appended batch by batch (see the module docstring)."""

    def __init__(self, run: RunDir, shard: int, gen: int, keep_from: Path | None = None, n_done: int = 0):
        self.shard = shard
        self.path = partial_index_path(run, shard, gen)
        lines = _first_lines(keep_from, n_done) if keep_from is not None and n_done else []
        # a fresh file, never written through a symlink planted at its name (O_NOFOLLOW), like the partial tar
        self.path.unlink(missing_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        self._f = os.fdopen(fd, "wb")
        self._f.write(b"".join(lines))
        self._pending = 0

    @classmethod
    def resume(cls, run: RunDir, shard: int, gen: int, checkpoint: dict | None) -> "PartialIndex":
        """Generation ``gen``'s rows, starting with the ``n_done`` rows of ``checkpoint``'s generation."""
        if checkpoint is None:
            return cls(run, shard, gen)
        return cls(run, shard, gen, partial_index_path(run, shard, checkpoint["gen"]), checkpoint["n_done"])

    def add(self, members: list[tuple[str, bytes]], gen_s: float | None = None) -> None:
        """Record one sample (in index order); ``gen_s``: its generation time, kept in the index only."""
        row = index_row(self.shard, members)
        if gen_s is not None:
            row["gen_s"] = round(gen_s, 4)
        self._f.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
        self._pending += 1

    def sync(self) -> None:
        """Make the rows added so far durable (before the checkpoint that counts them)."""
        self._f.flush()
        os.fsync(self._f.fileno())

    def commit(self, final: Path) -> int:
        """Write the rows as the shard's parquet index at ``final`` (atomically); the number of rows."""
        self.sync()
        self._f.close()
        with open_regular(self.path, follow=False) as f:
            rows = [json.loads(line) for line in f]
        write_index(final, rows)
        return len(rows)

    def close(self) -> None:
        """Stop without committing (the rows stay for a resume)."""
        if not self._f.closed:
            self._f.close()


def _first_lines(path: Path, n: int) -> list[bytes]:
    lines = []
    with open_regular(path, follow=False) as f:
        for line in f:
            if len(lines) == n or not line.endswith(b"\n"):
                break
            lines.append(line)
    return lines


def resumable(run: RunDir, shard: int, checkpoint: dict | None) -> bool:
    """Whether ``checkpoint``'s generation has index rows for all its samples (a checkpoint
    written before the index existed has none: its shard starts over rather than lose rows)."""
    if checkpoint is None:
        return True
    path = partial_index_path(run, shard, checkpoint["gen"])
    try:  # missing, or removed meanwhile by a replica taking the shard over
        return len(_first_lines(path, checkpoint["n_done"])) == checkpoint["n_done"]
    except FileNotFoundError:
        return False


def _write_parquet(rows: list[dict], target) -> None:
    """``rows`` as an index's parquet (its schema, zstd) into ``target``: a path or a binary file object."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows, schema=schema()), target, compression="zstd")


def write_index(final: Path, rows: list[dict]) -> None:
    """Write ``rows`` as a parquet file at ``final``: temp file, fsync, atomic rename."""
    tmp = temp_path(final)  # a fresh name (clean-up knows it as shardgen's); pyarrow opens it by name
    try:
        _write_parquet(rows, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def index_bytes(rows: list[dict]) -> bytes:
    """``rows`` as the bytes of a parquet index file (what ``write_index`` writes), for an index kept in a bucket."""
    import io

    buf = io.BytesIO()
    _write_parquet(rows, buf)
    return buf.getvalue()


def read_index(run: RunDir, shard: int, columns: Iterable[str] | None = None) -> list[dict]:
    """The committed index rows of ``shard`` (empty if it has no index file); read from the bucket when it was
    deleted once uploaded (keep_local=false)."""
    return read_index_table(run, shard, columns).to_pylist()


def read_index_table(run: RunDir, shard: int, columns: Iterable[str] | None = None):
    """The committed index of ``shard`` as a pyarrow table (no rows if it has no index file), local or from the
    bucket (``uploaded.local_or_fetched``)."""
    source = committed_index(run, shard)
    if isinstance(source, Path):
        if not source.exists():
            return schema().empty_table().select(list(columns)) if columns else schema().empty_table()
        source = open_regular(source)
    with source as f:
        return read_parquet_file(f, columns)


def read_parquet_file(f, columns: Iterable[str] | None = None):
    """The table in the open parquet file ``f`` (``columns`` only, when given).

    Read with ``ParquetFile``, not ``pq.read_table``: read_table scans a file object through pyarrow's dataset
    threads, which abort the process at its exit ("terminate called without an active exception", status 134)
    after the tool printed its result."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(f).read(columns=list(columns) if columns else None)


def committed_index(run: RunDir, shard: int):
    """The index of ``shard`` to read: its local path, or its bytes from the bucket as a file object."""
    return local_or_fetched(run, shard, index_path(run, shard), ".parquet")


def committed_samples(run: RunDir, shard: int, tar_members: dict[str, dict[str, bytes]]) -> tuple[dict, list[str]]:
    """Every committed record of ``shard`` (the tar's samples plus the index's failed and rejected
    ones, as {"txt", "json"} like ``verify.read_shard_members`` gives) and the index's defects:
    a missing index, a key in both places, an index row without its tar sample or the reverse."""
    if not index_path(run, shard).exists() and not only_uploaded(run, shard):
        return dict(tar_members), [f"no index {index_path(run, shard).name}"]
    try:
        rows = read_index(run, shard, ("key", "prompt", "status", "json"))
    except UserError:  # the bucket's copy: unreachable, or not the uploaded bytes
        raise
    except Exception as e:  # a damaged parquet file: pyarrow raises several kinds of error
        return dict(tar_members), [f"unreadable index {index_path(run, shard).name} ({type(e).__name__}: {e})"]
    problems = []
    imaged = {r["key"] for r in rows if r["status"] == "ok"}
    records = {r["key"]: {"txt": (r["prompt"] or "").encode("utf-8"), "json": r["json"].encode("utf-8")}
               for r in rows if r["status"] != "ok"}
    if len(imaged) + len(records) != len(rows):
        problems.append("the index has a key twice")
    if both := set(records) & set(tar_members):
        problems.append(f"{len(both)} failed/rejected keys also in the tar, e.g. {min(both)}")
    if imaged != set(tar_members):
        problems.append(f"the index lists {len(imaged - set(tar_members))} images the tar lacks and misses "
                        f"{len(set(tar_members) - imaged)} of its samples")
    return {**records, **tar_members}, problems


def index_problem(run: RunDir, shard: int, count: int) -> str | None:
    """Why the committed index of ``shard`` cannot be trusted (None: it is a readable parquet file of ``count``
    rows). Cheap: reads the parquet footer only."""
    import pyarrow.parquet as pq

    path = index_path(run, shard)
    if path.is_symlink() or not path.is_file():
        return f"its index {path.name} is missing"
    try:
        with open_regular(path, follow=False) as f:
            rows = pq.read_metadata(f).num_rows
    except Exception as e:  # a damaged parquet file: pyarrow raises several kinds of error
        return f"its index {path.name} is unreadable ({type(e).__name__})"
    return None if rows == count else f"its index {path.name} has {rows} rows, its stats say {count}"


def partial_rows(run: RunDir, shard: int, gen: int, n: int) -> list[dict]:
    """The first ``n`` rows of generation ``gen``'s partial index (ValueError if one is not JSON)."""
    return [json.loads(line) for line in _first_lines(partial_index_path(run, shard, gen), n)]
