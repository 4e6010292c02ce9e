"""Process liveness: this host's name as run files record it, and whether a process recorded there still runs
(a temp file or claim whose owner is gone is a leftover)."""

from __future__ import annotations

import os
import re
import socket


def host_name() -> str:
    """This host's name as it goes into run file names and records (temp files, claims, events): letters, digits,
    ``.``, ``_`` and ``-`` only, so a name holding ``/``, ``~`` or ``..`` can neither leave the directory nor be
    mistaken for a separator."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()).strip(".") or "host"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
