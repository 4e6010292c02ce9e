"""Process liveness: this host's name as run files record it, and whether a process recorded there still runs
(a temp file or claim whose owner is gone is a leftover)."""

from __future__ import annotations

import functools
import os
import re
import socket


def host_name() -> str:
    """This host's name as it goes into run file names and records (temp files, claims, events): letters, digits,
    ``.``, ``_`` and ``-`` only, so a name holding ``/``, ``~`` or ``..`` can neither leave the directory nor be
    mistaken for a separator."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()).strip(".") or "host"


PID_MAX = 2**22  # the kernel's largest pid_max (/proc/sys/kernel/pid_max: 4194304 on 64-bit)

IDENTITY = re.compile(r"[0-9A-Za-z-]+:\d+:\d+")
"""``process_identity``'s form; a record that is not in it (cut short, damaged) is judged by its pid alone."""


def pid_alive(pid: int, identity: str | None = None) -> bool:
    """Whether process ``pid`` runs on this host: it exists (another user's counts) and is no zombie (ended, not yet
    reaped by its parent: what it held is a leftover). With ``identity`` (``process_identity`` of the process that
    was recorded), also that the process now at ``pid`` is that one: pids are reused, soonest in a container, where
    each run's processes count from 1 again. A number no process can have (0 and below name process groups to
    ``kill``; past the kernel's pid limit) is no process."""
    if isinstance(pid, bool) or not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: it exists; /proc still tells its state and start
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc (not Linux), or it ended just now: the signal test above is all there is
    if fields[0] in ("Z", "X"):
        return False
    now = _identity_of(fields)
    return not well_formed(identity) or now is None or now == identity


def well_formed(identity: object) -> bool:
    """Whether ``identity`` is a ``process_identity`` (a damaged or cut record is not, and tells nothing)."""
    return isinstance(identity, str) and IDENTITY.fullmatch(identity) is not None


def process_identity(pid: int) -> str | None:
    """``"BOOT:NAMESPACE:START"``: the boot this host is in, the pid namespace the number ``pid`` is read in (this
    process's: containers sharing a host name may each have their own) and the clock tick the process started at;
    a pid is reused only after its process ended, so a later process at that pid started at a later tick, and a
    record of it tells a reused pid from the process itself. None without /proc."""
    fields = _proc_stat(pid)
    return None if fields is None else _identity_of(fields)


def same_pid_numbers(identity: str) -> bool:
    """Whether a process recorded with ``identity`` numbered its pids as this process does: the same boot's same pid
    namespace. Of a process of another boot that is moot (it is gone); of another namespace its pid means nothing
    here, so it cannot be judged gone by its pid."""
    boot, _, rest = identity.partition(":")
    return boot != _boot_id() or rest.partition(":")[0] == _pid_namespace()


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _identity_of(fields: list[str]) -> str | None:
    boot, namespace = _boot_id(), _pid_namespace()
    # field 22 of stat, the start time in clock ticks since boot, is the 20th after the command name
    return None if not boot or not namespace or len(fields) < 20 else f"{boot}:{namespace}:{fields[19]}"


@functools.lru_cache(maxsize=1)
def _boot_id() -> str | None:
    """This boot's random id, None where the kernel has none to read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace(":", "") or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """The inode number of this process's pid namespace (``/proc/self/ns/pid``), None where it cannot be read. Not
    cached: a forked child may be in another one."""
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or None
    except OSError:
        return None


def gone_from_this_host(host: object, pid: object, identity: object = None,
                        me: tuple[str, int, str | None] | None = None) -> bool:
    """Whether a process recorded as ``host``/``pid`` ran on this host and has ended (not this process: a record of
    our own is never a leftover). A record of another host is never known gone here: its pid means nothing here.
    With ``identity`` (``process_identity`` when it was recorded): also when another process has the pid now, this
    one included (a container run again), and never for a process of another pid namespace. ``me``: (host, pid,
    identity) of this process as its own records give them (a claim's ``owner_record``); by default read here."""
    my_host, my_pid, my_identity = me or (host_name(), os.getpid(), None)
    if host != my_host or not isinstance(pid, int) or isinstance(pid, bool):
        return False
    if not well_formed(identity):  # none recorded (an older record, no /proc), or damaged: the pid alone
        return pid != my_pid and not pid_alive(pid)
    ours = pid == my_pid and identity == (my_identity if me else process_identity(pid))
    return same_pid_numbers(identity) and not ours and not pid_alive(pid, identity)


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
