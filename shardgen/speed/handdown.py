"""What the model families hand down to the speed techniques.

speed/ imports no family: the families sit above it (their fused blocks are built from its kernels) and hand their
knowledge down. The families registry installs its lookups here when it is imported (shardgen/families/__init__.py,
which every path that loads a pipeline imports first); until then no pipeline has a family, and the techniques touch
only what every transformer has.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable


@dataclass(frozen=True)
class Lookups:
    """The families registry's answers, by pipeline object and by transformer class name."""

    family_of: Callable[[Any], Any]
    """A pipeline (object or class) -> its ``ModelFamily`` (shardgen/families/base.py), or None."""
    repeated_blocks: Callable[[str], tuple[str, ...]]
    """A transformer class name -> the repeated block classes its family declares (empty: none)."""
    fused_blocks: Callable[[str], ModuleType | None]
    """A transformer class name -> the module of its family's fused block forwards, or None."""


NONE = Lookups(family_of=lambda pipe: None, repeated_blocks=lambda name: (), fused_blocks=lambda name: None)
_installed = [NONE]


def install(lookups: Lookups) -> None:
    """Answer the speed techniques' questions with ``lookups`` (the families registry calls this once)."""
    _installed[0] = lookups


def family_of(pipe: Any) -> Any:
    """The family of ``pipe`` (its ``speed_hooks``, ``cuda_graphs``, ``compiled_speedup``, ``fused_blocks``), or None."""
    return _installed[0].family_of(pipe)


def declared_repeated_blocks(transformer_class: str) -> tuple[str, ...]:
    """The repeated block classes a family declares for ``transformer_class`` (empty when none does)."""
    return _installed[0].repeated_blocks(transformer_class)


def declared_fused_blocks(transformer_class: str) -> ModuleType | None:
    """The fused block module a family declares for ``transformer_class`` (None when none does)."""
    return _installed[0].fused_blocks(transformer_class)
