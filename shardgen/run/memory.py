"""GPU out-of-memory, wherever it strikes (loading, fp8 conversion, denoising, decoding), as one line that says what
to change. A CUDA OOM is the user's to fix (a batch, a size, a model too large for one GPU), so it ends the job as a
``UserError``: printed without a traceback, never retried by a requeue. Samples already committed stay; the same
command with the change continues the run."""

from __future__ import annotations

from typing import Any

import torch

from shardgen.errors import UserError


class GpuOutOfMemory(UserError, RuntimeError):
    """The GPU ran out of memory; the message names the settings that need less of it."""


def cuda_oom(e: BaseException | None) -> BaseException | None:
    """The ``torch.OutOfMemoryError`` that ``e`` is or was raised from (a worker thread's error re-raised wrapped),
    else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError):
            return e
        e = e.__cause__ or e.__context__
    return None


def torch_summary(e: BaseException) -> str:
    """The first sentences of torch's OOM message (how much was asked, how much is free): the rest is allocator
    advice that does not apply to inference."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(" Including non-PyTorch memory")[0].split(" Of the allocated memory")[0].rstrip(". ")


def advice(cfg: Any, batch: int | None = None) -> str:
    """What to change, in the order a user should try it: a smaller batch, float8 weights, more GPUs, a smaller
    size. The batch advice names the configured ``batch_size`` and half of it; ``batch``, the size of the batch that
    ran out, can be smaller (a shard's last samples), and then it is named too, and halved where half the configured
    size would not make that batch smaller."""
    configured = int(cfg.batch_size)
    failed = int(batch or configured)
    out = []
    if min(configured, failed) > 1:
        half = configured // 2 if failed > configured // 2 else failed // 2
        held = f"; the batch that ran out held {failed}" if failed != configured else ""
        out.append(f"batch_size={max(1, half)} (now {configured}{held})")
    if not cfg.fp8:
        out.append("fp8=true (float8 transformer weights: about half their memory; lossy, so start a new run_dir)")
    if not _spreads_over_gpus(cfg.strategy.name):
        out.append("strategy=device_map (the model spread over several GPUs, encoders offloaded when they do not fit)")
    out.append(f"a smaller height/width (now {cfg.height}x{cfg.width})")
    return "; or ".join(out)


def _spreads_over_gpus(strategy: str) -> bool:
    """Whether the strategy already spreads one model over several GPUs of a process (device_map)."""
    from parallel import registry

    found = registry.find(strategy)  # None for strategy=auto (resolved elsewhere): the advice names device_map
    return bool(found is not None and found.spans_gpus_in_one_process)


def out_of_memory(cfg: Any, e: BaseException, during: str, batch: int | None = None) -> GpuOutOfMemory:
    """The one-line error for a CUDA OOM ``e`` raised ``during`` (e.g. "generating a batch of 4")."""
    return GpuOutOfMemory(
        f"the GPU ran out of memory {during} ({torch_summary(e)}). Set {advice(cfg, batch)}. Samples already made are "
        f"kept: the same command with the change continues {cfg.run_dir}.")
