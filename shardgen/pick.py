"""``pick``: a dataclass filled from the same-named keys of a config, the one way a class takes config values.

shardgen/config/schema.py defines every top-level key once, with its default and docstring, in a group
(``SpeedConfig``, ``VideoConfig``, ...). A class that reads keys (a group, or a runtime class whose fields are named
after the keys it reads, such as ``AccelOptions``) is built with ``pick(cls, cfg, **derived)`` instead of copying
the keys one by one: no key is listed a second time and no default written twice. ``derived`` holds what the class
computes itself (``compile: auto`` resolved, a value it names differently).

A module of its own at the bottom of the package, so that every layer (speed/, dataio/, run/) may use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")
_MISSING = "???"  # OmegaConf's MISSING: a mandatory value (not imported: this module imports nothing of shardgen)


def pick(cls: type[T], *sources: Any, **derived: Any) -> T:
    """An instance of the dataclass ``cls``: each field gets ``derived``'s value when given, else the value of the key
    of its name in the first of ``sources`` that has one (a composed config, a group object, a dict), else its
    default. A field left to a default that only a composed config resolves (``${model.height}``, ``???``) is a
    KeyError naming it; a ``derived`` name that is not a field of ``cls`` is a TypeError."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(derived) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    values = dict(derived)
    for f in dataclasses.fields(cls):
        if not f.init or f.name in values:
            continue
        for source in sources:
            found, value = _lookup(source, f.name)
            if found:
                values[f.name] = value
                break
        else:
            if isinstance(f.default, str) and (f.default == _MISSING or f.default.startswith("${")):
                raise KeyError(f"{cls.__name__}.{f.name}: not in the config given, and its default "
                               f"{f.default!r} needs a composed config")
    return cls(**values)


def _lookup(source: Any, name: str) -> tuple[bool, Any]:
    """(found, value) of key ``name`` in a mapping (DictConfig, dict) or attribute ``name`` of an object."""
    if hasattr(source, "__contains__") and hasattr(source, "__getitem__"):
        return (True, source[name]) if name in source else (False, None)
    return (True, getattr(source, name)) if hasattr(source, name) else (False, None)
