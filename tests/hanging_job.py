"""``python -m tests.hanging_job [overrides]``: the job of ``python -m jobs.generate``, with a pipeline that hangs
for ever on any batch holding a prompt with "hang" (what a GPU after an Xid error does): for the stall test."""

import functools
import logging
import os
import sys
import time

from diffusers import FluxPipeline

from engine.slurm import GenerateJob

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
    """``launcher=slurm``'s job, hanging like the above on attempts (SLURM restarts) below ``hang_attempts``."""

    def __init__(self, cfg_yaml: str, log_level: int = logging.INFO, hang_attempts: int = 1):
        super().__init__(cfg_yaml, log_level)
        self.hang_attempts = hang_attempts

    def __call__(self):
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < self.hang_attempts:
            FluxPipeline.__call__ = _call
        return super().__call__()
