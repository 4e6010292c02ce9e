"""Checking a run directory at launch, before anything is trusted: what is safe to repair is repaired
(and logged), what is not is refused with a message naming the file and the fix.

Repaired (the rest of the run directory makes it safe):
- leftovers of killed jobs (temp files, temporary plan directories): removed (``RunDir.clean_leftovers``);
- symlinks where shard, work or claim files should be: removed (never followed), reported;
- a missing or damaged plan: planned again, which gives the same plan (the fingerprint has the
  prompt file's sha256 and every setting the plan is made from);
- a committed tar without its stats (a kill between the two): finished from the tar, not regenerated;
- a committed shard whose stats are damaged or whose tar does not match them: stats rewritten from
  the tar when the tar is whole, else both removed so the shard is generated again;
- a partial tar that does not match its checkpoint: restarted (``ShardWork.open``).
Refused: a run without a valid fingerprint, a symlinked fingerprint or plan file, symlinked directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from shardgen.dataio.prompts.plan import (Plan, PlanError, PlannedRow, discard_plan, extended_plan_fix, extension_dirs,
                                         file_sha256, load_plan, sample_key)
from shardgen.errors import UserError
from shardgen.dataio.resume.fingerprint import read_fingerprint
from shardgen.dataio.rundir.checks import near_url_advice
from shardgen.dataio.rundir.claims import claim_state, owner_record, read_claim, scan_claims
from shardgen.dataio.rundir.fileio import atomic_write_bytes, json_bytes, map_io, open_regular
from shardgen.dataio.rundir.layout import RunDir, own_file_name, shard_name
from shardgen.dataio.rundir.remote import StorageError
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.shards.container import get_container
from shardgen.dataio.shards.shardwork import committed_stats, shard_stats, stats_from_samples
from shardgen.dataio.shards.upload import uploaded_elsewhere
from shardgen.dataio.shards import index as shard_index

log = logging.getLogger("shardgen.repair")
REPLAN_HINT = "delete {plan_json} and re-run: the plan is made again from the prompt file, identically"


def _refuse_symlinks(directory: Path, what: str) -> None:
    if directory.is_symlink():
        raise RunDirError(f"{directory} is a symlink; {what} must be a real directory. Replace the link by a copy")
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        if (directory / name).is_symlink():
            raise RunDirError(f"{directory / name} is a symlink; {what} files must be regular files. "
                              f"Replace it by the file it points to, or delete it and re-run")


def load_plan_or_discard(run: RunDir, prompt_path: str | os.PathLike | None = None) -> Plan | None:
    """The run's plan if it is whole; None (after moving a damaged one out of the way) when it must be
    made again. Call only after the fingerprint matched: then planning again gives the same plan.
    ``prompt_path``: where the launch found the prompt file (its content checked by the fingerprint).

    No plan yet is no damage, even when a concurrent launch publishes one just after this look: this launch then
    plans, finds that plan in place and adopts it (``publish_plan``); discarding it would pull it from under the
    launch that made it. An unreachable store is no damage either (its StorageError is raised)."""
    _refuse_symlinks(run.plan_dir, "plan")
    try:
        plan = load_plan(run, prompt_path)
    except StorageError:
        raise
    except (PlanError, OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        # a PlanError's fault alone, without its fix (delete the folder, re-run): this function repairs, or refuses
        plan, damage = None, getattr(e, "fault", None) or f"{run.files.where(run.plan_json_path)} is damaged ({e})"
    else:
        if plan is None:
            return None
        missing = [p for p in plan_files(run) if _plan_file_digest(run, p, with_sha256=False) is None]
        damage = f"{run.files.where(missing[0])} is missing" if missing else _plan_digest_problem(plan, full=True)
        if damage is None:
            _refuse_a_lost_extension(plan)
            return plan
    if extension_dirs(run):
        raise RunDirError(f"{damage}, and {extended_plan_fix(run)}")
    log.warning("%s; planning again from the prompt file (the fingerprint guarantees the same plan)", damage)
    discard_plan(run, "damaged")
    return None


def _refuse_a_lost_extension(plan: Plan) -> None:
    """RunDirError when the plan lacks an extension the run's fingerprint says was made (``Plan.lost_extension``):
    a whole plan of the first rows would otherwise finish the run without the appended ones."""
    try:
        fingerprint = read_fingerprint(plan.run) or {}
    except RunDirError:
        return  # damaged: the launch's fingerprint check names it first; a read-only tool still shows the run
    if problem := plan.lost_extension(fingerprint.get("prompts.sha256")):
        raise RunDirError(problem)


def plan_files(run: RunDir) -> list[Path]:
    """The files a plan is made of (plan.json, and where each shard starts in the prompt file)."""
    return [run.plan_json_path, run.starts_path]


def record_plan_digests(plan: Plan) -> None:
    """Record the sha256 and size of every plan file (once, when the plan was made or first seen). Nothing is
    recorded while a plan file is missing (a concurrent launch discarding a damaged plan): the launch that plans
    again records it."""
    run = plan.run
    if _recorded_digests(run) is not None:
        return
    digests = {p.name: _plan_file_digest(run, p) for p in plan_files(run)}
    if None in digests.values():
        return
    run.files.replace(run.plan_digests_path, json_bytes({name: list(d) for name, d in digests.items()}))


def _recorded_digests(run: RunDir) -> dict | None:
    """plan_digests.json: {plan file name: [size, sha256]}; None when there is none, or none to trust (damaged, or
    recording a missing file: re-recorded from the current plan)."""
    try:
        digests = run.files.state(run.plan_digests_path)
    except RunDirError:
        return None
    if not isinstance(digests, dict) or not all(
            isinstance(d, list) and len(d) == 2 and isinstance(d[0], int) and d[0] >= 0 for d in digests.values()):
        return None
    return digests


def _plan_file_digest(run: RunDir, path: Path, with_sha256: bool = True) -> tuple[int, str | None] | None:
    """(size, sha256) of a plan file, read once from the run's store (in the directory the sha256 only when
    ``with_sha256``: a stat gives the size); None when it is not there (in the directory: not a regular file)."""
    if not run.store:
        if not path.is_file():
            return None
        return path.stat().st_size, file_sha256(path) if with_sha256 else None
    data = run.files.read(path)
    return None if data is None else (len(data), hashlib.sha256(data).hexdigest())


FULL_CHECK_BYTES = 256 << 20  # at launch, plans up to this size are hashed whole; larger ones by size only


def _plan_digest_problem(plan: Plan, full: bool, only: list[Path] | None = None) -> str | None:
    """Why a plan file differs from what was recorded when the plan was made (None: it does not)."""
    run = plan.run
    digests = _recorded_digests(run)
    if digests is None:
        return None  # not recorded (a run from before), or damaged: re-recorded from the current plan
    files = only or plan_files(run)
    found = {p: _plan_file_digest(run, p, with_sha256=False) for p in files}
    hash_them = full and sum(f[0] for f in found.values() if f) <= FULL_CHECK_BYTES
    for p in files:
        want = digests.get(p.name)
        if want is None:
            return f"{run.files.where(p)} is not in {run.plan_digests_path.name}"
        have = found[p]
        if have is None or have[0] != want[0] or (hash_them and (have[1] or file_sha256(p)) != want[1]):
            return f"{run.files.where(p)} was changed after the plan was made"
    return None


STORED_PLAN_CHECK_S = 600.0  # how often a process checks again the plan files of a run kept in a bucket
_stored_plan_checked: dict[str, float] = {}  # the run's URL -> when this process last checked its plan files


def _plan_check_due(run: RunDir) -> bool:
    """Whether ``checked_rows`` checks the plan files against their digests now: always in a run directory (a
    stat and a read of local files); for a run kept in a bucket, where each check is about 5 requests, once per
    STORED_PLAN_CHECK_S per process (its plan files are written once, before its plan.json is published)."""
    if not run.store:
        return True
    now = time.monotonic()
    if now - _stored_plan_checked.get(run.store, -STORED_PLAN_CHECK_S) < STORED_PLAN_CHECK_S:
        return False
    _stored_plan_checked[run.store] = now
    return True


def checked_rows(plan: Plan, shard: int) -> list[PlannedRow]:
    """The plan's rows of ``shard``, checked against the digest recorded when the plan was made and the
    plan's numbering (RunDirError naming the file and the fix)."""
    path = plan.run.files.where(plan.run.starts_path)
    # an extended run's plan cannot be made again from the grown file: deleting plan.json would only lose it
    fix = extended_plan_fix(plan.run) if plan.extensions else \
        REPLAN_HINT.format(plan_json=plan.run.files.where(plan.run.plan_json_path))
    changed = _plan_digest_problem(plan, full=True) if _plan_check_due(plan.run) else None
    if changed:
        raise RunDirError(f"{changed}; {fix}")
    try:
        rows = plan.rows(shard)
    except UserError:
        raise  # the prompt file (changed, or gone), a row's adapter changed: its own message names it and the fix
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise RunDirError(f"{path} is damaged ({e.__class__.__name__}: {e}); {fix}") from None
    if [r.index for r in rows] != list(plan.shard_range(shard)) \
            or any(not isinstance(r.seed, int) or (r.prompt is None and r.reject is None) for r in rows):
        raise RunDirError(f"{path} does not hold rows {plan.shard_range(shard).start}..{plan.shard_range(shard).stop - 1} "
                          f"as plan.json says; {fix}")
    return rows


def repair_run_dir(plan: Plan, lease_s: float) -> list[str]:
    """Check what a launch must trust; repair what is safe to repair; a line for each repair done."""
    run = plan.run
    # one listing of shards/ (300k names on a 100k-shard run) serves the leftovers, the symlinks and the checks
    shards_dir_ok = run.shards_dir.is_dir() and not run.shards_dir.is_symlink()
    with os.scandir(run.shards_dir) if shards_dir_ok else contextlib.nullcontext([]) as it:
        entries = {e.name: e for e in it}
    listed = {run.shards_dir: list(entries)} if shards_dir_ok else None
    removed = run.clean_leftovers(listed=listed)
    notes = [f"removed {p.name}, left by a killed job" for p in removed]
    links = _remove_symlinks(run, entries if shards_dir_ok else None)
    notes += [line for line, _ in links]
    for path in removed + [p for _, p in links]:
        if path.parent == run.shards_dir:
            entries.pop(path.name, None)
    if stray_shard_files(run, plan.num_shards, entries):
        fresh = load_plan(run)  # a concurrent launch may have extended the plan (appended prompts) since this one read it
        for name, note in move_stray_shard_files(run, max(plan.num_shards, fresh.num_shards if fresh else 0), entries):
            notes.append(note)
            entries.pop(name, None)
    claims = scan_claims(run) if run.store or run.claims_dir.is_dir() else {}
    me = owner_record(-1)
    notes += _remove_committed_work(run, claims, lease_s, me)
    # only the shards that have files in shards/ are checked, and of those only the ones whose files changed
    # since a launch found them sound (their sizes and mtimes come with the listing), the rest concurrently: on a
    # shared filesystem 100k shards checked one after another at every launch of every job would take minutes each
    present = sorted({int(n[:6]) for n in entries if n[:6].isdigit() and n.endswith((f".{run.container}", ".stats.json"))}
                     & set(range(plan.num_shards)))
    if run.store:  # shards/ here only stages uploads: a shard of a run in a bucket is committed by its upload record
        present = []  # alone, made under its claim; what a killed upload left is generated again by its next holder
    seen = {s: _files_signature(run, s, entries) for s in present}
    before = _read_checked(run)
    todo = [s for s in present if seen[s] is None or before.get(s) != seen[s]]
    problems = dict(zip(todo, map_io(lambda s: committed_shard_problem(run, s), todo)))
    sound = {s: seen[s] for s in present if problems.get(s) is None and seen[s] is not None}
    if sound != before:
        _write_checked(run, sound)
    for shard, problem in problems.items():
        if problem is None:
            continue
        gen = claims.get(shard)
        if gen is not None and claim_state(*read_claim(run, shard, gen), time.time(), lease_s, me) in ("running", "future"):
            continue  # a live holder is rewriting it right now (retry_failed): its commit decides
        notes.append(finish_or_discard(run, shard, plan.shard_range(shard), problem))
    for line in notes:
        log.warning("%s: %s", run.name, line)
    return notes


STRAY_DIR = "stray"  # run_dir/stray/: files named like shards the plan does not have, moved out of shards/


def stray_shard_files(run: RunDir, num_shards: int, names: Iterable[str]) -> list[str]:
    """The names among ``names`` (a listing of shards/) that shardgen gives a shard's files, for a shard number the
    plan does not have (``num_shards`` or more): a copy or another run's file, whose samples a loader of
    shards/*.tar or shards/*.parquet would read as this run's (twice, or prompts it never had)."""
    suffixes = (f".{run.container}", ".stats.json", ".parquet")
    return sorted(n for n in names if len(n) > 6 and n[:6].isdigit() and n[6:] in suffixes and int(n[:6]) >= num_shards)


def move_stray_shard_files(run: RunDir, num_shards: int, names: Iterable[str]) -> list[tuple[str, str]]:
    """Move the stray shard files among ``names`` out of shards/ into stray/ (kept, not deleted: they may be the
    user's); (name, note) for each moved."""
    out = []
    folder = run.stray_dir
    for name in stray_shard_files(run, num_shards, names):
        if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
            raise RunDirError(f"{folder} is {'a symlink' if folder.is_symlink() else 'not a directory'}; shardgen "
                              f"moves files named like shards the plan lacks (shards/{name}) there, and never writes "
                              "through a link. Move it away and re-run")
        folder.mkdir(exist_ok=True)
        dest, i = folder / name, 0
        while os.path.lexists(dest):  # an earlier launch moved one of this name: both kept
            i += 1
            dest = folder / f"{name}.{i}"
        try:
            os.rename(run.shards_dir / name, dest)
        except FileNotFoundError:  # a concurrent launch moved it first
            continue
        out.append((name, f"moved shards/{name} to {STRAY_DIR}/{dest.name}: the plan has no shard {name[:6]} (it has "
                          f"{num_shards}), so a loader of shards/* would have read its samples as this run's"))
    return out


def _remove_committed_work(run: RunDir, claims: dict, lease_s: float, me: dict) -> list[str]:
    """Remove the work files (partial shard, its index, checkpoint) of shards already committed: a job killed
    between a commit's done marker and its cleanup leaves them, and no later claim of the shard (it is done) would.
    A shard a live holder is rewriting (retry_failed) keeps its own."""
    if not run.work_dir.is_dir():
        return []
    with os.scandir(run.work_dir) as it:
        names = [e.name for e in it if e.name[:6].isdigit() and e.name[6:8] == ".g"]
    notes = []
    for shard in sorted({int(n[:6]) for n in names}):
        gen = claims.get(shard)
        if not run.is_done(shard) or (gen is not None and claim_state(*read_claim(run, shard, gen), time.time(),
                                                                      lease_s, me) in ("running", "future")):
            continue
        for name in (n for n in names if int(n[:6]) == shard):
            (run.work_dir / name).unlink(missing_ok=True)
            notes.append(f"removed work/{name}: shard {shard:06d} is committed (left by a job killed after its commit)")
    return notes


def _files_signature(run: RunDir, shard: int, entries: dict) -> tuple[int, ...] | None:
    """Sizes and mtimes of a committed shard's stats, tar and index, from the listing of shards/ (None: one is
    missing, so it must be checked)."""
    out = []
    name = shard_name(shard)  # names, not paths: 100k Path objects cost seconds at every launch
    for file in (f"{name}.stats.json", f"{name}.{run.container}", f"{name}.parquet"):  # .shard_stats, .shard_file, index
        e = entries.get(file)
        if e is None:
            return None
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            return None
        out += [st.st_mode, st.st_size, st.st_mtime_ns]
    return tuple(out)


_CHECKED_COLS = 10  # shard, then (mode, size, mtime_ns) of its stats, tar and index


def _read_checked(run: RunDir) -> dict[int, tuple[int, ...]]:
    """shard -> the signature a launch found sound (``shards_checked.npy``: one int64 row per shard; a JSON object
    of 100k entries took seconds to parse at every launch)."""
    path = run.shards_checked_path
    try:
        if path.is_symlink():
            return {}
        with open_regular(path) as f:
            rows = np.load(f, allow_pickle=False)
        if rows.dtype != np.int64 or rows.ndim != 2 or rows.shape[1] != _CHECKED_COLS:
            return {}
    except Exception:  # none yet, or damaged (numpy's errors vary): every shard is checked again
        return {}
    return {r[0]: tuple(r[1:]) for r in rows.tolist()}


def _write_checked(run: RunDir, sound: dict[int, tuple[int, ...]]) -> None:
    rows = np.array([(s, *sig) for s, sig in sorted(sound.items())], np.int64).reshape(-1, _CHECKED_COLS)
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    atomic_write_bytes(run.shards_checked_path, buf.getvalue())


def _not_a_file(e: os.DirEntry) -> bool:
    """A symlink, FIFO, socket or device (from the listing: no stat for the usual regular file or directory)."""
    return e.is_symlink() or not (e.is_file(follow_symlinks=False) or e.is_dir(follow_symlinks=False))


def _remove_symlinks(run: RunDir, shards_entries: dict | None = None) -> list[tuple[str, Path]]:
    """Remove symlinks, FIFOs, sockets and devices where shardgen's own files go (never followed or read: a FIFO
    blocks its reader); a user's other entries stay. (note, path) for each; ``shards_entries``: the caller's
    listing of shards/ (not listed again)."""
    notes = []
    run.check_own_dirs()
    for d in (run.shards_dir, run.uploads_dir, run.work_dir, run.claims_dir, run.logs_dir):
        if d == run.shards_dir and shards_entries is not None:
            links = [n for n, e in shards_entries.items() if _not_a_file(e) and own_file_name(d.name, n)]
        else:
            with os.scandir(d) if d.is_dir() else contextlib.nullcontext([]) as entries:
                # from the listing: no stat per entry; only links at names shardgen uses (a user's own stay)
                links = [e.name for e in entries if _not_a_file(e) and own_file_name(d.name, e.name)]
        for name in links:
            (d / name).unlink()
            notes.append((f"removed {d.name}/{name}, a symlink or special file (run files are regular files; it "
                           "was not followed or read)", d / name))
    for path in (run.prompt_hash_path, run.summary_path, run.shards_checked_path, run.config_path,
                 run.fingerprint_changes_path, run.plan_digests_path, run.launches_path, run.stats_cache_path):
        if path.is_symlink() or (os.path.lexists(path) and not path.is_file() and not path.is_dir()):
            path.unlink()
            notes.append((f"removed {path.name}, a symlink or special file (it was not followed or read)", path))
    return notes


def read_shard_stats(run: RunDir, shard: int) -> dict:
    """A committed shard's stats (RunDirError naming the file when it is damaged), from its stats file or, once
    its local files were deleted after their upload, its upload record."""
    return committed_stats(run, shard)


def committed_shard_problem(run: RunDir, shard: int) -> str | None:
    """Why shard ``shard`` is not soundly committed (None: it is, or nothing of it is committed).
    Cheap: the stats parse and the tar is a regular file of the size they record (jobs.verify also
    checks the tar's sha256 and every sample)."""
    stats_path, tar = run.shard_stats(shard), run.shard_file(shard)
    has_stats, has_tar = run.files.present(stats_path), os.path.lexists(tar)
    if not has_stats:
        return "a committed tar without its stats (a kill between the two)" if has_tar else None
    try:
        stats = read_shard_stats(run, shard)
    except RunDirError as e:
        return str(e)
    if not has_tar and uploaded_elsewhere(run, shard, stats["tar_bytes"]):  # deleted once uploaded (keep_local=false)
        return None  # its index and stats go next; the bucket's objects are checked against the record when read
    if not has_tar or tar.is_symlink():
        return f"{tar.name} is missing"
    size = tar.lstat().st_size
    if size != stats["tar_bytes"] or stats["shard"] != shard:
        return f"{tar.name} is {size} bytes, its stats say {stats['tar_bytes']}"
    return shard_index.index_problem(run, shard, stats["count"])


def finish_or_discard(run: RunDir, shard: int, indices: range, problem: str) -> str:
    """Write a committed shard's stats from its index and tar when both are whole and agree; else remove the
    shard (stats first: the done marker) so it is generated again. The line saying what was done."""
    tar = run.shard_file(shard)
    rows = _committed_rows(run, shard, indices)
    keys = [r["key"] for r in rows if r["status"] == "ok"] if rows is not None else None
    scan = get_container(run.container).scan(tar, keys) if keys is not None and tar.is_file() and not tar.is_symlink() \
        else None
    size = tar.stat().st_size if scan is not None else 0
    if scan is not None and scan.complete and len(scan.samples) == len(keys) and size == scan.closed_end:
        counts, reasons, failed, shapes = stats_from_samples(shard, [json.loads(r["json"]) for r in rows])
        run.files.replace(run.shard_stats(shard), json_bytes(shard_stats(
            shard, counts, reasons, failed, tar_bytes=size, sha256=file_sha256(tar), started=tar.stat().st_mtime,
            shapes=shapes)))
        return f"shard {shard:06d}: {problem}; its tar is whole, so its stats were written from it (not regenerated)"
    remove_committed(run, shard)
    why = scan.problem if scan and scan.problem else "incomplete tar" if scan else \
        "no readable index" if rows is None else "no tar"
    return f"shard {shard:06d}: {problem} ({why}); removed, it is generated again"


def remove_committed(run: RunDir, shard: int) -> None:
    """Remove what commits ``shard`` (stats first: the done marker; its upload record, which stands in for it once
    the local files are deleted, with it), so that it is generated again."""
    for marker in (run.shard_stats(shard), run.shard_uploaded(shard)):
        run.files.delete(marker)
    for path in (run.shard_file(shard), shard_index.index_path(run, shard)):  # local wherever the markers are
        path.unlink(missing_ok=True)


def _committed_rows(run: RunDir, shard: int, indices: range) -> list[dict] | None:
    """The committed index rows of ``shard`` when they are exactly its plan's samples, in order; else None."""
    try:
        rows = shard_index.read_index(run, shard, ("key", "status", "json"))
    except Exception:  # a damaged parquet file: pyarrow raises several kinds of error
        return None
    if [r["key"] for r in rows] != [sample_key(i) for i in indices]:
        return None
    return rows


def load_plan_checked(run: RunDir) -> Plan | None:
    """The run's plan for the read-only tools (status, verify, preview): None if there is none;
    RunDirError naming the file and the fix if it is damaged or lacks an extension (they never re-plan)."""
    _refuse_symlinks(run.plan_dir, "plan")
    try:
        plan = load_plan(run)
    except StorageError:
        raise  # an outage: its own line, never "damaged"
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        plan_json = run.files.where(run.plan_json_path)
        fix = extended_plan_fix(run) if extension_dirs(run) else \
            "re-run the generate command: it plans again from the prompt file, identically"
        raise RunDirError(f"{plan_json} is damaged ({e.__class__.__name__}: {e}); {fix}") from None
    if plan is not None:
        _refuse_a_lost_extension(plan)
    return plan


def plan_for_tool(run_dir: str, what: str = "not a shardgen run directory (no plan/plan.json)") -> Plan:
    """The plan of ``run_dir`` for a read-only tool (status, verify, preview, ...); RunDirError, its message starting
    with ``run_dir``, when there is none (``what`` says so) or it is damaged (the message names its file and the
    fix)."""
    try:
        plan = load_plan_checked(RunDir.at(run_dir))
    except RunDirError as e:
        raise RunDirError(f"{run_dir}: {e}") from None
    if plan is None:
        if not os.path.lexists(run_dir) and (advice := near_url_advice(run_dir)):
            raise RunDirError(advice)  # s3:/bucket/run: a typo for the URL, no run of a folder named "s3:"
        raise RunDirError(f"{run_dir}: {what}")
    return plan
