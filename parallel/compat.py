"""The diffusers patches that tensor/context parallelism needs on a CPU-only machine (gloo), and nothing else.

diffusers 0.42 assumes an accelerator whenever a ``parallel_config`` is applied:

1. ``ModelMixin._resolve_parallel_config`` computes ``rank % torch.accelerator.device_count()``, and the
   count is 0 on a CPU-only machine (ZeroDivisionError).
2. ``hooks.tensor_parallel.apply_tensor_parallel`` refuses a mesh whose device type is not in
   ``_SUPPORTED_TP_DEVICES`` (cuda, neuron, tpu, xpu): "cpu" is missing, although torch's DTensor
   runs there under gloo.

Both are used only while the config is applied (``from_pretrained(parallel_config=...)`` or
``enable_parallelism``), so the patches live in a context manager around those calls, are applied
only when needed (a CPU mesh on a machine with no accelerator), and only for the diffusers versions
they were written for. ``tests/test_strategies.py`` asserts the unpatched behaviour still exists, so
it fails loudly the day a patch is no longer needed.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from shardgen.errors import UserError

log = logging.getLogger("shardgen.compat")
PATCHED_VERSIONS = ("0.42.",)
"""diffusers versions (prefixes) the patches were written and tested for."""


class CompatError(UserError, RuntimeError):
    """The installed diffusers is not one the CPU patches were checked against."""


def _check_version() -> None:
    import diffusers

    if not diffusers.__version__.startswith(PATCHED_VERSIONS):
        raise CompatError(
            f"tensor/context parallelism on CPU patches diffusers, and parallel/compat.py was written for diffusers "
            f"{' / '.join(v + 'x' for v in PATCHED_VERSIONS)}, not {diffusers.__version__}. Run "
            "`pytest tests/test_strategies.py -k compat` to see which patches are still needed and update "
            "PATCHED_VERSIONS, or run tp/cp on GPUs.")


def needs_device_count_patch(device: torch.device) -> bool:
    """Patch 1 is needed when diffusers would divide by a device count of 0."""
    return device.type == "cpu" and torch.accelerator.device_count() == 0


def needs_tp_device_patch(device: torch.device) -> bool:
    """Patch 2 is needed when the TP mesh is a CPU one and diffusers does not list "cpu"."""
    from diffusers.hooks import tensor_parallel

    return device.type == "cpu" and "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES


@contextlib.contextmanager
def parallel_patches(device: torch.device, *, tensor_parallel: bool = False) -> Iterator[list[str]]:
    """Around applying a ``parallel_config`` on ``device``: the patches this machine needs, undone after.

    Yields the names of the patches applied (empty on GPUs).
    """
    patch_count = needs_device_count_patch(device)
    patch_tp = tensor_parallel and needs_tp_device_patch(device)
    if not (patch_count or patch_tp):
        yield []
        return
    _check_version()
    from diffusers.hooks import tensor_parallel as tpmod

    applied = []
    old_count, old_devices = torch.accelerator.device_count, tpmod._SUPPORTED_TP_DEVICES
    try:
        if patch_count:
            # one "device" per rank: diffusers then places everything on cpu:0, i.e. the CPU
            torch.accelerator.device_count = lambda: 1
            applied.append("torch.accelerator.device_count() = 1 while the parallel config is applied")
        if patch_tp:
            tpmod._SUPPORTED_TP_DEVICES = old_devices + ("cpu",)
            applied.append('"cpu" added to diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES')
        for line in applied:
            log.debug("CPU compatibility patch: %s", line)
        yield applied
    finally:
        torch.accelerator.device_count = old_count
        tpmod._SUPPORTED_TP_DEVICES = old_devices
