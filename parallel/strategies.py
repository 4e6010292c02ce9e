"""Choosing and applying a strategy: each one a module with ``apply(cfg, world, dims, mesh) -> pipeline``.

Replicas always split the data; a strategy says how one replica spreads over its ranks/devices.
"""

from __future__ import annotations

import importlib
from typing import Any

from parallel.world import ParallelConfigError, ParallelDims

# strategy name -> module under parallel/ with an ``apply`` function
STRATEGY_MODULES = {"dp": "parallel.dp"}


def parallel_dims(cfg: Any, world_size: int) -> ParallelDims:
    """The degrees the strategy implies, validated against the world (no weights touched)."""
    name = cfg.strategy.name
    if name not in STRATEGY_MODULES:
        raise ParallelConfigError(f"strategy={name} is not available; choose one of {sorted(STRATEGY_MODULES)}")
    if name == "dp" and (cfg.tp_degree, cfg.ulysses_degree, cfg.ring_degree) != (1, 1, 1):
        raise ParallelConfigError(
            f"strategy=dp ignores tp_degree/ulysses_degree/ring_degree ({cfg.tp_degree}/{cfg.ulysses_degree}/"
            f"{cfg.ring_degree}); pick strategy=tp or a cp_* strategy, or set the degrees to 1")
    return ParallelDims(world_size=world_size)


def apply_strategy(cfg: Any, world, dims: ParallelDims, mesh) -> Any:
    """Build this rank's part of its replica's pipeline."""
    module = importlib.import_module(STRATEGY_MODULES[cfg.strategy.name])
    return module.apply(cfg, world, dims, mesh)
