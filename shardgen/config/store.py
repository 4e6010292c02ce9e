"""Hydra's ConfigStore entries: the typed schema and the --help built from its docstrings.

Apart from schema.py so that help.py can read the schema without the schema importing help.py back.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from shardgen.config.help import hydra_help_node
from shardgen.config.launchers import LAUNCHERS
from shardgen.config.schema import GenerateConfig


def register_configs() -> None:
    """Register the schema (idempotent). Group YAMLs are typed by the fields of GenerateConfig; a launcher's YAML
    by its own config class, stored as ``launcher/base_<name>`` for the YAML's defaults list to name."""
    cs = ConfigStore.instance()
    cs.store(name="generate_schema", node=GenerateConfig)
    for launcher in LAUNCHERS.values():
        cs.store(group="launcher", name=f"base_{launcher.name}", node=launcher.config)
    cs.store(group="hydra/help", name="shardgen", node=hydra_help_node())  # --help: these docstrings
