"""Shared fixtures: composing configs like the command line does, and a tiny-model cache per session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from shardgen.config.store import register_configs

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
register_configs()


def compose_cfg(*overrides: str):
    """The config ``python -m jobs.generate <overrides>`` would run with."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="generate", overrides=list(overrides))


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory):
    """Build the tiny model once per test session, in a private cache (also seen by subprocesses)."""
    cache = tmp_path_factory.mktemp("shardgen-cache")
    old = os.environ.get("SHARDGEN_CACHE")
    os.environ["SHARDGEN_CACHE"] = str(cache)
    from shardgen.models.tiny import tiny_model_path

    tiny_model_path(cache)
    yield cache
    if old is None:
        os.environ.pop("SHARDGEN_CACHE", None)
    else:
        os.environ["SHARDGEN_CACHE"] = old
    shutil.rmtree(cache, ignore_errors=True)


def write_lines(path: Path, lines: list[str]) -> Path:
    """A txt prompt file."""
    path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    return path
