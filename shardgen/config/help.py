"""``python -m jobs.generate --help``: every key with its default and its docstring from schema.py (one source).

Field docstrings are not kept at run time (a string after an annotated assignment is only in the source), so
they are read from ``schema.py`` with ``ast``; the text becomes Hydra's ``hydra.help.template``, which Hydra
prints with the config groups filled in.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

from omegaconf import MISSING

from shardgen.config import schema

SCHEMA = Path(__file__).with_name("schema.py")
# (the schema class, the key prefix its fields take, the heading of its section) of the nested groups
NESTED_SECTIONS = (("ModelConfig", "model.", "model.* (chosen by model=OPTION; any key can be overridden)"),
                   ("StrategyConfig", "strategy.", "strategy.* (chosen by strategy=OPTION)"),
                   ("LauncherConfig", "launcher.", "launcher.* (chosen by launcher=OPTION; every launcher)"),
                   ("LocalLauncherConfig", "launcher.", "launcher.* of launcher=local"),
                   ("SlurmLauncherConfig", "launcher.", "launcher.* of launcher=slurm"),
                   ("RayLauncherConfig", "launcher.", "launcher.* of launcher=ray"),
                   ("PromptsConfig", "prompts.", "prompts.* (chosen by prompts=OPTION)"))
NESTED = {"model", "strategy", "launcher", "prompts"}  # NestedConfigs fields that are sections of their own
WIDTH = 100


def field_docs(source: str | None = None) -> dict[str, dict[str, str]]:
    """class name -> field name -> the docstring written under the field in schema.py ("" when it has none)."""
    tree = ast.parse(source if source is not None else SCHEMA.read_text(encoding="utf-8"))
    out: dict[str, dict[str, str]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        docs = out.setdefault(cls.name, {})
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                is_doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                    and isinstance(nxt.value.value, str)
                docs[node.target.id] = " ".join(nxt.value.value.split()) if is_doc else ""
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "???"
    if value is MISSING:
        return "??? (mandatory: the chosen option sets it, or you do)"
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return f"(the value of {value[2:-1]})"  # an interpolation: shown in words (Hydra would resolve ${...})
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if not isinstance(value, (dict, list)) or value else ("{}" if isinstance(value, dict) else "[]")


def sections() -> list[tuple[str, str, str]]:
    """(schema class, key prefix, heading) of every section: the top-level keys by group (schema.GROUPS; a group's
    heading is the first line of its docstring), signals, then the nested configs."""
    groups = [(g.__name__, "", f"{g.__doc__.splitlines()[0].rstrip('.')} (top-level keys)") for g in schema.GROUPS]
    return groups + [("NestedConfigs", "", "signals (chosen by signals=[OPTION,...])")] + list(NESTED_SECTIONS)


def help_entries() -> list[tuple[str, list[tuple[str, str, str]]]]:
    """[(section heading, [(dotted key, default, description)])] for every field of the schema, each once."""
    docs = field_docs()
    out = []
    for cls_name, prefix, heading in sections():
        cls = getattr(schema, cls_name)
        inherited = {f.name for base in cls.__bases__ if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)} if prefix else set()  # a launcher's base keys: listed once
        rows = [(prefix + f.name, _default(f), docs.get(cls_name, {}).get(f.name, ""))
                for f in dataclasses.fields(cls)
                if not (cls_name == "NestedConfigs" and f.name in NESTED) and f.name not in inherited]
        out.append((heading, rows))
    return out


def help_text() -> str:
    """The help as plain text (no Hydra substitutions): usage, then every key, its default and what it does."""
    lines = []
    for heading, rows in help_entries():
        lines += ["", f"== {heading} =="]
        for key, default, doc in rows:
            lines.append(f"{key}={default}")
            lines += textwrap.wrap(doc, WIDTH, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False,
                                   break_long_words=False) if doc else []
    return "\n".join(lines)


HEADER = """python -m jobs.generate: every prompt of a prompt file into one sample of a run directory's webdataset shards.

usage: python -m jobs.generate [group=option ...] [key=value ...]
  python -m jobs.generate                                                  # tiny model, examples/prompts.txt
  python -m jobs.generate prompts=parti prompts.path=PartiPrompts.tsv run_dir=runs/parti
  python -m jobs.generate dry_run=true model=flux_dev                      # the plan, no model loaded
  python -m jobs.generate launcher=local launcher.nprocs=2                 # 2 local ranks
Re-running the same command continues the run. The composed values: add --cfg job. Hydra's flags: --hydra-help.
"""


def groups_text() -> str:
    """Each config group and its options, one line each (Hydra's own list, $APP_CONFIG_GROUPS, also shows the
    ConfigStore's launcher schemas, ``base_*``, which are no option to choose)."""
    from shardgen.config.overrides import CONF, group_options

    return "\n".join(f"{g}: {', '.join(group_options(g))}" for g in sorted(p.name for p in CONF.iterdir() if p.is_dir()))


def hydra_help_node() -> dict:
    """The ``hydra/help`` config (Hydra's help template) built from the schema's docstrings."""
    template = (HEADER + "\n== Config groups (group=option) ==\n" + groups_text() + "\n\n" + help_text() + "\n")
    # string.Template (Hydra) reads $NAME: a literal $ is $$; OmegaConf would resolve ${...}: help_text has none
    template = template.replace("$", "$$")
    return {"app_name": "jobs.generate", "header": "", "footer": "", "template": template}


def markdown_reference() -> str:
    """docs/config.md: every key with its default and docstring, by section, and each config group's options
    (``python -m shardgen.config.help > docs/config.md`` writes it; a test checks it is current)."""
    from shardgen.config.overrides import group_options

    lines = ["# Configuration reference", "",
             "Generated from the docstrings of `shardgen/config/schema.py` by `python -m shardgen.config.help > "
             "docs/config.md`; do not edit by hand. `python -m jobs.generate --help` prints the same. Every key is a "
             "Hydra override: `python -m jobs.generate key=value group=option`.", "", "## Config groups", "",
             "| group | options (conf/GROUP/*.yaml) |", "|---|---|"]
    lines += [f"| `{g}` | {', '.join(f'`{o}`' for o in group_options(g))} |"
              for g in ("model", "strategy", "launcher", "prompts", "signals", "speed")]
    for heading, rows in help_entries():
        lines += ["", f"## {heading}", "", "| key | default | what it does |", "|---|---|---|"]
        lines += [f"| `{key}` | `{default}` | {doc.replace('|', chr(92) + '|')} |" for key, default, doc in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_reference(), end="")
