"""Every default lives in one place, the schema (shardgen/config/schema.py): the code reads a schema key as
``cfg.key`` (the composed config holds the schema's default), never as ``cfg.get(key, default)``, whose second
default can drift from the schema's; and conf/generate.yaml states only what differs from the schema."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

from shardgen.config import schema
from shardgen.config.launchers import LAUNCHERS

ROOT = Path(__file__).resolve().parents[1]
# what a config object is called in the code -> the schema class of its keys
GROUP_OF = {"model": schema.ModelConfig, "prompts": schema.PromptsConfig, "strategy": schema.StrategyConfig,
            "launcher": schema.LauncherConfig}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


LAUNCHER_KEYS = set().union(*(_fields(launcher.config) for launcher in LAUNCHERS.values()))
TOP_KEYS = _fields(schema.GenerateConfig)


def _schema_keys(obj: ast.expr) -> set[str] | None:
    """The schema keys of the config object ``obj`` names (``cfg``, ``cfg.model``, ``self.cfg.prompts``, ``ln``
    ...), or None when it names no config."""
    if isinstance(obj, ast.Name):
        return {"cfg": TOP_KEYS, "ln": LAUNCHER_KEYS}.get(obj.id)
    if isinstance(obj, ast.Attribute):
        if obj.attr == "cfg":
            return TOP_KEYS
        if obj.attr in GROUP_OF and _schema_keys(obj.value) is TOP_KEYS:
            return LAUNCHER_KEYS if obj.attr == "launcher" else _fields(GROUP_OF[obj.attr])
    return None


def second_defaults(path: Path) -> list[str]:
    """``cfg.get("key", default)`` calls of ``path`` on a key its config's schema defines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
            continue
        keys = _schema_keys(node.func.value)
        if keys is not None and node.args[0].value in keys:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_schema_key_is_read_with_a_second_default():
    found = [f"{p.parent.relative_to(ROOT)}/{hit}" for folder in ("shardgen", "parallel", "jobs")
             for p in sorted((ROOT / folder).rglob("*.py")) for hit in second_defaults(p)]
    assert found == [], "read these as cfg.key (the schema fills the default):\n" + "\n".join(found)


def test_the_scan_finds_a_second_default(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('def f(cfg, row):\n    return (cfg.prompts.get("max_prompt_chars", 1), cfg.get("fp8", False),\n'
                      '            cfg.get("not_a_key", 1), row.get("fp8", False))\n')
    assert sorted(h.split(": ", 1)[1] for h in second_defaults(sample)) == [
        "cfg.get('fp8', False)", "cfg.prompts.get('max_prompt_chars', 1)"]


def test_generate_yaml_sets_only_what_differs_from_the_schema():
    conf = OmegaConf.load(ROOT / "conf" / "generate.yaml")
    defaults = OmegaConf.structured(schema.GenerateConfig)
    same = [k for k in conf if k not in ("defaults", "hydra") and k in defaults
            and not OmegaConf.is_interpolation(defaults, k) and conf[k] == defaults[k]]
    assert same == [], f"conf/generate.yaml restates the schema's defaults of {same}: drop them"
