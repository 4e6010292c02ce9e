"""Reading a whole run back: every committed shard's tar for webdataset, and the features of every sample for
Hugging Face ``datasets``.

``datasets``' webdataset loader infers its features from the first five samples of the first tar: a json field
that only later rows have (a per-row ``score``) comes back as None everywhere, and a first shard of rejects only
holds nothing to infer from. The shard indexes (``shards/NNNNNN.parquet``) keep every sample's whole json, so the
union of all fields and their types is known without opening a tar: ``hf_features`` builds it from them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.shards.formats import IMAGE_EXTS
from shardgen.dataio.shards.video import VIDEO_EXT
from shardgen.dataio.shards.index import index_path
from shardgen.errors import UserError


class LoadError(UserError, ValueError):
    """A run that cannot be read back whole as asked."""


VIDEO_AS = ("decode", "bytes")


def shard_paths(run_dir: str | os.PathLike) -> list[str]:
    """The run's committed tars, in shard order (shards in progress left out): what ``webdataset.WebDataset`` and
    ``load_dataset("webdataset", data_files=...)`` take to read every committed sample."""
    run = RunDir.at(run_dir)
    return [str(run.shard_file(s)) for s in sorted(run.done_shards()) if run.shard_file(s).is_file()]


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

    schemas, exts = [], set()
    for shard in sorted(run.done_shards()):
        path = index_path(run, shard)
        try:
            table = pq.read_table(path, columns=["status", "image_format", "json"])
        except (OSError, pa.ArrowException) as e:
            raise LoadError(f"{path}: the shard's index does not read ({type(e).__name__}: {e}); "
                            "python -m jobs.verify RUN_DIR --repair remakes it") from None
        ok = [(fmt, j) for s, fmt, j in zip(*(table[c].to_pylist() for c in ("status", "image_format", "json")))
              if s == "ok"]
        if ok:
            schemas.append(pa.Table.from_pylist([{"json": json.loads(j)} for _, j in ok]).schema)
            exts.update(fmt or VIDEO_EXT for fmt, _ in ok)  # the index names an image's format; a video has none
    return schemas, exts
