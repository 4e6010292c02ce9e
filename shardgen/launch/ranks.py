"""What every launcher gives the ranks it starts: their config and their logging (local spawn and SLURM alike)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig


def child_config(cfg: GenerateConfig, changes: dict[str, str] | None = None) -> str:
    """The YAML each rank runs: ``cfg`` resolved, with ``launcher.name=none`` (the ranks never launch again)
    and the dotted keys of ``changes`` set (e.g. absolute paths for ranks on other machines)."""
    child = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in {"launcher.name": "none", **(changes or {})}.items():
        OmegaConf.update(child, key, value)
    return OmegaConf.to_yaml(child)


def setup_rank_logging(rank: int | str, level: int) -> None:
    """A started rank has no logging config: the parent's format with a rank tag, and the parent's level for
    shardgen's loggers (``level``)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] %(message)s")
    logging.getLogger("shardgen").setLevel(level)
