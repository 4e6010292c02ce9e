"""The keys shardgen writes into a sample's json: reserved, in this one place.

An input row's own fields are passed through into the json, except fields named like one of these:
they move under ``"extra"`` (``{"prompt": "a", "signals": "x"}`` gives ``"extra": {"signals": "x"}``), so a
row can never pose as shardgen's provenance, token counts, truncation flag or curation signals, nor break
the writer or the index that read them.
"""

from __future__ import annotations

RESERVED_KEYS = frozenset({
    # the row and how it was generated (shardgen/run/generation.py)
    "prompt", "index", "line", "seed", "model", "height", "width", "steps", "guidance", "guidance_2", "strategy",
    "true_cfg_scale", "lossy", "gen_s", "loras", "input_image", "strength",
    # the outcome (shardgen/dataio/shards/shardwork.py)
    "status", "error",
    # annotations (annotate.py, signals.py)
    "provenance", "tokens", "truncated", "signals",
    # video samples (video.py)
    "frames", "fps", "duration", "size", "codec", "crf", "pix_fmt",
    # where colliding input fields go, and the sample's key
    "extra", "key",
})
"""Every key shardgen itself may write into a sample's json."""


def split_reserved(fields: dict) -> dict:
    """``fields`` (an input row's extra columns) with those named like a reserved key moved under "extra"."""
    clash = {k: fields.pop(k) for k in list(fields) if k in RESERVED_KEYS}
    if clash:
        fields["extra"] = clash
    return fields


def input_fields(meta: dict) -> dict:
    """The fields of a sample's json that came from the prompt file (the "extra" holding collisions included)."""
    return {k: v for k, v in meta.items() if k not in RESERVED_KEYS or k == "extra"}
