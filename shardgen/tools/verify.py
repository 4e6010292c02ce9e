"""Auditing a run: every prompt index exactly once across committed shards, every tar readable and
equal to the sha256 its stats recorded, counts equal to the stats, and every sample the one the plan
and the fingerprint say (prompt text, seed, size, steps, model), so a mixed run never passes.
Used by ``jobs.verify`` (``--repair``) and the tests."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from shardgen.dataio.prompts.plan import Plan, PlannedRow, file_sha256, sample_key
from shardgen.dataio.prompts.read import PromptFileError
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.shards.index import committed_samples
from shardgen.dataio.shards.shardwork import shard_checkpoints
from shardgen.dataio.shards.upload import fetch_uploaded
from shardgen.dataio.shards.uploaded import damaged_record, missing_uploads
from shardgen.dataio.shards.formats import MEDIA_EXTS, OUTPUT_FORMATS
from shardgen.dataio.shards.container import read_shard_members
from shardgen.dataio.shards.video import VIDEO_EXT, check_video_member
from shardgen.errors import UserError


@dataclass
class VerifyReport:
    """Defects found, and the shards not committed yet (an unfinished run is not a defective one)."""

    shards_checked: int = 0
    samples: int = 0
    status: Counter = field(default_factory=Counter)
    defects: list[str] = field(default_factory=list)
    bad_shards: dict[int, str] = field(default_factory=dict)  # shard -> "tar" (regenerate), "stats" (rewrite) or
    # "upload" (sound locally, gone from the bucket: its upload record removed, uploaded again)
    unfinished: list[str] = field(default_factory=list)  # a line per shard not committed yet: in progress, not started
    earlier_settings: Counter = field(default_factory=Counter)
    """Samples made with settings the run had before a recorded allow_fingerprint_change: "steps=1" -> count.
    Not defects: the change was asked for, and --repair keeps them."""
    in_progress: int = 0                                  # of those, shards with durable samples in work/
    stray: list[str] = field(default_factory=list)  # files in shards/ named like a shard the plan does not have

    @property
    def sound(self) -> bool:
        """No defect in what is committed (the run may be unfinished)."""
        return not self.defects

    @property
    def ok(self) -> bool:
        """Complete and sound."""
        return not self.defects and not self.unfinished


def _check_sample(key: str, members: dict[str, bytes], decode: bool) -> tuple[str, dict, list[str]]:
    problems = []
    for ext in ("txt", "json"):
        if ext not in members:
            problems.append(f"{key}: no .{ext}")
    try:
        meta = json.loads(members.get("json", b"{}"), parse_constant=_no_constant)
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as e:
        return "?", {}, problems + [f"{key}: the json is not a standard JSON object ({e})"]
    status = meta.get("status", "?")
    images = [e for e in MEDIA_EXTS if e in members]
    if status == "ok" and len(images) != 1:
        problems.append(f"{key}: status ok but {len(images)} images")
    if status != "ok" and images:
        problems.append(f"{key}: status {status} but has an image")
    if status != "ok" and not meta.get("error"):
        problems.append(f"{key}: status {status} without a recorded reason")
    if decode and images == [VIDEO_EXT]:  # decodes every frame; counts them against the json
        problems += check_video_member(key, members[VIDEO_EXT], meta)
    elif decode and images:
        try:
            height, width = OUTPUT_FORMATS[images[0]].decode(members[images[0]]).shape[:2]
            if (width, height) != (meta.get("width"), meta.get("height")):
                problems.append(f"{key}: the image is {width}x{height}, its json says "
                                f"{meta.get('width')}x{meta.get('height')}")
        except Exception as e:
            problems.append(f"{key}: image does not decode ({e})")
    return status, meta, problems


def _no_constant(name: str):
    raise ValueError(f"{name} is not standard JSON")


# sample-json key -> fingerprint key: what every sample must agree on with the run's fingerprint
FINGERPRINT_KEYS = {"model": "model.name", "height": "height", "width": "width", "steps": "steps",
                    "guidance": "guidance"}


def _check_content(key: str, meta: dict, txt: bytes | None, row: PlannedRow | None, fp: dict | None,
                   earlier: dict[str, list] | None = None, older: Counter | None = None) -> list[str]:
    """The sample is the one the plan and the fingerprint say: prompt text, seed, size, steps, model. A setting
    equal to a value in ``earlier`` (fingerprint key -> values before recorded changes) is counted in ``older``."""
    if row is None:
        return []
    problems = []
    if meta.get("index") != row.index:
        problems.append(f"{key}: index {meta.get('index')!r}, the plan says {row.index}")
    if row.reject is not None:
        if meta.get("status") != "rejected":
            problems.append(f"{key}: the plan rejects this row, the sample has status {meta.get('status')!r}")
        return problems
    if meta.get("prompt") != row.prompt or txt != row.prompt.encode("utf-8"):
        problems.append(f"{key}: the prompt differs from the plan's (row {row.index}, line {row.line})")
    if meta.get("seed") != row.seed:
        problems.append(f"{key}: seed {meta.get('seed')!r}, the plan says {row.seed}")
    for mk, fk in FINGERPRINT_KEYS.items():
        if mk in row.settings:  # the row's own (prompts.row_settings): its image is checked against its json above
            if meta.get(mk) != row.settings[mk]:
                problems.append(f"{key}: {mk}={meta.get(mk)!r}, its row (line {row.line}) says {row.settings[mk]!r}")
        elif fp is not None and fk in fp and meta.get(mk) != fp[fk]:
            if meta.get(mk) in (earlier or {}).get(fk, ()) and older is not None:
                older[f"{mk}={meta.get(mk)!r}"] += 1
            else:
                problems.append(f"{key}: {mk}={meta.get(mk)!r}, the run's fingerprint says {fp[fk]!r}")
    return problems + _check_adapters(key, meta, row, fp) + _check_input_image(key, meta, row)


def _check_adapters(key: str, meta: dict, row: PlannedRow, fp: dict | None) -> list[str]:
    """The sample was made with its row's LoRA adapters (prompts.row_settings=[loras]), else the run's (model.loras):
    the same files (sha256) at the same scales, in the same order."""
    own = row.settings.get("loras")
    if own is None and fp is None:
        return []
    want = [[lo.sha256, lo.scale] for lo in own] if own is not None else fp.get("model.loras", [])
    got = [[a.get("sha256"), a.get("scale")] for a in meta.get("loras") or [] if isinstance(a, dict)]
    if got == want:
        return []
    whose = f"its row (line {row.line})" if own is not None else "the run's fingerprint"
    return [f"{key}: made with LoRA adapters (sha256, scale) {got}, {whose} says {want}"]


def _check_input_image(key: str, meta: dict, row: PlannedRow) -> list[str]:
    """The sample names its row's input image (prompts.row_settings=[image]): the path the row wrote, or for image
    bytes in the prompt file (parquet) their very sha256; a file's content may change under a run (its json records
    the content used), its path may not."""
    image, got = row.settings.get("image"), meta.get("input_image")
    if image is None:
        return [f"{key}: made from an input image its row (line {row.line}) does not name"] if got else []
    got = got if isinstance(got, dict) else {}
    if image.data is not None:
        want = hashlib.sha256(image.data).hexdigest()
        if meta.get("status", "ok") == "ok" and got.get("sha256") != want:
            return [f"{key}: made from an input image of sha256 {got.get('sha256')!r}, its row's (line {row.line}) "
                    f"bytes have {want}"]
    elif got.get("path") != image.ref:
        return [f"{key}: made from input image {got.get('path')!r}, its row (line {row.line}) names {image.ref!r}"]
    return []


def verify_run(plan: Plan, decode: bool = True) -> VerifyReport:
    """Check every shard of ``plan``; report each defect in a line that names the shard and key."""
    from shardgen.dataio.resume.fingerprint import read_fingerprint

    rep = VerifyReport()
    try:
        fp = read_fingerprint(plan.run)
        if fp is None:
            rep.defects.append(f"{plan.run.fingerprint_path}: missing (nothing says which settings made the run)")
    except RunDirError as e:
        fp = None
        rep.defects.append(str(e))
    earlier = earlier_settings(plan.run)
    gone = missing_uploads(plan.run)  # one listing of the bucket (none without upload records)
    for shard in range(plan.num_shards):
        _verify_shard(plan, shard, fp, decode, rep, earlier, gone)
    _check_stray(plan, rep)
    return rep


def _check_stray(plan: Plan, rep: VerifyReport) -> None:
    """A defect for each file in shards/ named like a shard the plan does not have (loaders read it as the run's)."""
    from shardgen.dataio.resume.repair import STRAY_DIR, stray_shard_files

    try:
        names = os.listdir(plan.run.shards_dir)
    except (FileNotFoundError, NotADirectoryError):
        return
    rep.stray = stray_shard_files(plan.run, plan.num_shards, names)
    for name in rep.stray:
        rep.defects.append(f"shards/{name}: named like a shard of this run, but the plan has {plan.num_shards} "
                           f"shards: a loader of shards/* reads its samples as this run's (--repair moves it to "
                           f"{STRAY_DIR}/)")


def earlier_settings(run) -> dict[str, list]:
    """Fingerprint key -> the values it had before each recorded allow_fingerprint_change."""
    from shardgen.dataio.resume.fingerprint import fingerprint_changes

    out: dict[str, list] = defaultdict(list)
    for record in fingerprint_changes(run):
        for key, change in (record.get("changes") or {}).items():
            if isinstance(change, list) and change:
                out[key].append(change[0])
    return dict(out)


def _verify_shard(plan: Plan, shard: int, fp: dict | None, decode: bool, rep: VerifyReport,
                  earlier: dict[str, list] | None = None, gone: dict[int, list[str]] | None = None) -> None:
    """``gone``: shard -> its uploaded objects the bucket no longer holds (``missing_uploads``)."""
    from shardgen.dataio.resume.repair import checked_rows, read_shard_stats

    run = plan.run
    tar, stats_path = run.shard_file(shard), run.shard_stats(shard)
    name = f"shard {shard:06d}"
    if not run.files.present(stats_path) and not run.files.present(run.shard_uploaded(shard)):  # not committed yet
        rep.unfinished.append(_unfinished_line(plan, shard, os.path.lexists(tar)))
        if os.path.lexists(tar):
            rep.bad_shards[shard] = "stats"
        rep.in_progress += "not started" not in rep.unfinished[-1]
        return
    rep.shards_checked += 1
    missing = (gone or {}).get(shard)
    if missing and not os.path.lexists(tar):  # keep_local=false: the bucket held its only copy
        rep.bad_shards[shard] = "tar"
        record = run.files.where(run.shard_uploaded(shard))
        rep.defects.append(f"{name}: {'; '.join(missing)} since its upload ({record}): --repair "
                           "has the shard generated and uploaded again")
        return
    if not os.path.lexists(tar) and (damage := damaged_record(run, shard)):  # the only done marker is unreadable
        rep.bad_shards[shard] = "tar"
        rep.defects.append(f"{name}: {damage}")
        return
    try:  # keep_local=false: in the bucket, checked against the upload record
        uploaded = fetch_uploaded(run, shard) if not os.path.lexists(tar) else None
    except RunDirError as e:  # not the bytes uploaded: --repair has it generated again
        rep.bad_shards[shard] = "tar"
        rep.defects.append(f"{name}: {e}")
        return
    if uploaded is not None:
        tar = io.BytesIO(uploaded)
    elif tar.is_symlink() or not tar.is_file():
        rep.bad_shards[shard] = "tar"
        rep.defects.append(f"{name}: {tar} is {'a symlink' if tar.is_symlink() else 'missing'}")
        return
    try:
        st = read_shard_stats(run, shard)
    except RunDirError as e:
        st = None
        rep.bad_shards[shard] = "stats"
        rep.defects.append(f"{name}: {e}")
    try:
        members = read_shard_members(tar, run.container)
    except Exception as e:
        rep.bad_shards[shard] = "tar"
        rep.defects.append(f"{name}: unreadable tar {run.shard_file(shard)} ({e})")
        return
    try:
        members, problems = committed_samples(run, shard, members)  # + the failed/rejected rows of the index
    except RunDirError as e:  # the bucket's index is not the one uploaded
        members, problems = members, [str(e)]
    rep.defects += [f"{name}: {p}" for p in problems]
    if problems:  # the index and the tar disagree: --repair regenerates the shard (or rebuilds its stats)
        rep.bad_shards[shard] = "tar"
    try:
        rows = {sample_key(r.index): r for r in checked_rows(plan, shard)}
    except PromptFileError as e:  # changed or gone since planning: one line for the run, not one per shard
        rows = {}
        if str(e) not in rep.defects:
            rep.defects.append(str(e))
    except UserError as e:  # a damaged plan
        rows = {}
        rep.defects.append(f"{name}: {e}")
    before = len(rep.defects)
    expected = {sample_key(i) for i in plan.shard_range(shard)}
    got = set(members)
    if got != expected:
        rep.defects.append(f"{name}: {len(expected - got)} prompt indices missing, {len(got - expected)} unexpected keys")
    if st is not None and "sha256" in st and st["sha256"] != (hashlib.sha256(uploaded).hexdigest() if uploaded
                                                             else file_sha256(tar)):
        rep.defects.append(f"{name}: {run.shard_file(shard).name} does not match the sha256 in its stats (damaged "
                           "after its commit)")
    shard_status: Counter = Counter()
    for key, mem in members.items():
        status, meta, problems = _check_sample(key, mem, decode)
        problems += _check_content(key, meta, mem.get("txt"), rows.get(key), fp, earlier, rep.earlier_settings)
        shard_status[status] += 1
        rep.defects += [f"{name}: {p}" for p in problems]
    if len(rep.defects) > before:
        rep.bad_shards[shard] = "tar"
    if st is not None:
        stats_problems = [f"{name}: stats count {st['count']} != {len(got)} samples in the tar"] \
            if st["count"] != len(got) else []
        stats_problems += [f"{name}: stats say {st.get(k, 0)} {k}, the tar has {shard_status[k]}"
                           for k in ("ok", "failed", "rejected") if st.get(k, 0) != shard_status[k]]
        if stats_problems:
            rep.defects += stats_problems
            rep.bad_shards.setdefault(shard, "stats")
    if missing:  # keep_local=true: the local copy stands; the upload is made again from it
        record = run.files.where(run.shard_uploaded(shard))
        rep.defects.append(f"{name}: {'; '.join(missing)} since its upload ({record}); --repair "
                           "removes its upload record: the next launch uploads the local copy again")
        rep.bad_shards.setdefault(shard, "upload")
    rep.status.update(shard_status)
    rep.samples += len(got)


def _unfinished_line(plan: Plan, shard: int, has_tar: bool) -> str:
    name, rows = f"shard {shard:06d}", len(plan.shard_range(shard))
    if has_tar:
        return (f"{name}: its commit was interrupted (its tar is there, no {plan.run.shard_stats(shard).name}); the "
                "next launch, or --repair, finishes it")
    done = max((c["n_done"] for c in shard_checkpoints(plan.run, shard)), default=0)
    return f"{name}: in progress, {done}/{rows} samples durable in work/" if done else f"{name}: not started"


def repair_run(plan: Plan, report: VerifyReport) -> list[str]:
    """Make every defective shard of ``report`` sound or absent: stats rewritten from a sound tar, else
    the shard removed (generated again by the next launch); stray shard files moved out of shards/. A line for each
    repair."""
    from shardgen.dataio.resume.repair import finish_or_discard, move_stray_shard_files, remove_committed

    run, out = plan.run, []
    out += [note for _, note in move_stray_shard_files(run, plan.num_shards, report.stray)]
    for shard, what in sorted(report.bad_shards.items()):
        if what == "tar":  # the samples themselves are wrong: regenerate
            remove_committed(run, shard)
            out.append(f"shard {shard:06d}: removed; the next launch generates it again")
        elif what == "upload":  # sound locally, gone from the bucket: uploaded again
            run.files.delete(run.shard_uploaded(shard))
            out.append(f"shard {shard:06d}: its upload record removed; the next launch uploads it again")
        else:
            run.files.delete(run.shard_stats(shard))
            out.append(finish_or_discard(run, shard, plan.shard_range(shard), "its stats do not match its tar"))
    return out
