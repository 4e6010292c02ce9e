"""``python -m tests.hanging_job [overrides]``: the job of ``python -m jobs.generate``, with a pipeline that hangs
for ever on any batch holding a prompt with "hang" (what a GPU after an Xid error does): for the stall test.

diffusers is imported only when a fault is installed: a SLURM job unpickles HangingJob (importing this module) before
submitit installs its signal handlers, and a signal that came before them would kill the job instead of requeueing it
(the timeout tests' first signal can come 25 s into a job)."""

import functools
import logging
import os
import sys
import time

from shardgen.launch.slurm import GenerateJob

_real = None  # FluxPipeline.__call__ before any fault replaced it


def _install(fault) -> None:
    """Make every FluxPipeline call go through ``fault`` (which calls ``_real`` for the real work)."""
    global _real
    from diffusers import FluxPipeline

    if _real is None:
        _real = FluxPipeline.__call__
    # wraps: diffusers reads the call's signature to tell which arguments the pipeline takes
    FluxPipeline.__call__ = functools.wraps(_real)(fault)


def _call(self, *args, **kwargs):
    if any("hang" in p for p in kwargs["prompt"]):
        while True:
            time.sleep(1)
    return _real(self, *args, **kwargs)


if __name__ == "__main__":
    from jobs.generate import run
    from tests.conftest import compose_cfg

    logging.basicConfig(level=logging.INFO, format="[%(name)s][%(levelname)s] %(message)s")
    _install(_call)
    run(compose_cfg(*sys.argv[1:]))



class HangingJob(GenerateJob):
    """``launcher=slurm``'s job; on attempts (SLURM restarts) below ``bad_attempts`` (and only on SLURM node ``node``
    when given) a batch holding a prompt with "hang" hangs as above (``fault="hang"``) or raises a CUDA-like error
    (``fault="raise"``); ``fault="raise_any"`` raises on every batch, ``fault="slow"`` makes every batch take ``slow_s``
    seconds longer (so that a test can act mid-run, or know an attempt cannot finish in time; the images stay the same).
    A timeout or preemption requeues the plain job (GenerateJob.checkpoint), without the fault."""

    def __init__(self, cfg_yaml: str, log_level: int = logging.INFO, bad_attempts: int = 1, fault: str = "hang",
                 node: str | None = None, slow_s: float = 2.0):
        super().__init__(cfg_yaml, log_level)
        self.bad_attempts, self.fault, self.node, self.slow_s = bad_attempts, fault, node, slow_s

    def __call__(self):
        on_node = self.node is None or os.environ.get("SLURMD_NODENAME") == self.node
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < self.bad_attempts and on_node:
            _install(dict(hang=_call, raise_any=_raise_any, slow=_slowed(self.slow_s)).get(self.fault, _raise))
        return super().__call__()


def _raise(self, *args, **kwargs):
    if any("hang" in p for p in kwargs["prompt"]):
        raise RuntimeError("CUDA error: unspecified launch failure (simulated)")
    return _real(self, *args, **kwargs)


def _raise_any(self, *args, **kwargs):
    raise RuntimeError("CUDA error: unspecified launch failure (simulated)")


def _slowed(seconds: float):
    def _slow(self, *args, **kwargs):
        time.sleep(seconds)
        return _real(self, *args, **kwargs)
    return _slow
