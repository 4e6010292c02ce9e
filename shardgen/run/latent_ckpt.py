"""Mid-sample checkpoints (``latent_checkpoint_every=N``): a video batch that takes minutes survives a kill.

Every N denoising steps the pipeline's ``callback_on_step_end`` saves the batch's latents and the
scheduler's whole state (UniPC keeps the previous model outputs for its multistep update) durably to
``<run_dir>/latents/<first key>+<batch size>.pt``. When the same batch is generated again (a rerun after
a kill resumes at the first sample not yet durable in its shard, so batches are the same), the call
starts from the saved step: for that one call the scheduler's ``set_timesteps`` restores the saved
state and hands the pipeline's loop the remaining timesteps only (``set_begin_index``, which the Wan
and FLUX pipelines call right after reading them, puts the whole schedule back for ``step()``), and
``prepare_latents`` returns the saved latents unchanged
(the pipeline's own ``latents=`` argument would cast them to float32). The frames equal an
uninterrupted run's, bit for bit on CPU. A batch's file is removed when its call returns: a kill in the
second between that and the batch's tar checkpoint (the writer's encode and fsync) costs that batch's
steps again, never a wrong sample.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel import registry
from shardgen.config.schema import VideoConfig
from shardgen.dataio.rundir import RunDir, atomic_write_bytes
from shardgen.dataio.rundir.fileio import open_regular
from shardgen.dataio.shards import is_video
from shardgen.pick import pick

log = logging.getLogger("shardgen.latents")


@dataclass(frozen=True)
class LatentCheckpoints:
    """Where and how often one replica saves its batches' latents: every ``every`` steps, or (``every`` None)
    whenever ``interval_s`` of denoising passed since the batch's start or last save."""

    directory: Path
    every: int | None = None
    interval_s: float | None = None

    @classmethod
    def from_cfg(cls, cfg: Any, strategy: str | None = None) -> "LatentCheckpoints | None":
        """None when off: ``latent_checkpoint_every`` null, or ``auto`` for an image model, an image-to-video one or a
        strategy whose replica is more than one rank on one device (``strategy``: the one that runs, ``strategy=auto`` resolved)."""
        video, directory = pick(VideoConfig, cfg), RunDir.at(cfg.run_dir).latents_dir
        every = video.latent_checkpoint_every
        if every == "auto":
            kind = registry.find(strategy or cfg.strategy.name)
            one_gpu = kind is not None and kind.one_gpu_per_replica
            from shardgen.families import family_for

            plain = not family_for(cfg.model.pipeline).input_image  # image-to-video: its condition is not saved
            return cls(directory, interval_s=float(video.latent_checkpoint_s)) if is_video(cfg) and one_gpu and plain \
                else None
        return cls(directory, every=int(every)) if every else None

    def due(self, done: int, since_save_s: float) -> bool:
        """Whether to save after ``done`` completed steps, ``since_save_s`` after the call's start or last save."""
        return done % self.every == 0 if self.every else since_save_s >= self.interval_s

    def path(self, indices: list[int]) -> Path:
        return self.directory / f"{indices[0]:010d}+{len(indices)}.pt"

    def load(self, indices: list[int], steps: int) -> dict | None:
        """The saved state of exactly this batch of a ``steps``-step call, or None. The file is untrusted (a
        kill, a disk error or a person may have left anything there): whatever is not such a state is ignored
        with a warning, and the batch starts from step 0 (nothing is lost; its next save replaces the file)."""
        path = self.path(indices)
        if not path.exists() and not path.is_symlink():
            return None
        try:
            if path.is_symlink():
                raise ValueError("a symlink (never followed)")
            with open_regular(path, follow=False) as f:  # a FIFO there would block the load
                state = torch.load(f, map_location="cpu", weights_only=True)
            _check_state(state, indices, steps)
        except Exception as e:  # noqa: BLE001 (any unreadable or foreign content means: start the batch over)
            log.warning("ignoring latent checkpoint %s (%s: %s); the batch starts from step 0", path,
                        type(e).__name__, str(e)[:200])
            return None
        return state if state["indices"] == indices else None

    def save(self, indices: list[int], step: int, latents: torch.Tensor, scheduler: Any) -> None:
        """Write the state after ``step`` completed steps durably (temp file, fsync, rename)."""
        buf = io.BytesIO()
        torch.save(dict(indices=indices, step=step, latents=latents.detach().cpu(),
                        scheduler=_scheduler_state(scheduler)), buf)
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path(indices), buf.getvalue())

    def remove(self, indices: list[int]) -> None:
        self.path(indices).unlink(missing_ok=True)


def _check_state(state: Any, indices: list[int], steps: int) -> None:
    """Raise ValueError unless ``state`` is what ``save`` writes for a batch of ``len(indices)`` samples."""
    if not isinstance(state, dict) or not {"indices", "step", "latents", "scheduler"} <= state.keys():
        raise ValueError("not a latent checkpoint")
    if not isinstance(state["step"], int) or not 0 < state["step"] < steps:
        raise ValueError(f"step {state['step']!r} is not between 1 and {steps - 1}")
    if not isinstance(state["latents"], torch.Tensor) or not isinstance(state["scheduler"], dict):
        raise ValueError("its latents or scheduler state have the wrong type")
    if state["latents"].shape[:1] != (len(indices),):
        raise ValueError(f"latents of shape {tuple(state['latents'].shape)} for a batch of {len(indices)}")


def _scheduler_state(scheduler: Any) -> dict:
    """Every data attribute of the scheduler but its config (not our per-call wrappers), tensors moved to the CPU."""
    def cpu(v):
        if isinstance(v, torch.Tensor):
            return v.detach().cpu().clone()
        if isinstance(v, (list, tuple)):
            return type(v)(cpu(x) for x in v)
        return v
    return {k: cpu(v) for k, v in vars(scheduler).items() if k != "_internal_dict" and not callable(v)}


def _to(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, (list, tuple)):
        return type(v)(_to(x, device) for x in v)
    return v


@contextlib.contextmanager
def latent_checkpoints(pipe: Any, ckpt: LatentCheckpoints | None, indices: list[int], kw: dict, steps: int):
    """Around one pipeline call of the batch ``indices``: save every ``ckpt.every`` steps, and resume from
    a saved step (logging it). ``kw`` (the call's keyword arguments) gains the step callback."""
    if ckpt is None:
        yield
        return
    with _saving_and_resuming(pipe, ckpt, indices, kw, steps):
        yield
    ckpt.remove(indices)  # only after a call that returned: its samples go to the writer now


@contextlib.contextmanager
def _saving_and_resuming(pipe: Any, ckpt: LatentCheckpoints, indices: list[int], kw: dict, steps: int):
    state = ckpt.load(indices, steps)
    start = state["step"] if state else 0
    last_save = [time.monotonic()]

    def on_step_end(p, i, t, tensors):
        done = start + i + 1
        if done < steps and ckpt.due(done, time.monotonic() - last_save[0]):
            ckpt.save(indices, done, tensors["latents"], p.scheduler)
            last_save[0] = time.monotonic()
        return {}

    kw.update(callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])
    if state is None:
        yield
        return
    log.info("samples %d..%d: resuming from step %d of %d (latent checkpoint %s)", indices[0], indices[-1], start,
             steps, ckpt.path(indices).name)
    with _resumed(pipe, state):
        yield


@contextlib.contextmanager
def _resumed(pipe: Any, state: dict):
    """For one call: ``set_timesteps`` restores the saved scheduler and skips the finished steps;
    ``prepare_latents`` returns the saved latents. Both are instance attributes, removed afterwards."""
    scheduler, device = pipe.scheduler, pipe._execution_device
    set_timesteps, set_begin_index = scheduler.set_timesteps, scheduler.set_begin_index

    def restored_set_timesteps(*args, **kwargs):
        set_timesteps(*args, **kwargs)
        vars(scheduler).update({k: _to(v, device) for k, v in state["scheduler"].items()})
        scheduler.timesteps = scheduler.timesteps[state["step"]:]  # what the pipeline's loop reads next

    def full_timesteps_again(*args, **kwargs):  # called after that read: step() needs the whole schedule
        set_begin_index(*args, **kwargs)
        scheduler.timesteps = _to(state["scheduler"]["timesteps"], device)

    scheduler.set_timesteps, scheduler.set_begin_index = restored_set_timesteps, full_timesteps_again
    pipe.prepare_latents = lambda *args, **kwargs: state["latents"].to(device)
    try:
        yield
    finally:
        del scheduler.set_timesteps, scheduler.set_begin_index, pipe.prepare_latents
