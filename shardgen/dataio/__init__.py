"""Data in and out of a run, in four rooms by role, each importing only the rooms below it (the operator tools that
read a run, shardgen/tools/, sit above them):

    resume   a run across launches: fingerprint, ledger, repair, extending the plan
    shards   shards out: sink, shard commit (shardwork), tar, index, video, annotations, signals
    prompts  prompts in and planning: readers, plan, planning scans, truncation, reserved json keys
    rundir   the run directory: its layout (RunDir) and atomic writes, claims, run log

Other layers import a room's public names from the room (``from shardgen.dataio.prompts import build_plan``);
inside dataio a module imports the module that defines a name.
"""

from __future__ import annotations

import ast
import importlib
import sys
from typing import Any, Callable


def lazy_names(room: str, names: list[str]) -> Callable[[str], Any]:
    """A room's module ``__getattr__``: each of ``names`` is imported, on first use, from the module the room's
    ``if TYPE_CHECKING:`` block imports it from. Importing a room thus loads none of its modules (nor the
    numpy, pyarrow or PIL they import): ``python -m jobs.generate --help`` reads prompts.MAX_PROMPT_CHARS
    without loading the planner."""
    where: dict[str, str] = {}

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {room!r} has no attribute {name!r}")
        if not where:
            where.update(_type_checking_imports(sys.modules[room].__file__))
        value = getattr(importlib.import_module(f"{room}.{where[name]}"), name)
        setattr(sys.modules[room], name, value)  # later lookups skip __getattr__
        return value

    return __getattr__


def _type_checking_imports(path: str) -> dict[str, str]:
    """{name: module} of the ``from .module import name`` lines under ``if TYPE_CHECKING:`` in ``path``."""
    found = {}
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.level == 1:
                    found.update({a.asname or a.name: imp.module for a in imp.names})
    return found
