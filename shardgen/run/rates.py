"""Generation rates remembered across runs, for ``dry_run``'s time estimate on a run that has not measured its own.

Each launch that generated samples records its rate per replica (rank 0's replica: samples over the seconds its
pipeline calls took, start-up and model loading left out) in ``$SHARDGEN_CACHE/rates.json`` under what the rate depends on: the model and its weights, the sample's size
(and frames), steps, true CFG, dtype, the device's name, the strategy and its ranks per replica. A later
``dry_run`` of another run_dir with the same key multiplies the rate by its replicas. Advisory data: a missing or
damaged file is no error, and a failed write only skips the record.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from shardgen.cache import default_cache_dir

log = logging.getLogger("shardgen")


def rates_path() -> Path:
    """``$SHARDGEN_CACHE/rates.json``."""
    return default_cache_dir() / "rates.json"


def device_name(device: Any) -> str:
    """The GPU's name for a CUDA device (``NVIDIA H200``), else the device type (``cpu``)."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def rate_key(cfg: Any, strategy: str, ranks_per_replica: int, device: str) -> str:
    """What a rate per replica depends on (not the prompts, the batch size or the run's length): the lossy settings
    among it (fp8 alone is 1.2-1.4x), so an fp8 run is not estimated at a bf16 run's rate, nor records over it."""
    from shardgen.dataio.shards import is_video
    from shardgen.speed.accel import AccelOptions  # every technique registered: each says what it makes lossy

    m = cfg.model
    frames = cfg.num_frames if is_video(cfg) else None
    parts = dict(model=m.name, weights=m.weights, size=f"{cfg.width}x{cfg.height}", frames=frames, steps=cfg.steps,
                 true_cfg=float(m.get("true_cfg_scale") or 1.0) > 1.0, dtype=cfg.dtype, device=device,
                 strategy=strategy, ranks=ranks_per_replica)
    if lossy := AccelOptions.from_cfg(cfg).lossy:  # absent when lossless: the keys recorded so far stay valid
        parts["lossy"] = lossy
    return json.dumps(parts, sort_keys=True)


def record_rate(key: str, per_replica: float, run_dir: str, path: Path | None = None) -> None:
    """Keep ``per_replica`` samples/s under ``key`` (the latest launch's figure)."""
    from shardgen.speed.autocompile import write_record

    if math.isfinite(per_replica) and per_replica > 0:
        write_record(path or rates_path(), key, dict(per_replica=per_replica, run_dir=run_dir, time=time.time()))


def recorded_rate(key: str, path: Path | None = None) -> dict | None:
    """The record under ``key`` (``per_replica``, ``run_dir``, ``time``), None without a usable one."""
    from shardgen.speed.autocompile import read_records

    rec = read_records(path or rates_path()).get(key)
    if not isinstance(rec, dict):
        return None
    rate = rec.get("per_replica")
    ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and rate > 0
    return rec if ok else None
