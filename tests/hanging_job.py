"""``python -m tests.hanging_job [overrides]``: the job of ``python -m jobs.generate``, with a pipeline that hangs
for ever on any batch holding a prompt with "hang" (what a GPU after an Xid error does): for the stall test."""

import functools
import logging
import os
import sys
import time

from diffusers import FluxPipeline

from shardgen.launch.slurm import GenerateJob

_real = FluxPipeline.__call__


@functools.wraps(_real)
def _call(self, *args, **kwargs):
    if any("hang" in p for p in kwargs["prompt"]):
        while True:
            time.sleep(1)
    return _real(self, *args, **kwargs)


if __name__ == "__main__":
    from jobs.generate import run
    from tests.conftest import compose_cfg

    logging.basicConfig(level=logging.INFO, format="[%(name)s][%(levelname)s] %(message)s")
    FluxPipeline.__call__ = _call
    run(compose_cfg(*sys.argv[1:]))



class HangingJob(GenerateJob):
    """``launcher=slurm``'s job; on attempts (SLURM restarts) below ``bad_attempts`` (and only on SLURM node ``node``
    when given) a batch holding a prompt with "hang" hangs as above (``fault="hang"``) or raises a CUDA-like error
    (``fault="raise"``); ``fault="raise_any"`` raises on every batch, ``fault="slow"`` makes every batch take ``slow_s``
    seconds longer (so that a test can act mid-run, or know an attempt cannot finish in time; the images stay the same)."""

    def __init__(self, cfg_yaml: str, log_level: int = logging.INFO, bad_attempts: int = 1, fault: str = "hang",
                 node: str | None = None, slow_s: float = 2.0):
        super().__init__(cfg_yaml, log_level)
        self.bad_attempts, self.fault, self.node, self.slow_s = bad_attempts, fault, node, slow_s

    def __call__(self):
        on_node = self.node is None or os.environ.get("SLURMD_NODENAME") == self.node
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < self.bad_attempts and on_node:
            FluxPipeline.__call__ = dict(hang=_call, raise_any=_raise_any, slow=_slowed(self.slow_s)).get(self.fault,
                                                                                                          _raise)
        return super().__call__()


@functools.wraps(_real)
def _raise(self, *args, **kwargs):
    if any("hang" in p for p in kwargs["prompt"]):
        raise RuntimeError("CUDA error: unspecified launch failure (simulated)")
    return _real(self, *args, **kwargs)


@functools.wraps(_real)
def _raise_any(self, *args, **kwargs):
    raise RuntimeError("CUDA error: unspecified launch failure (simulated)")


def _slowed(seconds: float):
    @functools.wraps(_real)
    def _slow(self, *args, **kwargs):
        time.sleep(seconds)
        return _real(self, *args, **kwargs)
    return _slow
