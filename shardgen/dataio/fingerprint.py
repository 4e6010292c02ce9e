"""The run fingerprint: every setting that determines a sample's pixels or bytes.

Batch size, world size, strategy and launcher are deliberately absent: a run may resume with
any of them changed (up to the numerics of the strategy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardgen.dataio.plan import file_sha256
from shardgen.dataio.rundir import RunDir, atomic_write_json, read_json
from shardgen.dataio.video import video_fingerprint
from shardgen.errors import UserError


class FingerprintMismatch(UserError, RuntimeError):
    """A resume would mix samples made with different settings."""


def compute_fingerprint(cfg: Any, prompt_sha256: str, model_version: str | None = None) -> dict:
    """The pixel-determining fields of a resolved GenerateConfig, as a flat dict."""
    m, p = cfg.model, cfg.prompts
    return _dataset_fields(cfg) | {
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
    """Signals (the watermark changes pixels, the others add fields) and on_truncation (which prompts
    become images), only when not the default, so runs planned before they existed resume unchanged."""
    out = {}
    if cfg.get("signals"):
        out["signals"] = sorted(cfg.signals)
    if cfg.prompts.get("on_truncation", "warn") != "warn":
        out["prompts.on_truncation"] = cfg.prompts.on_truncation
    return out


def diff_fingerprints(old: dict, new: dict) -> list[str]:
    """Human-readable lines for each field that differs."""
    keys = sorted(set(old) | set(new))
    return [f"{k}: run has {old.get(k)!r}, this launch has {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def check_or_write_fingerprint(run: RunDir, fingerprint: dict, *, allow_change: bool = False) -> bool:
    """Write the fingerprint of a new run, or check a resumed run's; True when resuming.

    Raises FingerprintMismatch naming each differing field, unless ``allow_change``.
    """
    path = run.fingerprint_path
    if not path.exists():
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, fingerprint)
        return False
    diffs = diff_fingerprints(read_json(path), fingerprint)
    if diffs and not allow_change:
        raise FingerprintMismatch(
            f"{run.root} was made with other settings; resuming would mix different samples:\n  "
            + "\n  ".join(diffs)
            + "\nUse the original settings, choose a new run_dir, or pass allow_fingerprint_change=true.")
    return True


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
        if {k: cached.get(k) for k in identity} == identity:
            return cached["sha256"], identity
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # none yet, or unreadable: hash the file
    return file_sha256(path), identity


def remember_prompt_hash(run: RunDir, digest: str, identity: dict) -> None:
    """Store the prompt file's hash for the next launch (see ``prompt_file_hash``)."""
    atomic_write_json(run.prompt_hash_path, dict(identity, sha256=digest))
