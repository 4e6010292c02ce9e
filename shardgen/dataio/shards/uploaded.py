"""A committed shard's files read back from output_uri, checked against the run's record of their upload.

``uploads/NNNNNN.json`` (written by upload.py once the objects are confirmed) holds the shard's stats and, for each
object (tar, index, stats), its size, ETag and sha256. With keep_local=false the local files are deleted after it is
written, so the record is the shard's done marker and what readers of the run (status, verify, report, dedup, a
resume) use in their place: its stats directly, the tar and index fetched from the bucket. An object there is never
trusted by its name alone: one truncated, emptied or rewritten by another job at the same key has another size or
sha256 than the record, and is refused (RunDirError naming it and the fix), never read as the shard.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

from shardgen.dataio.rundir.layout import RunDir, shard_name
from shardgen.dataio.rundir.runfiles import DIR_FILES
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.rundir.remote import PERMANENT_CODES, call, filesystem, permanent_reason, retrying

# what a record must hold to stand in for a shard's local files
RECORD_FIELDS = {"uri": str, "sha256": str, "tar_bytes": int, "stats": dict, "objects": dict}
REDO = "remove {record} and re-run the generate command: the shard is generated and uploaded again"


def read_record(run: RunDir, shard: int) -> dict | None:
    """The upload record of ``shard``; None when there is none or it is not one of this version (a shard whose
    record is unreadable and has no local stats reads as damaged: ``record_stats``)."""
    path = run.shard_uploaded(shard)
    if not run.files.present(path):
        return None
    try:
        return run.files.state(path, RECORD_FIELDS)
    except RunDirError:
        return None


def record_stats(run: RunDir, shard: int, fields: dict[str, type]) -> dict:
    """The stats kept in ``shard``'s upload record (its local stats deleted: keep_local=false); RunDirError naming
    the record when it is missing, damaged or its stats lack one of ``fields``."""
    path = run.shard_uploaded(shard)
    record = run.files.state(path, RECORD_FIELDS)
    stats = record["stats"]
    for key, typ in fields.items():
        if not isinstance(stats.get(key), typ) or isinstance(stats.get(key), bool) != (typ is bool):
            raise RunDirError(f"{path}: its stats have no valid {key!r} (damaged); " + REDO.format(record=path))
    return stats


def object_entry(data: bytes, etag: str | None) -> dict:
    """What a record keeps of one uploaded object: size, ETag, sha256."""
    return dict(size=len(data), etag=etag, sha256=hashlib.sha256(data).hexdigest())


def fetch(run: RunDir, shard: int, suffix: str) -> bytes | None:
    """The bytes of ``shard``'s object ``suffix`` (".tar", ".parquet") from where its upload is recorded; None
    without a record. RunDirError when the object's size or sha256 is not the recorded one (truncated, empty, or
    rewritten by another job at the same key); StorageError when it cannot be read."""
    record = read_record(run, shard)
    if record is None:
        return None
    name = shard_name(shard) + suffix
    want = record["objects"].get(name)
    url = record["uri"].rstrip("/") + "/" + name
    if not isinstance(want, dict):
        raise RunDirError(f"{run.shard_uploaded(shard)} records no {name}; " + REDO.format(record=run.shard_uploaded(shard)))
    fs, root = filesystem(record["uri"])

    def get() -> bytes | None:
        try:
            return call(fs, "cat_file", f"{root.rstrip('/')}/{name}", size=want.get("size") or 0)
        except FileNotFoundError as e:
            if permanent_reason(e) == PERMANENT_CODES["NoSuchBucket"]:
                raise  # the whole bucket: a wrong endpoint or URL as likely as a loss; StorageError, not a defect
            return None

    data = retrying(f"reading {name}", url, get)
    if data is None:
        raise RunDirError(f"{url}: missing from the bucket (deleted since its upload, {run.shard_uploaded(shard)}); "
                          + REDO.format(record=run.shard_uploaded(shard)))
    if len(data) != want.get("size") or hashlib.sha256(data).hexdigest() != want.get("sha256"):
        raise RunDirError(f"{url}: {len(data)} bytes that are not the {want.get('size')} bytes uploaded for this run "
                          f"({run.shard_uploaded(shard)}): truncated, or written over by another job; "
                          + REDO.format(record=run.shard_uploaded(shard)))
    return data


def local_or_fetched(run: RunDir, shard: int, path: Path, suffix: str) -> Any:
    """``path`` when it exists; else, for a shard whose local files were deleted once uploaded, its object's bytes
    from the bucket as a file object; else ``path`` (missing: the caller reports it)."""
    if not os.path.lexists(path) and (data := fetch(run, shard, suffix)) is not None:
        return io.BytesIO(data)
    return path


def only_uploaded(run: RunDir, shard: int) -> bool:
    """Whether ``shard`` is committed only by its upload record (no local stats: keep_local=false, or a run kept in
    a bucket)."""
    return not DIR_FILES.present(run.shard_stats(shard)) and run.files.present(run.shard_uploaded(shard))


def etag_of(meta: dict) -> str | None:
    """An object's ETag without its quotes (None when the store gives none)."""
    tag = meta.get("ETag") or meta.get("etag")
    return str(tag).strip('"') if tag else None


def listed_objects(uri: str) -> dict[str, tuple[int, str | None]]:
    """Name -> (size, ETag) of the objects directly under the folder URL ``uri``, in one listing (paged by the
    store); {} for a folder with nothing in it. StorageError naming the URL when it cannot be listed, or its bucket
    is gone (never taken for an empty folder)."""
    fs, root = filesystem(uri)
    root = root.rstrip("/")

    def get() -> dict[str, tuple[int, str | None]]:
        fs.invalidate_cache(root)
        found = call(fs, "find", root, maxdepth=1, detail=True)
        if not found and "/" in root:  # an absent bucket lists as empty too
            bucket = root.split("/", 1)[0]
            fs.invalidate_cache(bucket)
            if not call(fs, "exists", bucket):
                raise FileNotFoundError(f"{bucket}: no such bucket")
        return {name.rsplit("/", 1)[-1]: (int(meta.get("size") or 0), etag_of(meta)) for name, meta in found.items()}

    return retrying("listing the uploaded shards", uri.rstrip("/") + "/", get)


def missing_uploads(run: RunDir, uri: str | None = None) -> dict[int, list[str]]:
    """Shard -> what is wrong with each of its recorded objects that the bucket no longer holds as uploaded ("URL
    missing from the bucket", "URL written over in the bucket (...)": another size, or another ETag than the
    upload's, as an object rewritten at the same size has), for the shards with an upload record (to ``uri`` when
    given): the records are read first, then the bucket is listed once per output URI (no object is read), so an
    upload recorded meanwhile is never taken for a missing one. StorageError naming the URL when the bucket cannot
    be listed."""
    records = {}
    for shard in sorted(run.listed_shards(run.uploads_dir, ".json")):
        record = read_record(run, shard)
        if record is not None and (uri is None or record["uri"].rstrip("/") == uri.rstrip("/")):
            records[shard] = record
    listings: dict[str, dict[str, tuple[int, str | None]]] = {}
    out = {}
    for shard, record in records.items():
        where = record["uri"].rstrip("/") + "/"
        if where not in listings:
            listings[where] = listed_objects(where)
        gone = [why for name, want in sorted(record["objects"].items())
                if (why := _not_as_uploaded(where + name, listings[where].get(name), want))]
        if gone:
            out[shard] = gone
    return out


def _not_as_uploaded(url: str, listed: tuple[int, str | None] | None, want: Any) -> str | None:
    """Why the object at ``url`` (its listed size and ETag) is not the one a record entry ``want`` says was uploaded;
    None when it is."""
    if listed is None:
        return f"{url} missing from the bucket"
    if not isinstance(want, dict):
        return None
    size, etag = listed
    if size != want.get("size"):
        return f"{url} written over in the bucket ({size} bytes, {want.get('size')} uploaded)"
    if etag and want.get("etag") and etag != want["etag"]:
        return f"{url} written over in the bucket (ETag {etag}, {want['etag']} when uploaded)"
    return None
