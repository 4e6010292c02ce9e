"""Model families: one folder per diffusers pipeline family (``shardgen/families/<family>/``), each registering its
``ModelFamily`` from its ``__init__.py``; the folder also holds the family's fused blocks, speed hooks and tiny model
builders, which its spec hands down by reference.

Ask ``family_of(pipe or pipeline class name)``. Every folder of this package is imported here (``discover``), so adding
a family is one new folder plus its conf/model/<name>.yaml (docs/architecture.md, "Where to add a model"). The speed
techniques get the families' answers through ``shardgen.speed.handdown``, installed here.
"""

import importlib
import pkgutil

from shardgen.families.base import (ComponentSpec, DummyModel, ModelFamily, TinyModel, declared_fused_blocks,
                                    declared_repeated_blocks, dummy_models, families, family_for, family_of, register,
                                    tiny_model, tiny_models)
from shardgen.speed import handdown


def discover() -> list[str]:
    """Import every family folder (or module) of this package's path not imported yet: each registers its family.
    The names imported, in order."""
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base")
    for name in found:
        importlib.import_module(f"{__name__}.{name}")
    return found


discover()
handdown.install(handdown.Lookups(family_of=family_of, repeated_blocks=declared_repeated_blocks,
                                  fused_blocks=declared_fused_blocks))

__all__ = ["ComponentSpec", "DummyModel", "ModelFamily", "TinyModel", "discover", "dummy_models", "families",
           "family_for", "family_of", "register", "tiny_model", "tiny_models"]
