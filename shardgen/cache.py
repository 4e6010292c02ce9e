"""The user's cache directory (``$SHARDGEN_CACHE``): what outlives a run and is shared by the runs of one machine or
cluster (the tiny models, the inductor cache, compile=auto's records, the remembered generation rates).

A leaf module (it imports no other shardgen module), so models/, speed/ and run/ alike may ask it.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Where built models are cached: ``$SHARDGEN_CACHE`` or ``~/.cache/shardgen`` (also when it is set but empty,
    which would otherwise mean the current directory). A leading ``~`` is expanded."""
    value = os.environ.get("SHARDGEN_CACHE", "").strip()
    return Path(os.path.expanduser(value)) if value else Path.home() / ".cache" / "shardgen"
