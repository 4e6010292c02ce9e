"""The run fingerprint: every setting that determines a sample's pixels or bytes.

Batch size, world size, strategy and launcher are deliberately absent: a run may resume with
any of them changed (up to the numerics of the strategy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from shardgen.config.schema import LOSSY_SDPA_BACKENDS
from shardgen.dataio.prompts.plan import discard_plan, extension_dirs, file_sha256
from shardgen.dataio.prompts.formats import prompt_format
from shardgen.dataio.prompts.read import MAX_PROMPT_CHARS, detect_format
from shardgen.dataio.rundir.remote import StorageError, identity as remote_identity, is_url
from shardgen.dataio.rundir.fileio import atomic_write_bytes, json_bytes, read_regular
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.runfiles import DIR_FILES
from shardgen.dataio.rundir.liveness import gone_from_this_host, host_name, process_identity
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.shards.video import video_fingerprint
from shardgen.errors import UserError
from shardgen.models import lora

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
        "samples_per_shard": cfg.samples_per_shard, "prompts.sha256": prompt_sha256,
        "prompts.format": detect_format(str(p.path), p.format),  # what the file is read as: auto resolved
        "prompts.field": p.field, "prompts.seed_field": p.seed_field, "prompts.on_bad_row": p.on_bad_row,
        "prompts.limit": p.limit,
        # the opt-in lossy accelerations change pixels beyond rounding
        "first_block_cache": cfg.first_block_cache, "fp8": cfg.fp8,
        **({"sdpa_backend": cfg.sdpa_backend} if cfg.sdpa_backend in LOSSY_SDPA_BACKENDS else {}),
        **video_fingerprint(cfg),  # frames, fps, codec, crf (video runs only)
        **lora.fingerprint_fields(lora.run_set(cfg)),  # the adapters' sha256 and scales (runs with adapters only)
        **_strength(cfg),  # image-to-image runs only
    }


def _strength(cfg: Any) -> dict:
    """The run's image-to-image strength, for models that take one ({} otherwise: other runs resume unchanged)."""
    from shardgen.families import family_for

    return {"model.strength": cfg.model.get("strength")} if family_for(cfg.model.pipeline).strength else {}


def _dataset_fields(cfg: Any) -> dict:
    """Signals (the watermark changes pixels, the others add fields), on_truncation and max_prompt_chars
    (which prompts become images), only when not the default, so runs planned before they existed resume unchanged."""
    out = {}
    if cfg.get("signals"):
        out["signals"] = sorted(cfg.signals)
    if cfg.prompts.on_truncation != "warn":
        out["prompts.on_truncation"] = cfg.prompts.on_truncation
    if cfg.prompts.max_prompt_chars != MAX_PROMPT_CHARS:
        out["prompts.max_prompt_chars"] = cfg.prompts.max_prompt_chars
    if cfg.prompts.get("row_settings"):  # which columns set pixels (their values: the prompt file's sha256)
        out["prompts.row_settings"] = list(cfg.prompts.row_settings)
    if cfg.images_per_prompt != 1:  # which samples there are (and their keys and seeds)
        out["images_per_prompt"] = cfg.images_per_prompt
    for key in ("scheduler", "scheduler_shift"):  # the sampler, when not the model's own
        if cfg[key] is not None:
            out[key] = cfg[key]
    return out


# fields added to the fingerprint later: a run recorded before them resumes, and records them from then on
ADDED_FIELDS = ("model.sha256",)


def diff_fingerprints(old: dict, new: dict) -> list[str]:
    """Human-readable lines for each field that differs (a field of ADDED_FIELDS absent from ``old`` does not)."""
    if old.get("prompts.format") == "auto":  # recorded unresolved: the file's extension chose, as it does now
        old = dict(old, **{"prompts.format": new.get("prompts.format")})
    keys = sorted(k for k in set(old) | set(new) if k in old or k not in ADDED_FIELDS)
    return [f"{k}: run has {old.get(k)!r}, this launch has {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


# fields the plan is made from: a change cannot be applied to a planned run (the plan is fixed once)
PLAN_FIELDS = ("prompts.sha256", "prompts.format", "prompts.field", "prompts.seed_field", "prompts.on_bad_row",
               "prompts.limit", "prompts.max_prompt_chars", "prompts.row_settings", "samples_per_shard", "seed",
               "images_per_prompt")


def read_fingerprint(run: RunDir) -> dict | None:
    """The run's fingerprint, None if it has none; RunDirError (naming the file and the fix) if it is damaged."""
    path = run.fingerprint_path
    if not run.files.present(path):
        return None
    try:
        fp = run.files.state(path, {"model.name": str, "steps": int, "prompts.sha256": str})
    except RunDirError as e:
        raise RunDirError(f"{e}. It says which settings made this run; without it the run cannot be resumed "
                          f"safely. Restore it (e.g. from a backup), or start a new run_dir") from None
    return fp


def _has_run_state(run: RunDir) -> list[str]:
    """What in ``run`` shows that a run already happened there (a plan, shards, partials)."""
    found = []
    for d in (run.plan_dir, run.shards_dir, run.work_dir):
        if any(not n.startswith(".") for n in _names(run, d)):
            found.append(d.name + "/")
    return found


def _names(run: RunDir, d: Path) -> list[str]:
    """The names in the run's folder ``d``: the local ones, and where the run's files are in a bucket also the
    bucket's (the plan and the done markers; shard files and partials stay local)."""
    local = DIR_FILES.names(d)
    return local + run.files.names(d) if run.store and d in (run.plan_dir, run.shards_dir, run.uploads_dir) else local


def check_or_write_fingerprint(run: RunDir, fingerprint: dict, *, allow_change: bool = False,
                               prompt_path: str | os.PathLike | None = None) -> bool:
    """Write the fingerprint of a new run, or check a resumed run's; True when resuming.

    The first job to create it wins (exclusive create): a concurrent job with other settings is
    refused like any resume with other settings. Raises FingerprintMismatch naming each differing
    field, unless ``allow_change`` (recorded in fingerprint_changes.jsonl), which is refused too for
    fields the existing plan was made from. RunDirError when a run exists but its fingerprint does not.
    A run that holds no sample yet (its launches stopped before generating, e.g. a model that did not load) takes
    the new settings instead, recorded likewise; a launch still loading its model with the old ones is refused once
    loaded (shardgen/run/runner.py), so samples of both never mix.
    ``prompt_path`` is named when the prompt file's content differs (a run is tied to the content, not
    the path: a moved run resumes from its file's new place).
    """
    old = read_fingerprint(run)
    lost_race = False
    if old is None:
        state = _has_run_state(run)
        if state:
            raise RunDirError(
                f"{run.name} holds a run ({', '.join(state)}) but no fingerprint.json, so nothing shows which "
                "settings made it and resuming could mix different samples. Restore fingerprint.json, or start a "
                f"new run_dir (or delete {run.name} to start over)")
        run.start()  # the owner record first; the skeleton comes once the plan is made
        if run.files.create(run.fingerprint_path, json_bytes(fingerprint)):
            return False
        old = read_fingerprint(run)  # another job created it first: the same checks as a resume
        lost_race = True  # that job is starting now, not a launch that stopped before its first sample
    if not diff_fingerprints(old, fingerprint):
        if any(k in fingerprint and k not in old for k in ADDED_FIELDS):  # a run recorded before the field
            added = {k: fingerprint[k] for k in ADDED_FIELDS if k in fingerprint}
            run.files.replace(run.fingerprint_path, json_bytes(dict(old, **added)))
        return True
    if not allow_change and not lost_race and holds_no_samples(run):
        # a launch that failed before its first sample (a model that did not load) leaves nothing to mix with
        _restart_unstarted(run, old, fingerprint)
        return True
    if not allow_change:
        raise _mismatch(run, old, fingerprint, prompt_path)
    _apply_change(run, old, fingerprint)
    return True


def _mismatch(run: RunDir, old: dict, new: dict, prompt_path: str | os.PathLike | None) -> FingerprintMismatch:
    diffs = diff_fingerprints(old, new)
    if prompt_path is not None and old.get("prompts.sha256") != new.get("prompts.sha256"):
        diffs.insert(0, f"prompts.path={prompt_path}: not this run's prompt file, whose content it identifies the "
                        f"file by (sha256 {str(old.get('prompts.sha256'))[:16]}..., this file "
                        f"{str(new.get('prompts.sha256'))[:16]}...)")
    fixed = _fixed_by_plan(run, old, new)
    fixes = f"\nTo generate with these settings, choose a new run_dir (e.g. run_dir={run.name}-2). "
    if fixed:  # allow_fingerprint_change cannot change what the plan was made from: not offered
        fixes += (f"To continue this run, launch it with its original settings "
                  f"({', '.join(_setting(k, old.get(k)) for k in fixed)}: the run's plan was made from them).")
    else:
        fixes += ("To continue this run, launch it with its original settings (its config.yaml). Only if the old and "
                  "new samples may be mixed in one dataset: allow_fingerprint_change=true (recorded in the run; the "
                  "samples already made stay as they are: jobs.verify notes them, and its --repair keeps them).")
    return FingerprintMismatch(
        f"{run.files.where(run.fingerprint_path)} says {run.name} was made with other settings; resuming would mix "
        "different samples:\n  " + "\n  ".join(diffs) + fixes)


def refuse_changed_settings(cfg: Any, run: RunDir, prompt_path: Path) -> None:
    """The refusal ``check_or_write_fingerprint`` would make, read-only and before torch is imported (a second, not
    ten). Whatever the launch may accept or repair is left to it: no or a damaged fingerprint, a run without a
    sample, a prompt file changed since it was hashed (an append extends the run), allow_fingerprint_change."""
    from shardgen.models.versions import model_version

    if cfg.allow_fingerprint_change or not run.files.exists(run.fingerprint_path) or holds_no_samples(run):
        return
    try:
        old = read_fingerprint(run)
        digest = cached_prompt_hash(run, _file_identity(prompt_path))
    except (RunDirError, OSError):
        return
    if old is None or digest is None:
        return
    new = compute_fingerprint(cfg, digest, model_version(cfg.model))
    # the model's bytes are hashed by the launch itself (reading the weights is not for before torch): left out of
    # both sides, so the refusal does not list an unhashed model as changed
    new.pop("model.sha256", None)
    old = {k: v for k, v in old.items() if k != "model.sha256"}
    if diff_fingerprints({k: v for k, v in old.items() if k != "prompts.sha256"},
                         {k: v for k, v in new.items() if k != "prompts.sha256"}):
        raise _mismatch(run, old, new, prompt_path)


def holds_no_samples(run: RunDir) -> bool:
    """No sample was generated, started, claimed or uploaded in ``run``: work/, claims/, latents/ and uploads/ hold
    nothing, and every shard committed in shards/ holds rejected rows only (its stats say 0 ok, 0 failed), so
    nothing a setting determines was made yet."""
    for d in (run.work_dir, run.claims_dir, run.latents_dir, run.uploads_dir):
        if any(not n.startswith(".") and not (d == run.work_dir and _dead_launch_marker(d / n))
               for n in _names(run, d)):
            return False
    return _rejects_only(run) is not None


def _dead_launch_marker(path: Path) -> bool:
    """Whether ``path`` is a ``start_generating`` marker of a launch on this host that is gone (killed before it
    could remove it: SIGKILL, the OOM killer): it marks no generating launch, and the run may still take new
    settings. A marker of another host is kept (its pid means nothing here). The marker holds its launch's
    ``process_identity``, so a later process given the same pid (a container run again) does not keep it alive."""
    m = re.fullmatch(r"launch\.(.+)\.(\d+)", path.name)
    if not m:
        return False
    return gone_from_this_host(m.group(1), int(m.group(2)), _marker_identity(path))


def _marker_identity(path: Path) -> str | None:
    """What a launch marker holds (its launch's ``process_identity``); None for an empty one (written where /proc
    was not readable), one gone meanwhile, and anything but a plain file (a link or FIFO put there is not opened
    through, nor waited on)."""
    try:
        return read_regular(path, follow=False, limit=200).decode("ascii", "replace").strip() or None
    except (OSError, RunDirError):  # gone, a link, a FIFO, or more than an identity: judged by its name alone
        return None


def _rejects_only(run: RunDir) -> list[str] | None:
    """The names in shards/ when every shard there is committed with rejected rows only; None otherwise (a shard
    with a sample, a file without its stats, or stats that do not read)."""
    # a bucket run's shards/ also holds the folder's owner record (RUN_MARKER_OBJECT), which is no shard
    names = [n for n in _names(run, run.shards_dir) if not n.startswith((".", "_"))]
    for shard in {n[:6] for n in names}:
        try:
            data = run.files.read(run.shards_dir / f"{shard}.stats.json")
            stats = json.loads(data) if data is not None else None
        except (OSError, ValueError):
            return None
        if not isinstance(stats, dict) or stats.get("ok") != 0 or stats.get("failed") != 0:
            return None
    return names


def _discard_reject_shards(run: RunDir) -> None:
    """Remove the committed shards of rejected rows only: made again from the new settings' plan (stats first, so a
    reader never takes a tar without them as done)."""
    names = _rejects_only(run) or []
    for name in sorted(names, key=lambda n: not n.endswith(".stats.json")):
        (run.shards_dir / name).unlink(missing_ok=True)


def _restart_unstarted(run: RunDir, old: dict, new: dict) -> None:
    """Take the new settings for a run without a sample; a changed plan field discards the plan (made again).

    A concurrent launch with the old settings may be about to generate: it marks that (``start_generating``: its
    marker in work/, then the fingerprint read again), while this writes the new fingerprint and then looks for a
    marker or a sample. Each writes before it reads, so at least one sees the other: that launch refuses (it reads
    the new fingerprint), or this one puts the old fingerprint back and refuses. Samples of two settings never meet."""
    if run.files.exists(run.plan_json_path) and any(old.get(k) != new.get(k) for k in PLAN_FIELDS) \
            and extension_dirs(run):
        raise FingerprintMismatch(f"{run.name} was extended ({run.plan_dir}/ext-*) and its plan cannot be made "
                                  "again with other settings; choose a new run_dir")
    run.files.replace(run.fingerprint_path, json_bytes(new))
    if not holds_no_samples(run):  # a launch with the old settings started generating meanwhile
        run.files.replace(run.fingerprint_path, json_bytes(old))
        raise _mismatch(run, old, new, None)
    if run.files.exists(run.plan_json_path) and any(old.get(k) != new.get(k) for k in PLAN_FIELDS):
        discard_plan(run, "replaced")
    _discard_reject_shards(run)  # rows rejected under the old settings are read again under the new ones
    changes = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    record = dict(time=time.time(), utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  host=host_name(), changes=changes, no_samples=True)
    run.files.append(run.fingerprint_changes_path, json.dumps(record, sort_keys=True, allow_nan=False))
    run.files.delete(run.config_path)  # config.yaml is the first launch's config: this launch's, now
    log.warning("%s holds no sample yet: starting it over with the new settings (%s; recorded in %s)", run.name,
                ", ".join(f"{k}={v[1]!r}" for k, v in changes.items()), run.fingerprint_changes_path.name)


def run_settings(run: RunDir) -> tuple[dict | None, str | None]:
    """What ``check_settings_unchanged`` compares: the fingerprint, and which plan.json file the plan is."""
    try:
        plan = run.files.version(run.plan_json_path)
    except StorageError:
        raise  # a store unreachable past its retries: its own line, never taken for a run started over
    except OSError:
        plan = None
    return read_fingerprint(run), plan


def check_settings_unchanged(run: RunDir, before: tuple[dict | None, str | None]) -> None:
    """Refuse to generate when another launch started the run over with other settings since ``before``
    (``run_settings``), e.g. while this one loaded its model: a run without a sample takes new settings. Appended
    prompts change the fingerprint's prompts.sha256 alone and keep plan.json: this launch's plan still holds."""
    now = run_settings(run)
    if now == before:
        return
    (old_fp, old_plan), (new_fp, new_plan) = before, now

    def but_prompts(fp: dict) -> dict:
        return {k: v for k, v in fp.items() if k != "prompts.sha256"}

    extended = (old_fp is not None and new_fp is not None and old_plan == new_plan
                and not diff_fingerprints(but_prompts(old_fp), but_prompts(new_fp)))
    if not extended:
        raise FingerprintMismatch(f"{run.fingerprint_path} changed while this launch loaded its model: another launch "
                                  f"started {run.name} over with other settings. Launch again with the settings in "
                                  "fingerprint.json, or choose a new run_dir")


def start_generating(run: RunDir, before: tuple[dict | None, str | None]) -> Path:
    """Mark that this launch generates with the settings it accepted (``before``, ``run_settings``'s), then refuse
    as ``check_settings_unchanged`` does if another launch started the run over meanwhile. The marker,
    ``work/launch.<host>.<pid>``, makes the run hold a sample for ``holds_no_samples`` from now on, so no launch
    with other settings takes the run over while this one generates (``_restart_unstarted``). Returns the marker,
    for ``stop_generating``."""
    marker = run.work_dir / f"launch.{host_name()}.{os.getpid()}"
    run.work_dir.mkdir(exist_ok=True)
    try:  # whole or not at all (a reader never judges a half-written identity), and over a FIFO or link at the name
        atomic_write_bytes(marker, (process_identity(os.getpid()) or "").encode())
    except (UserError, StorageError):
        raise
    except OSError as e:
        raise RunDirError(f"{marker}: cannot mark this launch as generating ({e.strerror or e}): this launch's own "
                          "marker name holds something else (a directory?). Remove it, then launch again") from None
    try:
        check_settings_unchanged(run, before)
    except BaseException:
        stop_generating(marker)
        raise
    return marker


def remove_dead_launch_markers(run: RunDir) -> None:
    """Remove the ``start_generating`` markers of launches on this host that are gone (SIGKILLed while generating):
    they mark nothing, and a finished run keeps no leftover in work/ (each launch's ``prepare_run`` calls this)."""
    for name in DIR_FILES.names(run.work_dir):
        path = run.work_dir / name
        if _dead_launch_marker(path):
            try:
                path.unlink()
            except OSError:
                pass


def stop_generating(marker: Path | None) -> None:
    """Remove ``start_generating``'s marker (the launch's samples, claims and partials speak for it from now)."""
    if marker is not None:
        try:
            marker.unlink()
        except OSError:
            pass


def _fixed_by_plan(run: RunDir, old: dict, new: dict) -> list[str]:
    """The differing fields a planned run cannot change (the plan was made from them)."""
    if not run.files.present(run.plan_json_path):
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
            f"allow_fingerprint_change=true cannot change {', '.join(plan_diffs)} of {run.name}: its plan "
            f"({run.plan_dir / 'plan.json'}) was made from them and is fixed once, so new or changed prompts would "
            "be silently ignored. To extend a run, append the new prompts to its prompt file and change no other "
            "setting in that launch: the appended rows are planned as new shards.")
    record = dict(time=time.time(), utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  host=host_name(), changes={k: [old.get(k), new.get(k)]
                                                      for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)})
    run.files.append(run.fingerprint_changes_path, json.dumps(record, sort_keys=True, allow_nan=False))
    run.files.replace(run.fingerprint_path, json_bytes(new))
    log.warning("allow_fingerprint_change=true: %s now runs with %s (recorded in %s)", run.name,
                ", ".join(f"{k}={v[1]!r}" for k, v in record["changes"].items()), run.fingerprint_changes_path.name)


def fingerprint_changes(run: RunDir) -> list[dict]:
    """The recorded allow_fingerprint_change launches, oldest first (unreadable lines skipped)."""
    from shardgen.dataio.rundir.runlog import read_run_jsonl

    try:
        return read_run_jsonl(run, run.fingerprint_changes_path)
    except UnicodeDecodeError:
        return []


def _file_identity(path: Path | str) -> dict:
    if is_url(path):  # an object store: an overwrite changes the ETag, which identifies the content
        return remote_identity(str(path))
    st = Path(path).stat()
    # ctime cannot be set back by tools that preserve mtime (cp -p, rsync -t): any write changes it
    return dict(path=str(Path(path).absolute()), size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
                inode=st.st_ino)


def prompt_file_hash(run: RunDir, path: Path | str, fmt: str | None = None) -> tuple[str, dict]:
    """(SHA-256 of the prompt file, the file's identity when hashed); the hash is reused from the run
    directory while path, size, inode, mtime and ctime all match what was hashed (a remote file: its URL, size,
    ETag and modification time, so a launch reads none of its bytes to check the fingerprint). A remote parquet
    file (``fmt``) with an ETag is identified by it, never hashed (it is planned from its footer: planscan.py).

    Every launch and every SLURM requeue checks the fingerprint: hashing a 10 GB prompt file again
    costs 10-30 s with every GPU of the job waiting."""
    identity = _file_identity(path)  # before hashing: a write during hashing changes it, so it never matches
    if is_url(path) and fmt and prompt_format(fmt).count_rows is not None and identity.get("etag"):  # rewritten, never appended to: the ETag says all
        return "etag-" + hashlib.sha256(f"{identity['etag']}|{identity['size']}".encode()).hexdigest(), identity
    if is_url(path) and not (identity.get("etag") or identity.get("modified")):
        return file_sha256(path), identity  # a server that tells neither: its size alone cannot vouch for the content
    return cached_prompt_hash(run, identity) or file_sha256(path), identity


def cached_prompt_hash(run: RunDir, identity: dict) -> str | None:
    """The prompt file's hash remembered in the run directory, if the file (``identity``) is unchanged since."""
    try:
        cached = json.loads(run.files.read(run.prompt_hash_path))
        if {k: cached.get(k) for k in identity} == identity and cached.get("check") == _check(identity, cached["sha256"]):
            return cached["sha256"]
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass  # none yet, or unreadable
    return None


def remember_prompt_hash(run: RunDir, digest: str, identity: dict) -> None:
    """Store the prompt file's hash for the next launch (see ``prompt_file_hash``)."""
    run.files.replace(run.prompt_hash_path, json_bytes(dict(identity, sha256=digest, check=_check(identity, digest))))


def _check(identity: dict, digest: str) -> str:
    """A checksum of the cache record: a damaged cache (a changed hex digit) is never taken for the file's hash."""
    return hashlib.sha256(json.dumps([identity, digest], sort_keys=True).encode()).hexdigest()[:16]
