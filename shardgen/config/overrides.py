"""Command-line overrides checked against the schema before Hydra composes them.

Hydra refuses ``batchsize=4`` with a hint to append it (``+batchsize=4``), which then runs with the key
ignored, and answers ``model=flux`` with its search path. Here every key is looked up in the schema,
``+key`` included, and every group option in conf/: a miss is one line naming the close matches. A value of the
wrong type (``batch_size=1.5``) and a token with no ``=`` (``bogus``) are one line too, where Hydra would print
its merge or parse error in five.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

from shardgen.config.paths import CONF
from shardgen.config.schema import GenerateConfig

HELP = "python -m jobs.generate --help lists every key"


def group_options(group: str, conf: Path = CONF) -> list[str]:
    """The options of a config group: its YAML files in conf/<group>/ and its ConfigStore entries (a schema the
    YAMLs name, ``base_*``, is not an option)."""
    from hydra.core.config_store import ConfigStore

    try:
        stored = [n.removesuffix(".yaml") for n in ConfigStore.instance().list(group)]
    except OSError:  # no entry in the group
        stored = []
    return sorted({p.stem for p in (conf / group).glob("*.yaml")} | {n for n in stored if not n.startswith("base_")})


def check_overrides(overrides: list[str], conf: Path = CONF) -> str | None:
    """The first override that is no ``KEY=VALUE``, names no key of the schema or no option of its group, or gives
    a key a value of a type it cannot take, as a one-line message saying what to write instead; None when all are
    fine (or Hydra's parser refuses one for its syntax: its message names the character)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, parsed = OverridesParser.create(), []
    for text in overrides:
        try:
            parsed.append(parser.parse_overrides([text])[0])
        except Exception:
            if "=" in text or text.startswith("~"):  # a syntax error: Hydra's own message names the character
                return None
            parsed.append(None)  # a bare token: named below, in its turn
    groups = {p.name for p in conf.iterdir() if p.is_dir()}
    chosen = {o.key_or_group: o.value() for o in parsed if o and o.key_or_group in groups and not o.is_delete()}
    for text, o in zip(overrides, parsed):
        if o is None:
            return f"{text}: {_bare_token(text, groups)}"
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):  # Hydra's own
            problem = hydra_output_problem(key, o.value())
            if problem:
                return f"{text}: {problem}"
            continue
        if o.package is not None:
            continue
        if key in groups and not o.is_delete():
            problem = _unknown_options(key, o.value(), group_options(key, conf))
        else:
            problem = (_unknown_key(key.split("."), GenerateConfig) or _other_launchers_key(key, chosen)
                       or _wrong_type(o, GenerateConfig) or _wrong_entries(o, GenerateConfig))
        if problem:
            return f"{text}: {problem}"
    return None


# Hydra's own keys a command line may set: none of them writes a file. Its run and sweep folders, .hydra/ and the
# job's log file are off in conf/generate.yaml (shardgen writes only into run_dir); any other hydra.* key could turn
# one of them back on (hydra.run.dir=/elsewhere, hydra.output_subdir=.hydra, hydra.job_logging.handlers.file=...).
HYDRA_FREE = {"hydra.verbose": None, "hydra/help": None, "hydra/hydra_help": None,
              "hydra/job_logging": {"stdout", "disabled", "none"},
              "hydra/hydra_logging": {"default", "disabled", "none", "hydra_debug"}}
HYDRA_AS_CONFIGURED = {"hydra.run.dir": ".", "hydra.output_subdir": None, "hydra.job.chdir": False}


def hydra_output_problem(key: str, value: Any) -> str | None:
    """Why an override of Hydra's own ``key`` is refused (it could make Hydra write outside run_dir); None for the
    keys of HYDRA_FREE (with an allowed value) and for a key set to what conf/generate.yaml already sets."""
    if key in HYDRA_FREE and (HYDRA_FREE[key] is None or value in HYDRA_FREE[key]):
        return None
    if key in HYDRA_AS_CONFIGURED and value == HYDRA_AS_CONFIGURED[key]:
        return None
    allowed = HYDRA_FREE.get(key)
    if allowed:
        return f"{key} may be {', '.join(sorted(allowed))} (the others write a log file outside run_dir)"
    return ("Hydra's own output folders and files are off: shardgen writes only into run_dir (its config, logs and "
            "shards); leave hydra settings out of the command line and set run_dir=DIR for where the run goes")


def _bare_token(text: str, groups: set[str]) -> str:
    """What a command-line word without ``=`` lacks: its value, if it names a key or group, else a key too."""
    if not all(text.split(".")):  # no key's spelling ("...", "a..b"): no close match to name either
        return f"not KEY=VALUE; {HELP}"
    unknown = None if text in groups else _unknown_key(text.split("."), GenerateConfig)
    return f"not KEY=VALUE, and {unknown}" if unknown else f"no value: write {text}=VALUE"


# The leaf types Hydra converts a value to, by OmegaConf's own node (so exactly what composing would refuse), and
# how a message names each.
_LEAF_TYPES = {int: (IntegerNode, "an integer"), float: (FloatNode, "a number"), bool: (BooleanNode, "true or false"),
               str: (StringNode, "a string")}


def _wrong_type(o: Any, schema: type) -> str | None:
    """``KEY takes TYPE`` when Hydra could not convert the override's value to its key's type in the schema; None
    for a value it can, an interpolation, a sweep, a deletion, ``+key`` (Hydra's to judge) and a key of type Any,
    a list or a dict."""
    if o.is_delete() or o.is_add() or o.is_sweep_override():
        return None
    hint, key = _leaf_type(o.key_or_group.split("."), schema), o.key_or_group
    optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
    if optional:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    value = o.value()
    if typing.get_origin(hint) in (list, typing.List) and value is not None and not isinstance(value, list):
        return f"{key} takes a list: write '{key}=[{o.get_value_element_as_str()}]'"
    if hint not in _LEAF_TYPES:
        return None
    node, wanted = _LEAF_TYPES[hint]
    if value is None:
        return None if optional else f"{key} takes {wanted}, not null"
    try:
        node(value=value)
    except Exception:  # OmegaConf's ValidationError, or a number past a float's range
        example = (f" (e.g. {key}={int(value)})" if hint is int and isinstance(value, float) and value.is_integer()
                   else "")
        return f"{key} takes {wanted}{' or null' if optional else ''}{example}"
    return None


ENTRY_FIELDS = {"model.loras": {"path": str, "scale": float}}
"""Lists typed ``List[Any]`` in the schema (they take short forms too, "PATH" and "PATH:SCALE", which the reader
checks: shardgen/models/lora.py) and the fields of their mapping entries."""


def _wrong_entries(o: Any, schema: type) -> str | None:
    """``KEY[i].FIELD takes ...`` for a list of config entries (``model.loras``: ENTRY_FIELDS) given an entry that is no
    mapping, names no field of its entry, or holds a value of another type than its field's: a string, a boolean
    or a list where a number goes (Hydra would print its merge error in six lines, or take '0.8' as 0.8 where a
    row's loras refuse it); None otherwise."""
    if o.is_delete() or o.is_sweep_override():
        return None
    key, hint, value = o.key_or_group, _leaf_type(o.key_or_group.split("."), schema), o.value()
    args = typing.get_args(hint)
    entry_type = args[0] if len(args) == 1 else None
    fields = ENTRY_FIELDS.get(key) or (_field_types(entry_type) if dataclasses.is_dataclass(entry_type) else None)
    if typing.get_origin(hint) not in (list, typing.List) or fields is None or not isinstance(value, list):
        return None
    example = "{" + ", ".join(f"{n}: ..." for n in fields) + "}"
    for i, entry in enumerate(value):
        if key in ENTRY_FIELDS and not isinstance(entry, dict):
            continue  # a short form: the reader checks it
        if not isinstance(entry, dict):
            return f"{key}[{i}] is {entry!r}: write each entry as {example}"
        for name, v in entry.items():
            if name not in fields:
                return f"{key}[{i}] has no field {name!r}{_did_you_mean(str(name), list(fields))}: write {example}"
            typ = fields[name]
            if typ in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
                return f"{key}[{i}].{name} takes a number, not {v!r} (e.g. {name}: 0.8, unquoted)"
            if typ is str and not isinstance(v, str):
                return f"{key}[{i}].{name} takes a string, not {v!r}"
    return None


def _leaf_type(parts: list[str], schema: type) -> Any:
    """The schema's type of a known key; None for a key under a field that is no dataclass (a dict's is free)."""
    for name in parts[:-1]:
        schema = _field_types(schema).get(name)
        if not dataclasses.is_dataclass(schema):
            return None
    return _field_types(schema).get(parts[-1])


def _unknown_options(group: str, value: Any, options: list[str]) -> str | None:
    chosen = value if isinstance(value, list) else [value]
    for v in chosen:  # a sweep or null is Hydra's to judge
        if isinstance(v, str) and v not in options:
            return (f"no {group} option {v!r}{_did_you_mean(str(v), options)}; the options are "
                    f"{', '.join(options)} (conf/{group}/)")
    return None


def _unknown_key(parts: list[str], schema: type) -> str | None:
    """Walk ``parts`` down the schema's dataclasses; anything under a dict-typed field is free."""
    for depth, name in enumerate(parts):
        hints = _field_types(schema)
        if name not in hints:
            where = ".".join(parts[:depth])
            return (f"no key {'.'.join(parts[:depth + 1])!r}{_did_you_mean(name, list(hints), where)}; "
                    f"{HELP}{' under ' + where + '.' if where else ''}")
        if not dataclasses.is_dataclass(hints[name]):
            return None  # a leaf or a dict: the value's type is Hydra's to check
        schema = hints[name]
    return None


def _other_launchers_key(key: str, chosen: dict[str, Any]) -> str | None:
    """A ``launcher.KEY`` that only other launchers have (``launcher.partition`` without ``launcher=slurm``)."""
    from shardgen.config.launchers import LAUNCHERS

    name, parts = chosen.get("launcher", "none"), key.split(".")
    if parts[0] != "launcher" or len(parts) < 2 or not isinstance(name, str) or name not in LAUNCHERS:
        return None
    if parts[1] in {f.name for f in dataclasses.fields(LAUNCHERS[name].config)}:
        return None
    owners = [n for n, row in LAUNCHERS.items() if parts[1] in {f.name for f in dataclasses.fields(row.config)}]
    return (f"launcher={name} has no key {key!r}; it is a key of " + " or ".join(f"launcher={n}" for n in owners)
            + ": choose that launcher too")


def _field_types(schema: type) -> dict[str, Any]:
    """Field name -> type of ``schema`` and of every subclass of it: a group whose options extend a base config
    (each launcher's own fields) takes any option's keys here; the chosen option's schema judges the rest."""
    out: dict[str, Any] = {}
    todo = [schema]
    while todo:
        cls = todo.pop()
        hints = typing.get_type_hints(cls)
        out.update({f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in out})
        todo += cls.__subclasses__()
    return out


def _did_you_mean(name: str, known: list[str], where: str = "") -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if not close:
        return ""
    prefix = where + "." if where else ""
    return " (did you mean " + " or ".join(prefix + c for c in close) + "?)"
