"""A job told to stop (``kill PID``, ``docker stop``, a scheduler other than SLURM: SIGTERM) stops like Ctrl-C:
the batch in flight is dropped, what was committed stays, and the run is resumable by the same command.

Python's default for SIGTERM ends the process at once with no message and no cleanup; SIGINT raises
KeyboardInterrupt, which every layer already handles. SIGTERM raises ``Terminated``, a KeyboardInterrupt, so both
take one path; only the exit status (128 + 15) and the words differ. Jobs under submitit never install it: submitit
handles SIGTERM and SIGUSR2 there (preemption, time limit, requeue).
"""

from __future__ import annotations

import signal
import threading

from shardgen.dataio.rundir.liveness import pid_alive

SIGTERM_EXIT = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM."""


_RECEIVED = threading.Event()


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM while stopping ends the process at once
    _RECEIVED.set()
    raise Terminated()


def sigterm_received() -> bool:
    """Whether ``stop_on_sigterm``'s handler ran in this process (a library that catches the ``Terminated`` it raised
    may hand on a plain KeyboardInterrupt instead)."""
    return _RECEIVED.is_set()


def stop_on_sigterm() -> None:
    """Make SIGTERM raise ``Terminated`` in this process's main thread (no-op elsewhere, or where SIGTERM is
    ignored on purpose, e.g. by ``nohup``-like wrappers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, _raise_terminated)


_LAUNCHER: list[tuple[int, str | None]] = []


def note_launcher(pid: int, identity: str | None = None) -> None:
    """Record the process that launched this rank (``launch/local.py``'s spawned ranks; ``identity``: its
    ``liveness.process_identity``), for ``stopping``."""
    _LAUNCHER[:] = [(pid, identity)]


def stopping() -> bool:
    """Whether this process is being stopped rather than failing: SIGTERM received, or the process that launched it
    is gone. A rank of a tensor- or context-parallel replica whose peer stopped first sees the peer's exit as an
    error in a collective (gloo's "Connection reset by peer") before its own launcher watch fires; that error is the
    stop, and the rank gives up its claims as the stop would."""
    return sigterm_received() or any(not pid_alive(pid, identity) for pid, identity in _LAUNCHER)
