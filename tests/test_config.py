"""Every option of every config group composes; typos fail while composing, naming what is valid."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from tests.conftest import CONF, compose_cfg

GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONF.iterdir() if g.is_dir()}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    cfg = compose_cfg(f"{group}={option}")
    node = cfg[group]
    if group == "prompts":
        assert node.format in ("txt", "jsonl", "csv", "tsv", "parquet", "auto")
    elif group == "signals":  # a multi-select group: signals=[phash,clip] sets signals.phash, signals.clip
        assert list(node) == [option]
    else:
        assert node.name == option
    # top-level sizes follow the model unless overridden
    assert (cfg.height, cfg.steps) == (cfg.model.height, cfg.model.steps)


def test_groups_present():
    assert {"model", "strategy", "launcher", "prompts"} <= set(GROUPS)
    assert {"tiny", "flux_dev", "flux2_dev", "qwen_image"} <= set(GROUPS["model"])
    assert {"dp", "tp", "cp_ulysses", "cp_ring", "cp_unified", "device_map", "auto"} <= set(GROUPS["strategy"])


def test_mission_command_line_composes_as_typed():
    cfg = compose_cfg("strategy=tp", "tp_degree=4")
    assert (cfg.strategy.name, cfg.tp_degree) == ("tp", 4)


def test_unknown_key_fails_while_composing():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("tp_degre=4")
    assert "tp_degre" in str(e.value.__cause__ or e.value)


def test_unknown_group_key_fails():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("model.foo=1")
    assert "foo" in str(e.value.__cause__ or e.value)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as e:
        compose_cfg("strategy=tpp")
    msg = str(e.value)
    assert "strategy/tpp" in msg and "tp" in msg and "cp_ulysses" in msg


def test_wrong_type_fails():
    with pytest.raises(ConfigCompositionException):
        compose_cfg("batch_size=four")
