"""What pins a model's weights beyond its source, for the run fingerprint: the embedded tiny models' versions.

Read from the families' specs (``ModelFamily.tiny_models``), which import no torch, so that a launch can compare its
fingerprint with a run's, and refuse, before torch is imported.
"""

from __future__ import annotations

from typing import Any


def model_version(model_cfg: Any) -> str | None:
    """A version string for the fingerprint where the source alone does not pin the weights."""
    from shardgen.families import tiny_model

    tiny = tiny_model(model_cfg.source)
    return tiny.version if tiny is not None else model_cfg.revision
