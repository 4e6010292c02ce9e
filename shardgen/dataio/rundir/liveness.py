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
    """Whether process ``pid`` runs on this host: it exists (another user's counts) and is no zombie (ended, not yet
    reaped by its parent: what it held is a leftover)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the signal test above is all there is


def gone_from_this_host(host: object, pid: object) -> bool:
    """Whether a process recorded as ``host``/``pid`` ran on this host and has ended (not this process: a record of
    our own is never a leftover). A record of another host is never known gone here: its pid means nothing here."""
    return host == host_name() and isinstance(pid, int) and pid != os.getpid() and not pid_alive(pid)


# set by a launcher for the processes it starts after others ended (launcher=ray: a replica started again): the
# ended ones, "host:pid:time,...", each a process that ran on ``host`` as ``pid`` and was gone at ``time``
ENDED_ENV = "SHARDGEN_ENDED_PROCESSES"


def ended_processes() -> list[tuple[str, int, float]]:
    """(host, pid, when it was seen gone) of each process a launcher reported ended (ENDED_ENV); entries that do not
    parse are left out."""
    out = []
    for entry in filter(None, os.environ.get(ENDED_ENV, "").split(",")):
        try:
            host, pid, when = entry.rsplit(":", 2)
            out.append((host, int(pid), float(when)))
        except ValueError:
            continue
    return out


def reported_ended(host: object, pid: object, started: object) -> bool:
    """Whether a launcher reported the process (``host``, ``pid``) that started at ``started`` ended: its record was
    written before the report (a later process reusing the pid is not the one that ended)."""
    return isinstance(pid, int) and isinstance(started, (int, float)) and any(
        h == host and p == pid and started <= when for h, p, when in ended_processes())
