"""The model settings of a run, checked before any weight is read: each check lives beside what it checks (the
source with the loader, the sampler with its table, the adapters with their files) and raises ConfigError."""

from __future__ import annotations

from typing import Any

from shardgen.models import lora, schedulers
from shardgen.models.loader import check_source


def check_model_settings(cfg: Any) -> None:
    """model.source names a model directory (when written as a path), scheduler and scheduler_shift work in the
    model's pipeline, and the adapters of model.loras can be used; ConfigError (LoraError for an adapter file) for
    the first that cannot."""
    check_source(cfg.model)
    schedulers.check(cfg.scheduler, cfg.scheduler_shift, cfg.model.pipeline)
    lora.check_run_set(cfg)
