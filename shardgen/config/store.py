"""Hydra's ConfigStore entries: the typed schema and the --help built from its docstrings.

Apart from schema.py so that help.py can read the schema without the schema importing help.py back.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from shardgen.config.help import hydra_help_node
from shardgen.config.schema import GenerateConfig


def register_configs() -> None:
    """Register the schema (idempotent). Group YAMLs are typed by the fields of GenerateConfig."""
    cs = ConfigStore.instance()
    cs.store(name="generate_schema", node=GenerateConfig)
    cs.store(group="hydra/help", name="shardgen", node=hydra_help_node())  # --help: these docstrings
