"""One batch of prompts through the pipeline: per-sample generators, per-sample failures."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from parallel import registry
from shardgen.dataio.prompts import PlannedRow
from shardgen.dataio.shards import Sample
from shardgen.run.latent_ckpt import LatentCheckpoints, latent_checkpoints
from shardgen.run.memory import cuda_oom
from shardgen.speed import accel
from shardgen.speed.accel import AccelOptions
from shardgen.errors import JobEndingError, ends_job, is_user_error
from shardgen.models import condition, lora
from shardgen.families import family_for
from shardgen.pick import pick

log = logging.getLogger("shardgen.generation")

@dataclass(frozen=True)
class GenSettings:
    """What every pipeline call of a run shares."""

    height: int
    width: int
    steps: int
    guidance: float
    true_cfg_scale: float
    negative_prompt: str | None
    max_sequence_length: int
    model: str
    strategy: str
    num_frames: int | None = None
    """Video models: frames per sample (None: an image model)."""
    guidance_2: float | None = None
    """Wan 2.2 A14B: guidance of the low-noise expert."""
    latents: LatentCheckpoints | None = None
    """Mid-sample checkpoints every N steps (shardgen/run/latent_ckpt.py); None = off."""
    accel: AccelOptions = AccelOptions()
    """Speed options (shardgen/speed/accel.py), applied to the pipeline before its first call."""
    batch_size: int = 1
    """The run's batch size: a compiled pipeline gets every call padded to it (``padded``)."""
    compile_auto: bool = False
    """``compile: auto`` where compiling is possible: each process decides whether it pays
    (shardgen/speed/autocompile.py); ``accel.compile`` is then that decision, batch by batch."""
    tuning_auto: bool = False
    """``compile_tuning: auto`` under ``compile: auto``: the process chooses whether its compiled kernels are tuned
    (``accel.compile_tuning`` is then that choice)."""
    loras: tuple = ()
    """The LoRA adapters fused for the call (shardgen/models/lora.py: ``Lora``s, in fusing order)."""
    strength: float | None = None
    """Image-to-image: how far a sample may go from its input image (``model.strength``, or the row's); None: the
    model takes no strength."""
    input_image: str = ""
    """Whether the pipeline takes an input image per sample: "", "optional", "required" (its family's)."""
    image_per_call: bool = False
    """The pipeline conditions a whole call on one input image: rows are batched by image."""
    image_in_sequence: bool = False
    """The input image's tokens join the sample's in attention (``ModelFamily.image_in_sequence``)."""
    input_image_area: int = 0
    """The pixel area the pipeline resizes an input image to (its family's); 0: the sample's size."""

    @classmethod
    def from_cfg(cls, cfg: Any, strategy: str | None = None) -> "GenSettings":
        """The settings of ``cfg``; ``strategy``: the one that runs when the config says ``auto`` (it decides
        ``compile: auto`` too)."""
        strategy = strategy or cfg.strategy.name
        kind = registry.find(strategy)  # None: auto, before it is resolved
        opts = AccelOptions.from_cfg(cfg, kind is not None and kind.one_gpu_per_replica)
        fam = family_for(cfg.model.pipeline)
        # every other field is the key of its name: the run's (height, steps, num_frames, ...), else the model's
        # (true_cfg_scale, max_sequence_length, ...): shardgen/pick.py
        return pick(cls, cfg, cfg.model, model=cfg.model.name, strategy=strategy, accel=opts,
                    compile_auto=(auto := opts.compile and str(cfg.compile).lower() == "auto"),
                    tuning_auto=auto and str(cfg.compile_tuning).lower() == "auto",
                    latents=LatentCheckpoints.from_cfg(cfg, strategy), loras=lora.run_set(cfg),
                    input_image=fam.input_image, image_per_call=fam.image_per_call,
                    image_in_sequence=fam.image_in_sequence,
                    input_image_area=fam.input_image_area,
                    strength=float(cfg.model.strength) if fam.strength else None)


# the settings a row may set that are one value per pipeline call (negative_prompt is per sample)
CALL_SETTINGS = ("height", "width", "num_frames", "guidance", "true_cfg_scale", "steps", "loras", "strength")


def settings_for(s: GenSettings, row: PlannedRow) -> GenSettings:
    """The run's settings with those ``row`` sets itself (``prompts.row_settings``)."""
    own = {k: row.settings[k] for k in CALL_SETTINGS if k in row.settings}
    return dataclasses.replace(s, **own) if own else s


def call_key(s: GenSettings, row: PlannedRow) -> tuple:
    """What a pipeline call takes once for all its samples, for ``row`` (its own settings, else the run's): rows
    of equal keys can share a call. negative_prompt is per sample (a list), so not part of it."""
    own = settings_for(s, row)
    image = row.settings.get("image")
    # one input image per call: batched by it; an optional one: rows with and without one in separate calls
    by_image = (image,) if s.image_per_call else (image is not None,) if s.input_image == "optional" else ()
    return tuple(getattr(own, k) for k in CALL_SETTINGS) + by_image


def by_call(s: GenSettings, rows: list[PlannedRow]) -> list[list[PlannedRow]]:
    """``rows`` grouped by ``call_key``, the groups in the order of their first row, each in row order: rows of
    one group can be generated in one call."""
    groups: dict[tuple, list[PlannedRow]] = {}
    for r in rows:
        groups.setdefault(call_key(s, r), []).append(r)
    return list(groups.values())


def shape_batches(s: GenSettings, rows: list[PlannedRow], batch_size: int) -> list[list[int]]:
    """The batches ``rows`` (a shard's rows still to make) are generated in, as positions in ``rows``: each batch
    is the first row not yet in one, with the next rows of its ``call_key`` up to ``batch_size``. Batches
    stay full however the shapes mix, and the earliest unmade row is always in the next batch, so the samples
    can be written in row order (the shard's n_done, resume) with a bounded look-ahead. A run whose rows set
    no size or guidance gets consecutive slices of ``batch_size``, as without row settings."""
    queues: dict[tuple, deque] = {}
    for i, r in enumerate(rows):
        queues.setdefault(call_key(s, r), deque()).append(i)
    taken, batches = [False] * len(rows), []
    for i, r in enumerate(rows):
        if taken[i]:
            continue
        q = queues[call_key(s, r)]  # its head is i: the key's earlier rows are taken
        batch = [q.popleft() for _ in range(min(batch_size, len(q)))]
        for j in batch:
            taken[j] = True
        batches.append(batch)
    return batches


def pipeline_kwargs(pipe: Any, s: GenSettings, prompts: list[str], seeds: list[int],
                    negative_prompts: list[str | None] | None = None, images: list | None = None) -> dict:
    """Keyword arguments for ``pipe(...)``: only those its signature accepts; ``negative_prompts``: each
    sample's (None: ``s.negative_prompt``), used with true CFG; ``images``: each sample's input image (PIL, fitted
    to the call's size; a pipeline conditioning a whole call on one image gets the first).

    Generators live on the CPU: the initial noise of a seed is then the same on every device.
    """
    params = inspect.signature(pipe.__call__).parameters
    kw = dict(prompt=prompts, height=s.height, width=s.width, num_inference_steps=s.steps,
              generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds], output_type="pt")
    if "guidance_scale" in params:
        kw["guidance_scale"] = s.guidance
    if "max_sequence_length" in params:
        kw["max_sequence_length"] = s.max_sequence_length
    if s.num_frames is not None and "num_frames" in params:
        kw["num_frames"] = s.num_frames
    if s.guidance_2 is not None and "guidance_scale_2" in params:
        kw["guidance_scale_2"] = s.guidance_2
    if images and "image" in params:
        kw["image"] = images[0] if s.image_per_call else images
        if s.strength is not None and "strength" in params:
            kw["strength"] = s.strength
        if "_auto_resize" in params:  # Kontext: the image is fitted to the sample's size already
            kw["_auto_resize"] = False
    if "max_area" in params:  # Kontext: the sample's own size, not its 1024x1024 default's area
        kw["max_area"] = s.height * s.width
    if s.true_cfg_scale > 1.0 and "true_cfg_scale" in params:
        kw["true_cfg_scale"] = s.true_cfg_scale
        negatives = negative_prompts or [None] * len(prompts)
        kw["negative_prompt"] = [(n if n is not None else s.negative_prompt) or " " for n in negatives]
    return kw


def to_pixels(images: torch.Tensor) -> tuple[list[bool], Any]:
    """(finite flag per sample, NxHxWx3 uint8 array) from the pipeline's [0, 1] float output
    (NxCxHxW images; NxFxCxHxW videos give NxFxHxWx3).

    Rounding matches diffusers' ``numpy_to_pil``. On a GPU the uint8 pixels and the flags are copied
    asynchronously into pinned host memory and the host waits once, on that copy: the batch's only
    synchronisation (the denoising loop itself has none).
    """
    finite = torch.isfinite(images).flatten(1).all(dim=1)
    # in float32 like numpy_to_pil: x * 255 in bf16 would round again before .round()
    pixels = (images.float().nan_to_num(0.0) * 255).round().clamp(0, 255).to(torch.uint8).movedim(-3, -1)
    if pixels.device.type != "cuda":
        return finite.cpu().tolist(), pixels.cpu().numpy()
    host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(pixels, non_blocking=True)
    flags = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
    flags.copy_(finite, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(pixels.device))
    done.synchronize()
    return flags.tolist(), host.numpy()


def _meta(row: PlannedRow, s: GenSettings, cond: condition.Conditioned | None = None) -> dict:
    meta = dict(row.extra)  # input columns first, so our own fields win on a name clash
    meta.update(prompt=row.prompt, index=row.index, line=row.line, seed=row.seed, model=s.model, height=s.height,
                width=s.width, steps=s.steps, guidance=s.guidance, strategy=s.strategy)
    if row.image is not None:  # images_per_prompt > 1: which prompt, which of its images
        meta.update(prompt_index=row.prompt_index, image=row.image)
    if s.true_cfg_scale > 1.0:
        meta["true_cfg_scale"] = s.true_cfg_scale
    if s.guidance_2 is not None:
        meta["guidance_2"] = s.guidance_2
    if s.accel.lossy:
        meta["lossy"] = s.accel.lossy
    if s.loras:
        meta["loras"] = [lo.as_json() for lo in s.loras]
    if "image" in row.settings:  # the input image's content (its sha256) is what made the sample
        image = row.settings["image"]
        meta["input_image"] = cond.as_json(image.ref) if cond is not None else dict(path=image.ref)
        if s.strength is not None:
            meta["strength"] = s.strength
    # the row's own settings not written above (its size and guidance are, from ``settings_for``)
    meta.update({k: row.settings[k] for k in ("negative_prompt", "aspect_ratio") if k in row.settings})
    return meta


class BatchOutOfMemory(JobEndingError, RuntimeError):
    """A batch ran out of GPU memory (``__cause__``: torch's error); ``during`` says which batch, ``batch`` its
    size. The runner turns it into the one-line ``GpuOutOfMemory`` (shardgen/run/memory.py)."""

    def __init__(self, during: str, batch: int = 0):
        super().__init__(during)
        self.during, self.batch = during, batch


class ReplicaBatchError(JobEndingError, RuntimeError):
    """A batch failed on one rank of a model-parallel replica: the job must stop (see ``run_pipeline``)."""


def padded(rows: list[PlannedRow], s: GenSettings) -> list[PlannedRow]:
    """``rows`` filled up to the run's batch size with copies of the last row when the transformer is
    compiled: a short batch (the run's last, a resumed or repaired shard, one with rejects) then has the
    shape of every other batch, so it reuses the compiled graphs instead of compiling new ones (16-40 s
    on an H200, more than the few extra images cost). Each sample has its own generator, so the real rows'
    pixels do not depend on the copies; the copies' outputs are dropped."""
    if not s.accel.compile or not rows or len(rows) >= s.batch_size:
        return rows
    return rows + [rows[-1]] * (s.batch_size - len(rows))


def run_pipeline(pipe: Any, s: GenSettings, rows: list[PlannedRow], replica_ranks: int = 1,
                 conds: dict[int, condition.Conditioned] | None = None) -> list[Sample]:
    """Generate ``rows`` (all valid, of one ``by_call`` group: ``s`` is ``settings_for`` them) in one call; on an
    exception, retry one by one so only the samples that fail on their own are recorded as failed. ``conds``: the
    rows' input images by row index (``load_images``).

    ``replica_ranks`` > 1 (tp/cp): the replica's ranks compute every batch together, each inside the
    others' collectives, so one rank cannot retry alone: its peers would wait forever in a collective
    it left (or match it with the wrong one). Its error ends the job instead; a rerun continues."""
    lora.activate(pipe, s.loras)  # outside the try, like accel: a setup error is the job's, not the samples'
    accel.prepare(pipe, s.accel)
    conds = conds or {}  # a call's rows all have an input image or none have (``call_key``)
    try:
        call = padded(rows, s)
        joined = input_size(s) if s.image_in_sequence and call[0].index in conds else None  # the input's tokens
        shape = accel.attention_shape(pipe, s.height, s.width, len(call), s.max_sequence_length, joined,
                                      s.num_frames)
        kw = pipeline_kwargs(pipe, s, [r.prompt for r in call], [r.seed for r in call],
                             [r.settings.get("negative_prompt") for r in call],
                             [conds[r.index].image for r in call] if call[0].index in conds else None)
        with accel.sdpa_context(pipe, s.accel, shape), \
                latent_checkpoints(pipe, s.latents, [r.index for r in call], kw, s.steps):  # latent_checkpoint_every
            out = pipe(**kw)
        finite, pixels = to_pixels(out.frames if hasattr(out, "frames") else out.images)  # video pipelines: frames
        finite, pixels = finite[:len(rows)], pixels[:len(rows)]
    except Exception as e:
        if ends_job(e) or is_user_error(e):  # e.g. submitit ending a timed-out job, or a setup the user must change
            raise
        if cuda_oom(e) is not None:  # every batch of these settings would fail alike: the settings must change
            raise BatchOutOfMemory(f"generating a batch of {len(call)} at {s.height}x{s.width}", len(call)) from e
        if replica_ranks > 1:
            raise ReplicaBatchError(
                f"a batch of {len(rows)} failed on this rank of a {replica_ranks}-rank model-parallel replica "
                f"({type(e).__name__}: {e}). Its ranks compute together, so it cannot be retried on one rank: the job "
                "stops here. Re-run the same command to continue from the last durable batch (if the error is "
                "out of memory, lower batch_size).") from e
        if len(rows) == 1:
            return [Sample(key=rows[0].key, index=rows[0].index, prompt=rows[0].prompt,
                           meta=_meta(rows[0], s, conds.get(rows[0].index)),
                           status="failed", failure=f"exception: {type(e).__name__}: {e}")]
        log.warning("batch of %d failed (%s: %s); retrying its samples one by one", len(rows), type(e).__name__, e)
        return [sample for r in rows for sample in run_pipeline(pipe, s, [r], conds=conds)]
    samples = []
    for r, ok, px in zip(rows, finite, pixels):
        meta = _meta(r, s, conds.get(r.index))
        if ok:
            samples.append(Sample(key=r.key, index=r.index, prompt=r.prompt, meta=meta, pixels=px))
        else:
            samples.append(Sample(key=r.key, index=r.index, prompt=r.prompt, meta=meta, status="failed",
                                  failure="nonfinite: NaN or inf in the decoded image"))
    return samples


def generate_batch(pipe: Any, s: GenSettings, rows: list[PlannedRow], replica_ranks: int = 1,
                   images: tuple[dict, dict] | None = None) -> list[Sample]:
    """Samples for ``rows`` in index order: rejected rows become rejects without touching the GPU. Rows with
    their own size or guidance (``prompts.row_settings``) go in one call per ``by_call`` group; each sample has
    its own generator, so its pixels do not depend on the rows it was batched with. ``images``: ``load_images``
    of the rows already (``ImagePrefetch``); None: loaded here."""
    conds, bad = images if images is not None else load_images(s, [r for r in rows if r.reject is None])
    valid = [r for r in rows if r.reject is None and r.index not in bad]
    made = {smp.index: smp for group in by_call(s, valid)
            for smp in run_pipeline(pipe, settings_for(s, group[0]), group, replica_ranks, conds)}
    out = []
    for r in rows:
        status, why = ("rejected", f"rejected: {r.reject}") if r.reject is not None else bad.get(r.index, (None, None))
        if status is not None:
            out.append(Sample(key=r.key, index=r.index, prompt=r.prompt, meta=_meta(r, s), status=status, failure=why))
        else:
            out.append(made[r.index])
    return out


def input_size(s: GenSettings) -> tuple[int, int]:
    """The (width, height) an input image is fitted to: the sample's, or the pipeline's own resizing of an image of
    the sample's aspect ratio (``input_image_area``: an image given at that size is not resized again, and the
    pipeline's text encoder, which sees the images of a list as given, sees what it sees of a single image)."""
    return condition.input_size(s.width, s.height, s.input_image_area)


def load_images(s: GenSettings, rows: list[PlannedRow]
                ) -> tuple[dict[int, condition.Conditioned], dict[int, tuple[str, str]]]:
    """The input images of ``rows`` (prompts.row_settings=[image]), each decoded and fitted to its row's size, by row
    index; and (status, reason) of each row whose image cannot be used (or which has none for a model that needs
    one): rejected, or failed where the file planning accepted is gone or unreadable now; the others generated."""
    conds, bad = {}, {}
    for r in rows:
        image = r.settings.get("image")
        if image is None:
            if s.input_image == "required":
                bad[r.index] = ("rejected", "rejected: image: this model makes each sample from an input image, and "
                                            "the row names none")
            continue
        try:
            conds[r.index] = condition.load(image, *input_size(settings_for(s, r)))
        except condition.ImageGone as e:  # accepted when planned: may pass, so a failure retry_failed makes again
            bad[r.index] = ("failed", f"image: {e}")
            log.warning("line %d: image: %s; the row fails", r.line, e)
        except condition.BadImage as e:
            bad[r.index] = ("rejected", f"rejected: image: {e}")
            log.warning("line %d: image: %s; the row is rejected", r.line, e)
    return conds, bad


class ImagePrefetch:
    """The next batch's input images decoded on a thread while the current batch is generated (PIL releases the
    GIL while it decodes), so after the first batch a GPU waits for no decode; a no-op for models taking none."""

    def __init__(self, takes_images: bool):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardgen-images") if takes_images else None
        self._pending: tuple | None = None  # (the rows' indices, the future of their load_images)

    def ahead(self, s: GenSettings, rows: list[PlannedRow]) -> None:
        """Start loading the input images of ``rows`` (the next batch)."""
        if self._pool is not None and rows:
            valid = [r for r in rows if r.reject is None]
            self._pending = (tuple(r.index for r in rows), self._pool.submit(load_images, s, valid))

    def take(self, rows: list[PlannedRow]) -> tuple[dict, dict] | None:
        """``load_images`` of ``rows`` when they are the batch loaded ahead (waiting for it), else None."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != tuple(r.index for r in rows):
            return None
        return pending[1].result()

    def close(self) -> None:
        """Stop the thread (a load under way finishes; its result is dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
