"""Runs that grow: prompts appended to the run's prompt file are planned as new shards after all
existing ones (``plan/ext-NNNNNN/``); existing shards, keys and bytes are never touched.

An append is recognised from content, not from paths or times: every fingerprint field but the
prompt file's SHA-256 is unchanged, and the file's first P bytes, P the bytes planned so far, still
hash to what was planned (and end with a newline, so no planned row changed). Anything else is
refused as any other change of the prompt file.

Crash and race safety: the extension is planned in a temporary directory renamed to
``plan/ext-NNNNNN`` (a killed planner leaves only a temp dir, removed by the next launch; of two jobs
extending at once one rename wins and the other adopts it); the fingerprint's ``prompts.sha256`` is
updated last, and a launch that finds the plan already covering the file's content only finishes
that update.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from shardgen.dataio.prompts.plan import (PLAN_VERSION, Plan, PlanError, file_sha256, load_plan, new_plan_dir,
                                          plan_rows_into, publish_stored)
from shardgen.dataio.prompts.formats import prompt_format
from shardgen.dataio.prompts.read import PromptSource
from shardgen.dataio.prompts.truncation import TruncationCheck
from shardgen.dataio.resume.fingerprint import FingerprintMismatch, diff_fingerprints, read_fingerprint
from shardgen.dataio.rundir.fileio import atomic_write_json, json_bytes
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.rundir.liveness import host_name
from shardgen.dataio.rundir.remote import open_input, public_url, sizeof
from shardgen.errors import UserError

log = logging.getLogger("shardgen.plan")
RACE_RETRIES = 8  # a job whose rename lost re-reads the plan and tries again (the file may have grown again)


class PromptFileChanging(UserError, RuntimeError):
    """The prompt file changed while the run was being extended."""


def _only_the_prompts_differ(old: dict, new: dict) -> bool:
    strip = lambda fp: {k: v for k, v in fp.items() if k != "prompts.sha256"}  # noqa: E731
    return old.get("prompts.sha256") != new.get("prompts.sha256") and not diff_fingerprints(strip(old), strip(new))


def not_an_append(path: str | os.PathLike, size: int, sha256: str, fmt: str) -> str | None:
    """Why the file at ``path`` is not the planned file (``size`` bytes hashing to ``sha256``) with rows
    appended; None when it is."""
    if not prompt_format(fmt).lines:
        return f"a {fmt} file is rewritten, not appended to: put the new prompts in a new run_dir"
    now = sizeof(path)
    if now == size:
        return f"it has the planned file's {size} bytes but other content"
    if now < size:
        return f"it has {now} bytes, the planned file had {size}"
    with open_input(path) as f:
        f.seek(size - 1)
        if f.read(1) != b"\n":
            return "the planned file did not end with a newline, so what was appended changed its last row"
    if file_sha256(path, size=size) != sha256:
        return f"its first {size} bytes are not the planned file's"
    return None


def extend_if_appended(run: RunDir, fingerprint: dict, source: PromptSource, hashed_size: int,
                       truncation: Callable[[], TruncationCheck | None]) -> Plan | None:
    """When the run's prompt file was only appended to since it was planned, plan the appended rows as
    new shards, update the fingerprint and return the plan; None when nothing changed or the change is
    not the prompt file alone (the fingerprint check then decides). FingerprintMismatch, naming the
    file, when only the prompt file changed and not by appending.

    ``fingerprint``: this launch's, with the SHA-256 of the file's first ``hashed_size`` bytes, which
    is all that is planned; ``truncation`` makes the token check for the appended rows."""
    old = read_fingerprint(run)
    if old is None or not _only_the_prompts_differ(old, fingerprint):
        return None
    try:
        plan = load_plan(run, source.path)
    except PlanError:
        return None  # a damaged plan: the fingerprint check refuses, naming the file
    if plan is None or plan.starts is None:
        return None
    if problem := plan.lost_extension(old["prompts.sha256"]):  # extending past it would plan its rows again
        raise RunDirError(problem)
    want = fingerprint["prompts.sha256"]
    for _ in range(RACE_RETRIES):
        size, sha = plan.covered
        sha = sha or old["prompts.sha256"]  # a plan made before it recorded its file's hash
        if sha == want:
            break  # planned already (by a job killed before its fingerprint update, or racing this one)
        if why := not_an_append(source.path, size, sha, source.format):
            raise FingerprintMismatch(
                f"prompts.path={source.path}: not this run's prompt file, nor that file with prompts appended "
                f"({why}). {run.fingerprint_path} identifies the run's prompts by content (sha256 "
                f"{old['prompts.sha256'][:16]}...). Use the run's file (appending to it extends the run), or "
                "choose a new run_dir")
        plan = _plan_extension(run, plan, source, (size, sha), (hashed_size, want), truncation())
    else:
        raise PromptFileChanging(f"{source.path} kept changing while {run.name} was being extended; re-run")
    run.files.replace(run.fingerprint_path, json_bytes(fingerprint))
    return plan


def _publish_extension(run: RunDir, tmp: Path, target: Path) -> bool:
    """Put the extension planned in ``tmp`` at ``target`` (renamed there; in a bucket ``publish_stored``); False
    when another job's extension is there first."""
    if run.store:
        return publish_stored(run, tmp, target)
    try:
        os.rename(tmp, target)
    except OSError:
        return False
    return True


def _plan_extension(run: RunDir, plan: Plan, source: PromptSource, before: tuple[int, str], after: tuple[int, str],
                    truncation: TruncationCheck | None) -> Plan:
    """Plan the rows after ``before``'s bytes into ``plan/ext-NNNNNN``; the plan as it is afterwards (with
    another job's extension when that one's rename won)."""
    k = len(plan.extensions) + 1
    tmp = new_plan_dir(run)
    try:
        counts = plan_rows_into(tmp, source, plan.rows_per_shard, truncation, offset=before[0],
                                first_row=plan.num_prompts, head_end=int(plan.starts[0][0]), images=plan.images)  # csv/tsv: the header
        if sizeof(source.path) != after[0]:
            raise PromptFileChanging(f"{source.path} changed while {run.name} was being extended (it had {after[0]} "
                                  "bytes when hashed); re-run once it is written")
        now = time.time()
        atomic_write_json(tmp / "plan.json", dict(
            counts, version=PLAN_VERSION, extension=k, first_row=plan.num_prompts, first_shard=plan.num_shards,
            samples_per_shard=plan.rows_per_shard, prompt_size_before=before[0], prompt_sha256_before=before[1],
            prompt_size=after[0], prompt_sha256=after[1], prompt_file=public_url(source.path), time=now,
            utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), host=host_name(), pid=os.getpid()))
        target = run.plan_dir / f"ext-{k:06d}"
        if not _publish_extension(run, tmp, target):  # another job extended first: read it back and look again
            return load_plan(run, source.path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if counts["num_rows"]:
        log.warning("%s grew: rows %d..%d appended to %s are planned as shards %06d..%06d (%s)", run.name,
                    plan.num_prompts, plan.num_prompts + counts["num_rows"] - 1, source.path, plan.num_shards,
                    plan.num_shards + counts["num_shards"] - 1, Path(target).relative_to(run.root))
    else:
        log.warning("%s: rows appended to %s are past prompts.limit=%s; nothing new to plan (recorded in %s)",
                    run.name, source.path, source.limit, Path(target).relative_to(run.root))
    return load_plan(run, source.path)
