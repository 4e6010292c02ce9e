"""The run fingerprint: every setting that determines a sample's pixels or bytes.

Batch size, world size, strategy and launcher are deliberately absent: a run may resume with
any of them changed (up to the numerics of the strategy).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from shardgen.dataio.prompts.plan import file_sha256
from shardgen.dataio.prompts.read import MAX_PROMPT_CHARS
from shardgen.dataio.rundir.layout import (RunDir, RunDirError, append_line, atomic_write_json, create_exclusive,
                                           host_name, json_bytes, read_json, read_state)
from shardgen.dataio.shards.video import video_fingerprint
from shardgen.errors import UserError

log = logging.getLogger("shardgen")


class FingerprintMismatch(UserError, RuntimeError):
    """A resume would mix samples made with different settings."""


def compute_fingerprint(cfg: Any, prompt_sha256: str, model_version: str | None = None,
                        model_sha256: str | None = None) -> dict:
    """The pixel-determining fields of a resolved GenerateConfig, as a flat dict. ``model_sha256``: the content hash
    of the weights (shardgen/models/content.py), where the model has local bytes."""
    m, p = cfg.model, cfg.prompts
    content = {"model.sha256": model_sha256} if model_sha256 else {}
    return _dataset_fields(cfg) | content | {
        "model.name": m.name, "model.pipeline": m.pipeline, "model.source": m.source, "model.revision": m.revision,
        "model.weights": m.weights, "model.version": model_version, "model.true_cfg_scale": m.true_cfg_scale,
        "model.negative_prompt": m.negative_prompt, "model.max_sequence_length": m.max_sequence_length,
        "dtype": cfg.dtype, "height": cfg.height, "width": cfg.width, "steps": cfg.steps, "guidance": cfg.guidance,
        "seed": cfg.seed, "image_format": cfg.image_format, "image_quality": cfg.image_quality,
        "samples_per_shard": cfg.samples_per_shard, "prompts.sha256": prompt_sha256, "prompts.format": p.format,
        "prompts.field": p.field, "prompts.seed_field": p.seed_field, "prompts.on_bad_row": p.on_bad_row,
        "prompts.limit": p.limit,
        # the opt-in lossy accelerations change pixels beyond rounding
        "first_block_cache": cfg.get("first_block_cache", 0.0), "fp8": cfg.get("fp8", False),
        **video_fingerprint(cfg),  # frames, fps, codec, crf (video runs only)
    }


def _dataset_fields(cfg: Any) -> dict:
    """Signals (the watermark changes pixels, the others add fields), on_truncation and max_prompt_chars
    (which prompts become images), only when not the default, so runs planned before they existed resume unchanged."""
    out = {}
    if cfg.get("signals"):
        out["signals"] = sorted(cfg.signals)
    if cfg.prompts.get("on_truncation", "warn") != "warn":
        out["prompts.on_truncation"] = cfg.prompts.on_truncation
    if cfg.prompts.get("max_prompt_chars", MAX_PROMPT_CHARS) != MAX_PROMPT_CHARS:
        out["prompts.max_prompt_chars"] = cfg.prompts.max_prompt_chars
    if cfg.prompts.get("row_settings"):  # which columns set pixels (their values: the prompt file's sha256)
        out["prompts.row_settings"] = list(cfg.prompts.row_settings)
    return out


# fields added to the fingerprint later: a run recorded before them resumes, and records them from then on
ADDED_FIELDS = ("model.sha256",)


def diff_fingerprints(old: dict, new: dict) -> list[str]:
    """Human-readable lines for each field that differs (a field of ADDED_FIELDS absent from ``old`` does not)."""
    keys = sorted(k for k in set(old) | set(new) if k in old or k not in ADDED_FIELDS)
    return [f"{k}: run has {old.get(k)!r}, this launch has {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


# fields the plan is made from: a change cannot be applied to a planned run (the plan is fixed once)
PLAN_FIELDS = ("prompts.sha256", "prompts.format", "prompts.field", "prompts.seed_field", "prompts.on_bad_row",
               "prompts.limit", "prompts.max_prompt_chars", "prompts.row_settings", "samples_per_shard", "seed")


def read_fingerprint(run: RunDir) -> dict | None:
    """The run's fingerprint, None if it has none; RunDirError (naming the file and the fix) if it is damaged."""
    path = run.fingerprint_path
    if not path.exists() and not path.is_symlink():
        return None
    try:
        fp = read_state(path, {"model.name": str, "steps": int, "prompts.sha256": str})
    except RunDirError as e:
        raise RunDirError(f"{e}. It says which settings made this run; without it the run cannot be resumed "
                          f"safely. Restore it (e.g. from a backup), or start a new run_dir") from None
    return fp


def _has_run_state(run: RunDir) -> list[str]:
    """What in ``run`` shows that a run already happened there (a plan, shards, partials)."""
    found = []
    for d in (run.plan_dir, run.shards_dir, run.work_dir):
        try:
            if any(not n.startswith(".") for n in os.listdir(d)):
                found.append(d.name + "/")
        except (FileNotFoundError, NotADirectoryError):
            pass
    return found


def check_or_write_fingerprint(run: RunDir, fingerprint: dict, *, allow_change: bool = False,
                               prompt_path: str | os.PathLike | None = None) -> bool:
    """Write the fingerprint of a new run, or check a resumed run's; True when resuming.

    The first job to create it wins (exclusive create): a concurrent job with other settings is
    refused like any resume with other settings. Raises FingerprintMismatch naming each differing
    field, unless ``allow_change`` (recorded in fingerprint_changes.jsonl), which is refused too for
    fields the existing plan was made from. RunDirError when a run exists but its fingerprint does not.
    ``prompt_path`` is named when the prompt file's content differs (a run is tied to the content, not
    the path: a moved run resumes from its file's new place).
    """
    old = read_fingerprint(run)
    if old is None:
        state = _has_run_state(run)
        if state:
            raise RunDirError(
                f"{run.root} holds a run ({', '.join(state)}) but no fingerprint.json, so nothing shows which "
                "settings made it and resuming could mix different samples. Restore fingerprint.json, or start a "
                f"new run_dir (or delete {run.root} to start over)")
        run.start()  # the owner record first; the skeleton comes once the plan is made
        if create_exclusive(run.fingerprint_path, json_bytes(fingerprint)):
            return False
        old = read_fingerprint(run)  # another job created it first: the same checks as a resume
    diffs = diff_fingerprints(old, fingerprint)
    if not diffs:
        if any(k in fingerprint and k not in old for k in ADDED_FIELDS):
            atomic_write_json(run.fingerprint_path, dict(old, **{k: fingerprint[k] for k in ADDED_FIELDS if k in fingerprint}))
        return True
    if prompt_path is not None and old.get("prompts.sha256") != fingerprint.get("prompts.sha256"):
        diffs.insert(0, f"prompts.path={prompt_path}: not this run's prompt file, whose content it identifies the "
                        f"file by (sha256 {str(old.get('prompts.sha256'))[:16]}..., this file "
                        f"{str(fingerprint.get('prompts.sha256'))[:16]}...)")
    fixed = _fixed_by_plan(run, old, fingerprint)
    if not allow_change:
        # only a fix that works is suggested: allow_fingerprint_change cannot change what the plan was made from
        fixes = (f"Use the original settings ({', '.join(_setting(k, old.get(k)) for k in fixed)}: the run's plan was "
                 "made from them) or choose a new run_dir." if fixed else
                 "Use the original settings, choose a new run_dir, or pass allow_fingerprint_change=true "
                 "(recorded in the run; jobs.verify then reports the samples made with the old settings).")
        raise FingerprintMismatch(
            f"{run.fingerprint_path} says {run.root} was made with other settings; resuming would mix different "
            "samples:\n  " + "\n  ".join(diffs) + "\n" + fixes)
    _apply_change(run, old, fingerprint)
    return True


def _fixed_by_plan(run: RunDir, old: dict, new: dict) -> list[str]:
    """The differing fields a planned run cannot change (the plan was made from them)."""
    if not os.path.lexists(run.plan_json_path):
        return []
    return [k for k in PLAN_FIELDS if old.get(k) != new.get(k)]


def _setting(key: str, value: Any) -> str:
    """``key=value`` as the command line writes it (``null`` for None)."""
    if key == "prompts.sha256":
        return "the prompt file it was planned from"
    return f"{key}={'null' if value is None else value}"


def _apply_change(run: RunDir, old: dict, new: dict) -> None:
    plan_diffs = _fixed_by_plan(run, old, new)
    if plan_diffs:
        raise FingerprintMismatch(
            f"allow_fingerprint_change=true cannot change {', '.join(plan_diffs)} of {run.root}: its plan "
            f"({run.plan_dir / 'plan.json'}) was made from them and is fixed once, so new or changed prompts would "
            "be silently ignored. To extend a run, append the new prompts to its prompt file and change no other "
            "setting in that launch: the appended rows are planned as new shards.")
    record = dict(time=time.time(), utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  host=host_name(), changes={k: [old.get(k), new.get(k)]
                                                      for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)})
    append_line(run.fingerprint_changes_path, json.dumps(record, sort_keys=True, allow_nan=False))
    atomic_write_json(run.fingerprint_path, new)
    log.warning("allow_fingerprint_change=true: %s now runs with %s (recorded in %s)", run.root,
                ", ".join(f"{k}={v[1]!r}" for k, v in record["changes"].items()), run.fingerprint_changes_path.name)


def fingerprint_changes(run: RunDir) -> list[dict]:
    """The recorded allow_fingerprint_change launches, oldest first (unreadable lines skipped)."""
    from shardgen.dataio.rundir.runlog import read_jsonl

    path = run.fingerprint_changes_path
    try:
        return read_jsonl([path]) if path.is_file() else []
    except UnicodeDecodeError:
        return []


def _file_identity(path: Path) -> dict:
    st = Path(path).stat()
    # ctime cannot be set back by tools that preserve mtime (cp -p, rsync -t): any write changes it
    return dict(path=str(Path(path).absolute()), size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
                inode=st.st_ino)


def prompt_file_hash(run: RunDir, path: Path) -> tuple[str, dict]:
    """(SHA-256 of the prompt file, the file's identity when hashed); the hash is reused from the run
    directory while path, size, inode, mtime and ctime all match what was hashed.

    Every launch and every SLURM requeue checks the fingerprint: hashing a 10 GB prompt file again
    costs 10-30 s with every GPU of the job waiting."""
    identity = _file_identity(path)  # before hashing: a write during hashing changes it, so it never matches
    try:
        cached = read_json(run.prompt_hash_path)
        if {k: cached.get(k) for k in identity} == identity and cached.get("check") == _check(identity, cached["sha256"]):
            return cached["sha256"], identity
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # none yet, or unreadable: hash the file
    return file_sha256(path), identity


def remember_prompt_hash(run: RunDir, digest: str, identity: dict) -> None:
    """Store the prompt file's hash for the next launch (see ``prompt_file_hash``)."""
    atomic_write_json(run.prompt_hash_path, dict(identity, sha256=digest, check=_check(identity, digest)))


def _check(identity: dict, digest: str) -> str:
    """A checksum of the cache record: a damaged cache (a changed hex digit) is never taken for the file's hash."""
    import hashlib

    return hashlib.sha256(json.dumps([identity, digest], sort_keys=True).encode()).hexdigest()[:16]
