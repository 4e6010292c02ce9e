"""Context parallel (Ulysses, Ring, unified): every rank of a replica holds the whole pipeline and
the transformer splits each sequence (image and text tokens) over the replica's ``ring x ulysses`` ranks.

Ulysses exchanges heads with an all-to-all (heads must divide by its degree unless
``ulysses_anything``); Ring passes K/V around and merges partial results with their log-sum-exp, so
it needs an attention backend that returns it. Applied with ``transformer.enable_parallelism`` and
``ContextParallelConfig(ring_degree, ulysses_degree, ulysses_anything, ring_anything, mesh=...)``.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

from parallel.compat import parallel_patches
from parallel.dims import ParallelDims, divisors
from parallel.registry import Strategy, fail, register
from parallel.attention import LSE_BACKENDS, backend_name_problem, default_attention_backend
from parallel.transformer import HALF_DTYPES, SequenceShape
from shardgen.models import lora
from shardgen.models.loader import load_pipeline, torch_dtype

if TYPE_CHECKING:
    from parallel.strategies import DeviceFacts
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.cp")
ULYSSES, RING, UNIFIED = "cp_ulysses", "cp_ring", "cp_unified"

class ContextParallel(Strategy):
    """The replica's ``ring x ulysses`` ranks split each sequence; every rank holds the whole pipeline."""

    context_parallel = True

    def replica_dims(self, dims: ParallelDims) -> tuple[tuple[str, int], ...]:
        return (("ring", dims.ring), ("ulysses", dims.ulysses))

    def check_degrees(self, dims: ParallelDims) -> None:
        self.refuse_combined(dims, "set tp_degree=1 (or use strategy=tp)")

    def check_model(self, dims: ParallelDims, cfg: GenerateConfig, info_fn) -> None:
        info = info_fn(cfg.model)
        if info.plan("cp") is None:
            fail(f"strategy={dims.strategy}: {info.cls_name} has no _cp_plan in this diffusers, so its sequence "
                 "cannot be split; use strategy=tp or device_map")
        if dims.ulysses > 1 and info.heads and info.heads % dims.ulysses and not dims.ulysses_anything:
            fail(f"ulysses_degree={dims.ulysses} does not divide the {info.heads} attention heads of {info.cls_name} "
                 f"(from {info.source}); use one of {divisors(info.heads)}, or strategy.ulysses_anything=true")

    def attention_backend(self, dims: ParallelDims, facts: DeviceFacts, dtype: str) -> str:
        """The configured backend or the device's default, checked against what splitting a sequence needs."""
        return _check_attention(dims, facts, dtype)

    def check_sequence(self, dims: ParallelDims, sequence: SequenceShape, facts: DeviceFacts) -> None:
        _check_sequence(dims, sequence, facts)

    def check_rows(self, dims: ParallelDims, sequence: SequenceShape, shapes: dict, device_type: str) -> None:
        _check_rows(dims, sequence, shapes, device_type)

    def apply(self, cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
        return apply(cfg, world, dims)


@register
class Ulysses(ContextParallel):
    """Ulysses: an all-to-all over heads."""

    name = ULYSSES

    def check_degrees(self, dims: ParallelDims) -> None:
        super().check_degrees(dims)
        if dims.ulysses < 2 or dims.ring != 1:
            fail(f"strategy=cp_ulysses needs ulysses_degree >= 2 and ring_degree=1 (got {dims.ulysses}/{dims.ring}); "
                 "e.g. strategy=cp_ulysses ulysses_degree=2, or strategy=cp_unified for both")


@register
class Ring(ContextParallel):
    """Ring attention: K/V passed around, partial results merged with their log-sum-exp."""

    name = RING

    def check_degrees(self, dims: ParallelDims) -> None:
        super().check_degrees(dims)
        if dims.ring < 2 or dims.ulysses != 1:
            fail(f"strategy=cp_ring needs ring_degree >= 2 and ulysses_degree=1 (got {dims.ring}/{dims.ulysses}); "
                 "e.g. strategy=cp_ring ring_degree=2, or strategy=cp_unified for both")


@register
class Unified(ContextParallel):
    """Ulysses inside, Ring across."""

    name = UNIFIED

    def check_degrees(self, dims: ParallelDims) -> None:
        super().check_degrees(dims)
        if dims.ulysses * dims.ring < 2:
            fail("strategy=cp_unified needs ring_degree x ulysses_degree >= 2; e.g. ring_degree=2 ulysses_degree=2")


def cp_config(dims: ParallelDims):
    """The diffusers config over the replica's ring x ulysses sub-mesh."""
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ring_degree=dims.ring, ulysses_degree=dims.ulysses, mesh=dims.mesh("cp"),
                                 ulysses_anything=dims.ulysses_anything, ring_anything=dims.ring_anything)


def enable(transformer: Any, dims: ParallelDims, device: torch.device) -> None:
    """Set the attention backend, then make ``transformer`` context-parallel over the replica."""
    transformer.set_attention_backend(dims.attention_backend)
    # diffusers 0.42's CP gather calls a torch collective that torch 2.13 deprecates: once per rank, not ours to fix
    warnings.filterwarnings("ignore", message=r".*all_gather_tensor.*deprecated", category=FutureWarning)
    with parallel_patches(device):
        transformer.enable_parallelism(config=cp_config(dims))


def apply(cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
    """The whole pipeline on this rank's device, with the run's LoRA adapters, its transformer context-parallel."""
    pipe = lora.apply(load_pipeline(cfg.model, torch_dtype(cfg.dtype), world.device), cfg)
    enable(pipe.transformer, dims, world.device)
    extra = " (anything)" if dims.ulysses_anything or dims.ring_anything else ""
    log.info("context parallel: ulysses %d x ring %d%s, attention backend %s", dims.ulysses, dims.ring, extra,
             dims.attention_backend)
    return pipe


def _check_attention(dims: ParallelDims, facts: DeviceFacts, dtype: str) -> str:
    """The attention backend for a CP replica (configured, or the device's default), checked; returns it."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    needs_lse = dims.ring > 1
    name = dims.attention_backend or default_attention_backend(facts.type, needs_lse)
    if problem := backend_name_problem(name):
        fail(problem)
    cp_ok = sorted(_AttentionBackendRegistry._supports_context_parallel)
    if name not in cp_ok:
        fail(f"strategy.attention_backend={name!r} does not support context parallelism; use one of {cp_ok}")
    what = "ring attention" if dims.strategy == RING else f"strategy={dims.strategy} with ring_degree={dims.ring}"
    if needs_lse and name not in LSE_BACKENDS:
        if facts.type != "cuda":
            fail(f"{what} needs an attention backend that returns the log-sum-exp (LSE) to merge the ring's partial "
                  f"results, and on CPU none does (native SDPA refuses return_lse); use strategy=cp_ulysses on CPU, "
                  "or run ring attention on CUDA GPUs")
        fail(f"{what} needs an attention backend that returns the log-sum-exp (LSE); {name!r} does not. Set "
              f"strategy.attention_backend to one of {sorted(LSE_BACKENDS)} (default _native_cudnn)")
    if name in LSE_BACKENDS:
        if facts.type != "cuda":
            fail(f"strategy.attention_backend={name} is a CUDA kernel and {facts.where} has no CUDA GPU; use native "
                  "on CPU")
        if dtype not in HALF_DTYPES:
            fail(f"strategy.attention_backend={name} runs bfloat16/float16 only, and dtype={dtype}; set "
                  "dtype=bfloat16" + (" (ring attention needs such a backend)" if needs_lse else
                                      " or strategy.attention_backend=native"))
    return name


def _check_sequence(dims: ParallelDims, sequence: SequenceShape, facts: DeviceFacts) -> None:
    """Each sequence the transformer splits (image tokens, text tokens) divides by the CP degree, unless an
    anything-variant is on; those split unevenly only on GPUs (gloo cannot all-gather pieces of unequal size)."""
    n = dims.ulysses * dims.ring
    image_rule = _image_rule(sequence)
    # an edit model's input image joins the sequence that is split
    sequences = [("image", tokens, image_rule) if tokens == sequence.image else
                 ("image + input image", tokens, f"{image_rule} + {_input_rule(sequence)}")
                 for tokens in sequence.split] + [("text", sequence.text, "model.max_sequence_length")]
    anything = dims.ulysses_anything or dims.ring_anything
    variant = "strategy.ulysses_anything=true" if dims.ring == 1 else \
        "strategy.ring_anything=true" if dims.ulysses == 1 else None
    fix = f", or {variant}" if variant and facts.type == "cuda" else ""
    for what, tokens, rule in sequences:
        if tokens is None and not anything:
            fail(f"{sequence.pipeline} gives each batch a text length of its own, which a CP degree of {n} need not "
                  f"divide; set {variant or 'ulysses_degree or ring_degree to 1 and its anything-variant'} (on GPUs)")
        if tokens is None or tokens % n == 0:
            continue
        if anything and facts.type != "cuda":
            fail(f"{what} tokens = {tokens} ({rule}) do not divide by the CP degree {n}: the "
                  "anything-variants split them unevenly, which needs NCCL (gloo cannot all-gather pieces of unequal "
                  f"size), and {facts.where} has no CUDA GPU; use sizes that divide by {n}")
        if anything and tokens < n:
            fail(f"{tokens} {what} tokens cannot be split over {n} ranks; use a smaller CP degree")
        if not anything:
            family = sequence.family
            frames = "latent frames x " if family.is_video else ""
            p = family.latent_patch
            hint = {"image": f"num_frames/height/width giving {frames}(H/{p})*(W/{p}) divisible by {n}",
                    "text": f"model.max_sequence_length divisible by {n}"}.get(
                what, f"height/width whose tokens and the input image's add up to a multiple of {n}")
            fail(f"{what} tokens = {tokens} ({rule}) do not divide by the CP degree "
                  f"{n} (ulysses {dims.ulysses} x ring {dims.ring}); use {hint}{fix}")


def _check_rows(dims: ParallelDims, sequence: SequenceShape, shapes: dict, device_type: str) -> None:
    """``_check_sequence``'s image-token rule for the sizes rows give themselves (``shapes``: Shape -> rows): a row
    whose tokens the CP degree does not divide would otherwise stop the job inside a collective, half-way through the
    run. The anything-variants split them unevenly on GPUs (``device_type`` cuda)."""
    n = dims.ulysses * dims.ring
    if (dims.ulysses_anything or dims.ring_anything) and device_type == "cuda":
        return
    bad = [(shape, rows, tokens) for shape, rows in shapes.items()
           for tokens in sequence.at(shape.width, shape.height, shape.frames).split if tokens % n]
    if bad:
        some = ", ".join(f"{rows} rows at {shape.label} ({tokens} tokens)" for shape, rows, tokens in bad[:3])
        fail(f"prompts.row_settings: {some}{' ...' if len(bad) > 3 else ''}: their image tokens do not divide by "
             f"the CP degree {n} (ulysses {dims.ulysses} x ring {dims.ring}); give those rows sizes whose "
             f"{_size_rule(sequence)} divides by {n}, or use strategy=dp or tp for this prompt file")


def _image_rule(sequence: SequenceShape) -> str:
    """How the sample's image tokens are counted."""
    patch = sequence.family.latent_patch
    if sequence.family.is_video:
        return (f"{sequence.latent_frames} latent frames of num_frames={sequence.frames} x {sequence.height}/{patch} x "
                f"{sequence.width}/{patch}")
    return f"{sequence.height}/{patch} x {sequence.width}/{patch}"


def _input_rule(sequence: SequenceShape) -> str:
    """How the input image's tokens are counted."""
    width, height = sequence.input_size
    return f"{sequence.input_image} of the input image, fitted to {width}x{height}"


def _size_rule(sequence: SequenceShape) -> str:
    """What must divide for a size's tokens to split evenly: ``(H/16)*(W/16)`` and the like."""
    p = sequence.family.latent_patch
    return (f"{'latent frames x ' if sequence.family.is_video else ''}(H/{p})*(W/{p})" +
            (" plus their input image's" if sequence.input_image else ""))
