"""``python -m tests.hanging_job [overrides]``: the job of ``python -m jobs.generate``, with a pipeline that hangs
for ever on any batch holding a prompt with "hang" (what a GPU after an Xid error does): for the stall test."""

import functools
import logging
import sys
import time

from diffusers import FluxPipeline

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
