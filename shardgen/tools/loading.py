"""Reading a whole run back: every committed shard's tar for webdataset, and the features of every sample for
Hugging Face ``datasets``.

``datasets``' webdataset loader infers its features from the first five samples of the first tar: a json field
that only later rows have (a per-row ``score``) comes back as None everywhere, and a first shard of rejects only
holds nothing to infer from. The shard indexes (``shards/NNNNNN.parquet``) keep every sample's whole json, so the
union of all fields and their types is known without opening a tar: ``hf_features`` builds it from them.

A run kept in a bucket (``s3://bucket/prefix``) is read from the bucket: webdataset 1.0 opens no ``s3://`` URL (its
``gopen`` knows local paths, ``pipe:``, http(s), ``gs://`` through gsutil), so ``shard_paths`` gives it ``pipe:``
commands that run ``python -m shardgen.tools.loading RUN_URL SHARD``: the shard's tar read from the bucket, checked
against its upload record (size and sha256), then written to stdout (an object not as uploaded is never read as the
shard: the command fails, and webdataset with it). ``datasets`` opens ``s3://`` URLs itself (fsspec, s3fs), so it gets
those.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.shards.formats import IMAGE_EXTS
from shardgen.dataio.shards.video import VIDEO_EXT
from shardgen.dataio.shards.index import index_path, read_index_table
from shardgen.errors import UserError


class LoadError(UserError, ValueError):
    """A run that cannot be read back whole as asked."""


VIDEO_AS = ("decode", "bytes")


READERS = ("webdataset", "datasets")


def shard_paths(run_dir: str | os.PathLike, reader: str = "webdataset") -> list[str]:
    """The run's committed tars, in shard order (shards in progress left out), as ``reader`` opens them to read every
    committed sample: ``webdataset.WebDataset(...)``, or ``load_dataset("webdataset", data_files=...)`` with
    ``reader="datasets"``. A run in a directory gives its files' paths to either. A run kept in a bucket gives
    webdataset a ``pipe:`` command per shard (it opens no ``s3://`` URL; each command writes the shard's tar, checked
    against its upload record, to stdout) and ``datasets`` the ``s3://`` URLs, which it opens through fsspec and s3fs
    with the same credentials and endpoint as the run (the standard AWS variables)."""
    if reader not in READERS:
        raise LoadError(f"reader={reader!r}: give one of {', '.join(READERS)}")
    run = RunDir.at(run_dir)
    if not run.store:
        return [str(run.shard_file(s)) for s in sorted(run.done_shards()) if run.shard_file(s).is_file()]
    shards = sorted(run.done_shards())  # one listing of the records in uploads/
    if reader == "datasets":
        return [f"{run.store}/shards/{run.shard_file(s).name}" for s in shards]
    # the interpreter running this: the one with shardgen and s3fs installed, whatever `python` is on PATH
    command = f"pipe:{shlex.quote(sys.executable)} -m shardgen.tools.loading {shlex.quote(run.store)}"
    return [f"{command} {s}" for s in shards]


def write_shard(run_url: str, shard: int, out: Any) -> None:
    """Write the committed tar of ``shard`` of the run kept at ``run_url`` to the binary stream ``out``, whole and
    only once it is checked against the shard's upload record (held in a temporary file meanwhile, not in memory);
    LoadError when the shard is not committed, RunDirError when the bucket's object is not the one uploaded,
    StorageError when it cannot be read."""
    from shardgen.dataio.shards.uploaded import fetch_into

    run = RunDir.at(run_url)
    if not (run.store and fetch_into(run, shard, run.shard_file(shard).suffix, out)):
        raise LoadError(f"{run_url}: shard {shard:06d} is not committed in the bucket (no "
                        f"{run.files.where(run.shard_uploaded(shard))}); list the committed ones with "
                        "shardgen.tools.loading.shard_paths")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    """``python -m shardgen.tools.loading RUN_URL SHARD``: the shard's tar on stdout (``write_shard``), what the
    ``pipe:`` commands of ``shard_paths`` run; an error is one line on stderr, exit status 2."""
    import argparse

    from shardgen.tools.runfiles import tool_errors

    ap = argparse.ArgumentParser(prog="python -m shardgen.tools.loading",
                                 description="Write one committed tar of a run kept in a bucket to stdout.")
    ap.add_argument("run_url", help="the run (s3://BUCKET/PREFIX)")
    ap.add_argument("shard", type=int, help="the shard's number")

    @tool_errors
    def body() -> int:
        args = ap.parse_args(argv)
        write_shard(args.run_url, args.shard, sys.stdout.buffer)
        return 0

    return body()


def hf_features(run_dir: str | os.PathLike, video: str = "decode") -> Any:
    """The ``datasets.Features`` of every sample of the run: its media member (``datasets.Image``; a video's
    ``datasets.Video``, whose decoding needs torchcodec, or with ``video="bytes"`` the mp4's bytes), ``txt``, and
    ``json`` with every field any sample's json has, typed from all of them; for ``load_dataset("webdataset",
    data_files=..., features=hf_features(run_dir))``."""
    import datasets
    import pyarrow as pa

    if video not in VIDEO_AS:
        raise LoadError(f"video={video!r}: give one of {', '.join(VIDEO_AS)}")
    schemas, exts = _json_schemas(RunDir.at(run_dir))
    if not exts:
        raise LoadError(f"{run_dir}: no committed sample with an image or video yet; nothing to load")
    if len(exts) > 1:
        raise LoadError(f"{run_dir}: its samples have different media members ({', '.join(sorted(exts))}); load "
                        "each kind with its own data_files")
    try:
        json_type = pa.unify_schemas(schemas, promote_options="permissive").field("json").type
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise LoadError(f"{run_dir}: a json field has values of types that do not mix ({e}); read the json "
                        "members as text instead (webdataset, or the index's json column)") from None
    ext = exts.pop()
    media = datasets.Image() if ext in IMAGE_EXTS else datasets.Video() if video == "decode" else \
        datasets.Value("binary")
    return datasets.Features({ext: media, "txt": datasets.Value("string"),
                              "json": datasets.Features.from_arrow_schema(pa.schema([("json", json_type)]))["json"],
                              "__key__": datasets.Value("string"), "__url__": datasets.Value("string")})


def _json_schemas(run: RunDir) -> tuple[list, set[str]]:
    """Per committed shard, the arrow schema of its image samples' json; and the media extensions they have."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = ["status", "image_format", "json"]
    schemas, exts = [], set()
    for shard in sorted(run.done_shards()):
        path = run.files.where(index_path(run, shard)) if run.store else index_path(run, shard)
        try:  # a run kept in a bucket: the bucket's copy, checked against the shard's upload record
            table = read_index_table(run, shard, columns) if run.store else pq.read_table(path, columns=columns)
        except (OSError, pa.ArrowException) as e:
            raise LoadError(f"{path}: the shard's index does not read ({type(e).__name__}: {e}); "
                            "python -m jobs.verify RUN_DIR --repair remakes it") from None
        ok = [(fmt, j) for s, fmt, j in zip(*(table[c].to_pylist() for c in ("status", "image_format", "json")))
              if s == "ok"]
        if ok:
            schemas.append(pa.Table.from_pylist([{"json": json.loads(j)} for _, j in ok]).schema)
            exts.update(fmt or VIDEO_EXT for fmt, _ in ok)  # the index names an image's format; a video has none
    return schemas, exts


if __name__ == "__main__":
    from shardgen.cli import run_program

    run_program(main, "shardgen.tools.loading")
