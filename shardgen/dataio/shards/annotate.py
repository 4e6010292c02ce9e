"""What each sample's json records beyond its row: provenance (enough to reproduce it) and truncation.

Provenance is computed once per launch; the token count of a prompt per text encoder is computed
per batch on the replica's leader from the pipeline's own tokenizers (a fraction of a millisecond
per prompt, no GPU), so a prompt the model only saw in part is flagged in its json and the index.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from shardgen.dataio.prompts.truncation import token_counts

if TYPE_CHECKING:  # a type only: shardwork imports the plan, which imports this module
    from shardgen.dataio.shards.shardwork import Sample

_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")  # a Hugging Face cache snapshot: its commit


def shardgen_version() -> str:
    """The installed shardgen version (the package metadata), or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardgen")
    except PackageNotFoundError:
        return "unknown"


def weights_id(path: str | None) -> str | None:
    """What pins a pipeline's files: the hub snapshot commit in its path, else a SHA-256 over its
    config files (json, small: the weights themselves are not read)."""
    if not path:
        return None
    if m := _SNAPSHOT.search(str(path)):
        return m.group(1)
    root = Path(path)
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.json")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return "config-sha256:" + h.hexdigest()[:16]


def scheduler_info(pipe: Any, chosen: dict | None = None) -> dict:
    """The scheduler's class and the config entries that change its timesteps; with ``chosen`` (the launch's
    ``scheduler``/``scheduler_shift``, when either is set) those too, and the entries that set a multistep
    sampler's update (a run with the model's own sampler records what it always recorded)."""
    sched = getattr(pipe, "scheduler", None)
    if sched is None:
        return {}
    cfg = dict(getattr(sched, "config", {}) or {})
    keep = ("shift", "use_dynamic_shifting", "base_shift", "max_shift", "time_shift_type", "num_train_timesteps")
    if chosen:
        keep += ("flow_shift", "prediction_type", "algorithm_type", "solver_order", "use_flow_sigmas")
    return dict({k: cfg[k] for k in keep if k in cfg}, name=type(sched).__name__, **({"chosen": chosen} if chosen else {}))


def _chosen_scheduler(cfg: Any) -> dict | None:
    chosen = {k: cfg.get(k) for k in ("scheduler", "scheduler_shift") if cfg.get(k) is not None}
    return chosen or None


def run_provenance(cfg: Any, pipe: Any, model_version: str | None, accel: Any, strategy: str) -> dict:
    """The launch-wide provenance every sample's json carries under "provenance"."""
    m = cfg.model
    return dict(model=dict(name=m.name, source=m.source, revision=m.revision, version=model_version,
                           pipeline=type(pipe).__name__,
                           weights=weights_id(getattr(getattr(pipe, "config", None), "_name_or_path", None))),
                dtype=cfg.dtype, scheduler=scheduler_info(pipe, _chosen_scheduler(cfg)), steps=cfg.steps, guidance=cfg.guidance,
                width=cfg.width, height=cfg.height, max_sequence_length=m.max_sequence_length,
                shardgen=shardgen_version(), strategy=strategy,
                accelerations=dict(compile=accel.compile, sdpa=accel.sdpa, first_block_cache=accel.first_block_cache,
                                   fp8=accel.fp8, fused_blocks=accel.fused_blocks,
                                   fused_decode=accel.fused_decode,
                                   cuda_graphs=accel.cuda_graphs),
                lossy=bool(accel.lossy))


def text_windows(pipe: Any, max_sequence_length: int) -> list[tuple[str, Any, int]]:
    """(text encoder name, its tokenizer, tokens it keeps) for each text encoder of the pipeline.

    With two encoders (FLUX.1: CLIP and T5) the first keeps its own window (CLIP: 77 tokens) and the
    second ``max_sequence_length``; a single encoder keeps ``max_sequence_length``, as diffusers'
    pipelines truncate them (a family whose pipeline cuts nothing, ``cuts_text=False``: its tokenizer's own limit)."""
    from shardgen.families import family_of

    family = family_of(pipe)
    if family is not None and not family.cuts_text:
        max_sequence_length = None
    found = [(s, getattr(pipe, f"tokenizer{s}", None)) for s in ("", "_2", "_3")]
    found = [(s, tok) for s, tok in found if tok is not None]
    out = []
    for i, (suffix, tok) in enumerate(found):
        enc = getattr(pipe, f"text_encoder{suffix}", None)
        name = type(enc).__name__ if enc is not None else f"tokenizer{suffix}"
        first_of_two = i == 0 and len(found) > 1
        window = getattr(pipe, "tokenizer_max_length", tok.model_max_length) if first_of_two else \
            (max_sequence_length or tok.model_max_length)
        out.append((name, tok, int(window)))
    return out


class SampleAnnotator:
    """Adds provenance and token counts to the json of freshly generated samples."""

    def __init__(self, provenance: dict, windows: list[tuple[str, Any, int]]):
        self.provenance, self.windows = provenance, windows

    def __call__(self, samples: Iterable[Sample]) -> None:
        """Annotate ``samples`` in place (rejected rows have no prompt to count)."""
        samples = list(samples)
        for s in samples:
            s.meta["provenance"] = self.provenance
        counted = [s for s in samples if s.prompt]
        for s, (tokens, truncated) in zip(counted, token_counts(self.windows, [s.prompt for s in counted])):
            s.meta["tokens"], s.meta["truncated"] = tokens, truncated
