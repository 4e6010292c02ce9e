"""Model families: one module per diffusers pipeline family, each registering its ``ModelFamily``.

Ask ``family_of(pipe or pipeline class name)``. Every module of this package is imported here, so adding a
family is one new module plus its conf/model/<name>.yaml (docs/architecture.md, "Where to add a model").
"""

import importlib
import pkgutil

from shardgen.families.base import (ComponentSpec, DummyModel, ModelFamily, dummy_models, families, family_for,
                                    family_of, register)

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
    importlib.import_module(f"{__name__}.{_m}")  # each family module registers its family

__all__ = ["ComponentSpec", "DummyModel", "ModelFamily", "dummy_models", "families", "family_for", "family_of",
           "register"]
