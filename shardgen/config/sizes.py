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


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest decimal unit that keeps a number from 1 to 999 (``1.6 MB``, ``123 GB``)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 100 else f"{v:,.0f} {unit}"
    return f"{int(n)} B"
