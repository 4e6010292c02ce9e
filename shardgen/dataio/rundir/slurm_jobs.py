"""Whether a SLURM job attempt is still alive, asked of ``scontrol`` (for claims held by a job on another node).

Lives with the run directory's liveness rules (claims.py) rather than with the launcher: a claim's holder is
judged the same way whichever launcher started the job that looks at it.
"""

from __future__ import annotations

import re

_LIVE_STATES = ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "CONFIGURING", "RESIZING", "SIGNALING")
_ended_cache: dict[tuple[str, int], tuple[float, bool]] = {}


def slurm_attempt_ended(job_id: str, restart: int, ttl_s: float = 5.0) -> bool:
    """True when SLURM says attempt ``restart`` of job ``job_id`` is over: the job ended, was requeued since, or is
    forgotten. Lets a claim held by a job on another node (whose pid cannot be checked from here) be taken over
    at once instead of after its lease. False while it may still run, or when SLURM cannot be asked."""
    import subprocess
    import time

    key, now = (job_id, restart), time.monotonic()
    if key in _ended_cache and now - _ended_cache[key][0] < ttl_s:
        return _ended_cache[key][1]
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    state, restarts = re.search(r"JobState=(\w+)", out.stdout), re.search(r"Restarts=(\d+)", out.stdout)
    if out.returncode != 0 or not state:
        ended = "Invalid job id" in out.stderr  # forgotten (MinJobAge after it ended); otherwise SLURM did not answer
    else:
        ended = state.group(1) not in _LIVE_STATES or (restarts is not None and int(restarts.group(1)) > restart)
    _ended_cache[key] = (now, ended)
    return ended
