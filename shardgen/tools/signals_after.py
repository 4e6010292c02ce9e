"""Curation signals computed after the fact: from a run's committed tars into each shard's parquet
index, for runs generated without them (``python -m jobs.signals``).

The tars are only read. Each shard's index is rewritten whole (temp file, fsync, atomic rename,
as at commit; in a bucket, together with the shard's upload record: uploaded.replace_object) with the signal
columns filled for its images, so a kill leaves every index either as it was or complete; a shard whose
images all have the signals already is skipped, so a rerun continues where a killed one stopped. The
sample's json (in the tar and the index) keeps what the generating launch wrote: the columns are the
record of the signals added afterwards.

Only signals that read pixels can be added: the watermark changes them (``signals=[watermark]`` at
generation time).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterator

from shardgen.dataio.prompts.plan import Plan
from shardgen.dataio.rundir.fileio import open_regular
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.shards.formats import OUTPUT_FORMATS, image_ext
from shardgen.dataio.shards.index import index_bytes, index_path, read_index_table, read_parquet_file, write_index
from shardgen.dataio.shards.upload import committed_tar
from shardgen.dataio.shards.uploaded import only_uploaded, replace_object
from shardgen.dataio.shards.signals import ClipScorer, SignalConfigError, phash
from shardgen.errors import UserError

log = logging.getLogger("shardgen.signals")
AFTER = ("phash", "clip")
COLUMN = {"phash": "phash", "clip": "clip_score"}


def signal_functions(names: list[str], clip_model: str | None = None,
                     clip_device: str = "cpu") -> dict[str, Callable]:
    """{index column: f(pixels, prompt)} for ``names``; SignalConfigError for one that cannot be added."""
    bad = [n for n in names if n not in AFTER]
    if bad:
        why = "the watermark changes pixels: add it at generation time" if "watermark" in bad else \
            f"use {', '.join(AFTER)}"
        raise SignalConfigError(f"signals {bad} cannot be computed after the fact ({why})")
    if "clip" in names and not clip_model:
        raise SignalConfigError("clip needs CLIP weights: pass --clip-model PATH (a transformers CLIPModel directory)")
    out: dict[str, Callable] = {}
    if "phash" in names:
        out["phash"] = lambda pixels, prompt: phash(pixels)
    if "clip" in names:
        scorer = ClipScorer(clip_model, clip_device)
        out["clip_score"] = lambda pixels, prompt: scorer(pixels, prompt) if prompt else None
    return out


def add_signals(plan: Plan, functions: dict[str, Callable]) -> Iterator[tuple[int, int]]:
    """Fill the columns of ``functions`` in every committed shard's index that lacks them; yields
    (shard, images computed) per shard rewritten."""
    run = plan.run
    for shard in sorted(run.done_shards()):
        n = _add_to_shard(plan, shard, functions)
        if n is not None:
            yield shard, n


def _add_to_shard(plan: Plan, shard: int, functions: dict[str, Callable]) -> int | None:
    from shardgen.dataio.shards.container import read_shard_members
    from shardgen.tools.runfiles import REPAIR_HINT, read_members_checked

    run = plan.run
    path = index_path(run, shard)
    # a run kept in a bucket (or keep_local=false): the index is its object there, read checked against the shard's
    # upload record, and rewritten with the record (uploaded.replace_object)
    in_bucket = only_uploaded(run, shard)
    try:
        if in_bucket:
            rows = read_index_table(run, shard).to_pylist()
        else:
            with open_regular(path, follow=False) as f:
                rows = read_parquet_file(f).to_pylist()
        todo = [r for r in rows if r["status"] == "ok" and any(r.get(c) is None for c in functions)]
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError...; an index of another shape KeyError
        if in_bucket and isinstance(e, UserError):  # the bucket's copy unreachable, or not the bytes uploaded: named
            raise
        where = run.files.where(path) if in_bucket else path
        raise RunDirError(f"{where} is damaged ({type(e).__name__}: {str(e)[:200]}); "
                          + REPAIR_HINT.format(root=run.name)) from None
    if not todo:
        return None  # done already (a rerun after a kill)
    tar = committed_tar(plan.run, shard)  # keep_local=false: read back from the bucket
    members = (read_members_checked(tar, run.container) if isinstance(tar, Path)
               else read_shard_members(tar, run.container))
    for r in todo:
        if (ext := image_ext(members.get(r["key"], {}))) is None:
            raise RunDirError(f"{run.shard_file(shard)} lacks the image of {r['key']!r} that its index "
                              f"{path.name} lists; " + REPAIR_HINT.format(root=run.name))
        try:
            pixels = OUTPUT_FORMATS[ext].decode(members[r["key"]][ext])
        except Exception as e:  # PIL's errors for a damaged image vary
            raise RunDirError(f"{run.shard_file(shard)}: the image of {r['key']!r} does not decode "
                              f"({type(e).__name__}); " + REPAIR_HINT.format(root=run.name)) from None
        for column, f in functions.items():
            if r.get(column) is None:
                r[column] = f(pixels, r["prompt"])
    if in_bucket:
        replace_object(run, shard, path.suffix, index_bytes(rows))
    else:
        write_index(path, rows)
    return len(todo)
