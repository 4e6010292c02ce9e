"""Memory sizes as a config writes them (``strategy.max_memory=70GiB``)."""

from __future__ import annotations

from typing import Any

GiB = 1 << 30
"""Bytes in a GiB."""
UNITS = {"GIB": GiB, "GB": 10 ** 9, "MIB": 1 << 20, "MB": 10 ** 6, "KIB": 1 << 10, "KB": 10 ** 3, "B": 1}


def parse_bytes(value: Any) -> int:
    """``70GiB``, ``70GB``, ``512MiB`` or a number of bytes; ValueError for anything else."""
    s = str(value).strip()
    try:
        for unit, scale in UNITS.items():
            if s.upper().endswith(unit):
                n = float(s[: -len(unit)]) * scale
                break
        else:
            n = float(s)
    except ValueError:
        n = -1
    if not n > 0:
        raise ValueError(f"{value!r} is not a memory size: use e.g. 70GiB, 70GB, 512MiB or a number of bytes")
    return int(n)
