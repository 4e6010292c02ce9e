"""A committed shard's files read back from output_uri, checked against the run's record of their upload.

``uploads/NNNNNN.json`` (written by upload.py once the objects are confirmed) holds the shard's stats and, for each
object (tar, index, stats), its size, ETag and sha256. With keep_local=false the local files are deleted after it is
written, so the record is the shard's done marker and what readers of the run (status, verify, report, dedup, a
resume) use in their place: its stats directly, the tar and index fetched from the bucket. An object there is never
trusted by its name alone: one truncated, emptied or rewritten by another job at the same key has another size or
sha256 than the record, and is refused (RunDirError naming it and the fix), never read as the shard.

An object of a committed shard is rewritten in the bucket only by ``replace_object`` (jobs.signals, filling an index's
columns): the record first names the new bytes beside the old ones (``replacing``), then the object is written, then
the record keeps only the new ones. Readers accept either while both are named, so a reader meanwhile or a kill
between the steps never finds the shard "written over" (which would have the next launch generate it again).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

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


def damaged_record(run: RunDir, shard: int) -> str | None:
    """Why ``shard``'s upload record cannot be read (empty, garbage, cut short, another version's), naming it and
    what repairs it; None when it reads, or there is none."""
    path = run.shard_uploaded(shard)
    if not run.files.present(path):
        return None
    try:
        run.files.state(path, RECORD_FIELDS)
    except RunDirError as e:
        return f"{e}; --repair has the shard generated again"
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
    found = _recorded_object(run, shard, suffix)
    if found is None:
        return None
    fs, path, url, wants, where = found
    data = _read_or_missing(f"reading {path.rsplit('/', 1)[-1]}", url, where,
                            lambda: call(fs, "cat_file", path, size=max(w.get("size") or 0 for w in wants)))
    _check_recorded(len(data), hashlib.sha256(data).hexdigest(), url, wants, where)
    return data


def fetch_into(run: RunDir, shard: int, suffix: str, out: BinaryIO) -> bool:
    """``fetch``, written to ``out`` with a bounded memory whatever the object's size: downloaded to a temporary file
    (``$TMPDIR``), checked against the record, then copied to ``out``; nothing reaches ``out`` unless it is the
    recorded object. False without a record; RunDirError and StorageError as ``fetch``."""
    found = _recorded_object(run, shard, suffix)
    if found is None:
        return False
    fs, path, url, wants, where = found
    with tempfile.NamedTemporaryFile(prefix="shardgen-fetch-", suffix=suffix) as tmp:
        def get() -> bool:
            call(fs, "get_file", path, tmp.name, size=max(w.get("size") or 0 for w in wants))
            return True

        _read_or_missing(f"reading {path.rsplit('/', 1)[-1]}", url, where, get)
        digest, size = hashlib.sha256(), 0
        with open(tmp.name, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                digest.update(chunk)
                size += len(chunk)
        _check_recorded(size, digest.hexdigest(), url, wants, where)
        with open(tmp.name, "rb") as f:
            shutil.copyfileobj(f, out, CHUNK)
    return True


CHUNK = 8 << 20
"""Bytes read at a time when an object is hashed or copied from its temporary file."""


def _recorded_object(run: RunDir, shard: int, suffix: str) -> tuple[Any, str, str, list[dict], str] | None:
    """(filesystem, path in it, URL, what the record says the object may hold, the record's name) of ``shard``'s
    object ``suffix``; None without a record; RunDirError when the record names no such object."""
    record = read_record(run, shard)
    if record is None:
        return None
    name = shard_name(shard) + suffix
    wants = recorded_entries(record, name)
    folder = uploaded_to(run, record)
    where = run.files.where(run.shard_uploaded(shard))
    if not wants:
        raise RunDirError(f"{where} records no {name}; " + REDO.format(record=where))
    fs, root = filesystem(folder)
    return fs, f"{root.rstrip('/')}/{name}", folder + name, wants, where


def _read_or_missing(what: str, url: str, where: str, read: Any) -> Any:
    """``read()`` retried (``retrying``); RunDirError naming the record when the object is gone from the bucket."""
    def get() -> Any:
        try:
            return read()
        except FileNotFoundError as e:
            if permanent_reason(e) == PERMANENT_CODES["NoSuchBucket"]:
                raise  # the whole bucket: a wrong endpoint or URL as likely as a loss; StorageError, not a defect
            return None

    got = retrying(what, url, get)
    if got is None:
        raise RunDirError(f"{url}: missing from the bucket (deleted since its upload, {where}); "
                          + REDO.format(record=where))
    return got


def _check_recorded(size: int, sha: str, url: str, wants: list[dict], where: str) -> None:
    """RunDirError unless ``size`` and ``sha`` are those of an object the record names."""
    if not any(size == w.get("size") and sha == w.get("sha256") for w in wants):
        raise RunDirError(f"{url}: {size} bytes that are not the {wants[0].get('size')} bytes uploaded for this run "
                          f"({where}): truncated, or written over by another job; " + REDO.format(record=where))


def recorded_entries(record: dict, name: str) -> list[dict]:
    """What ``record`` says the object ``name`` may hold (size, ETag, sha256): its uploaded bytes, and while
    ``replace_object`` rewrites it, the new ones too."""
    return [w for w in (record["objects"].get(name), (record.get("replacing") or {}).get(name)) if isinstance(w, dict)]


def replace_object(run: RunDir, shard: int, suffix: str, data: bytes) -> None:
    """Rewrite the uploaded object ``suffix`` (".parquet") of the committed ``shard`` with ``data``, and its record
    with it, so that every reader meanwhile, and after a kill between the steps, finds one of the two named in the
    record (module docstring). The object must read as recorded (``fetch``) first: RunDirError when not."""
    from shardgen.dataio.rundir.fileio import json_bytes

    current = fetch(run, shard, suffix)
    record = read_record(run, shard)
    if current is None or record is None:
        raise RunDirError(f"shard {shard:06d} has no upload record; nothing to replace")
    name = shard_name(shard) + suffix
    sha = hashlib.sha256(current).hexdigest()
    now = next(w for w in recorded_entries(record, name) if w.get("sha256") == sha)  # what the bucket holds now
    path = run.shard_uploaded(shard)
    record = dict(record, objects=dict(record["objects"], **{name: now}), replacing={name: object_entry(data, None)})
    run.files.replace(path, json_bytes(record))
    folder = uploaded_to(run, record)
    fs, root = filesystem(folder)
    target = f"{root.rstrip('/')}/{name}"
    retrying(f"uploading {name}", folder + name, lambda: call(fs, "pipe_file", target, data, size=len(data)))

    def info() -> dict:
        fs.invalidate_cache(target)
        return call(fs, "info", target)

    meta = retrying(f"reading {name}'s metadata", folder + name, info)
    if meta.get("size") != len(data):  # another writer at the same key: the record keeps naming both
        raise RunDirError(f"{folder + name}: {meta.get('size')} bytes on the server after its upload, other than the "
                          f"{len(data)} sent (another job writing the same key?); re-run")
    del record["replacing"]
    record["objects"][name] = object_entry(data, etag_of(meta))
    run.files.replace(path, json_bytes(record))


def uploaded_to(run: RunDir, record: dict) -> str:
    """The folder URL (ending in "/") that holds the objects of an upload ``record``: for a run kept in a bucket, its
    own ``shards/`` folder where the run is now, so that a run whose prefix was copied or moved reads the copies beside
    its records (the record's URL names the prefix it was made at); else the ``output_uri`` the record names."""
    return f"{run.store}/shards/" if run.store else record["uri"].rstrip("/") + "/"


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
        if record is not None and (uri is None or uploaded_to(run, record) == uri.rstrip("/") + "/"):
            records[shard] = record
    listings: dict[str, dict[str, tuple[int, str | None]]] = {}
    out = {}
    for shard, record in records.items():
        where = uploaded_to(run, record)
        if where not in listings:
            listings[where] = listed_objects(where)
        new = record.get("replacing") or {}  # the bytes replace_object is writing: as good as the uploaded ones
        gone = [why for name, want in sorted(record["objects"].items())
                if (why := _not_as_uploaded(where + name, listings[where].get(name), want))
                and not (isinstance(new.get(name), dict)
                         and _not_as_uploaded(where + name, listings[where].get(name), new[name]) is None)]
        if gone:
            out[shard] = gone
    return out


def _not_as_uploaded(url: str, listed: tuple[int, str | None] | None, want: Any) -> str | None:
    """Why the object at ``url`` (its listed size and ETag) is not the one a record entry ``want`` says was uploaded;
    None when it is. An ETag of parts (``<md5>-<n>``) is no digest of the bytes: a copy made in parts (``aws s3 sync``
    of an object over its multipart_threshold) has another one for the same bytes, so only its size is compared here;
    its sha256 is checked whenever it is read (``fetch``)."""
    if listed is None:
        return f"{url} missing from the bucket"
    if not isinstance(want, dict):
        return None
    size, etag = listed
    if size != want.get("size"):
        return f"{url} written over in the bucket ({size} bytes, {want.get('size')} uploaded)"
    if etag and want.get("etag") and etag != want["etag"] and "-" not in etag:
        return f"{url} written over in the bucket (ETag {etag}, {want['etag']} when uploaded)"
    return None
