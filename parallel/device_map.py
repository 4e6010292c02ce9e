"""device_map: one process spans ``strategy.gpus_per_replica`` GPUs, for models that do not fit one GPU.

The transformer is loaded with ``device_map="balanced"`` and ``max_memory`` over the replica's GPUs
(accelerate splits its blocks and moves activations between them); the VAE goes on the first GPU;
each text encoder stays resident on a GPU when it fits next to the transformer, and otherwise follows
the staged flow of diffusers' distributed-inference guide, per batch: encode the prompts, offload the encoders, denoise, decode.
An offloaded encoder that does not fit beside the transformer even for the encoding (FLUX.2-dev's 24B Mistral beside
its transformer on an 80 GB card) is streamed instead (``parallel/offload.py``).
``StagedPipeline`` does that behind the pipeline's own ``__call__`` contract.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from parallel.offload import pin_streamed, pinned_bytes, room_to_encode, stream_encoder, stream_plan
from parallel.registry import Strategy, fail, register
from parallel.transformer import load_transformer, model_family
from shardgen.config.sizes import GiB, parse_bytes
from shardgen.families import families, family_of
from shardgen.models import lora
from shardgen.models.loader import ModelLoadError, load_pipeline, torch_dtype

if TYPE_CHECKING:
    from parallel.dims import ParallelDims
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.device_map")
RESERVE_FRACTION = 0.15  # of each GPU, kept free for activations when deciding what stays resident


def stageable() -> list[str]:
    """The pipelines StagedPipeline can run: those whose family names its ``encode_prompt`` outputs."""
    return sorted(f.pipeline for f in families() if f.encode_outputs is not None)


@dataclass
class StagedPipeline:
    """A pipeline whose text encoders may live off the GPU: each call encodes the prompts (moving the
    offloaded encoders in and back out), then denoises and decodes from the embeddings.

    Called like the pipeline (the keyword arguments below, passed on when the pipeline accepts them);
    returns the pipeline's output (``.images``: [0, 1] float NCHW with ``output_type="pt"``).
    """

    pipe: Any
    device: torch.device
    """Where the encoders run and the pipeline computes (the replica's first GPU)."""
    offloaded: list[str] = field(default_factory=list)
    """Encoders kept on the CPU and brought to ``device`` for each batch's encoding: moved whole where they fit beside
    what the GPU holds then, else streamed layer by layer (decided at the first batch: fp8 shrinks the transformer
    after the encoders are placed)."""
    streamed: list[str] = field(default_factory=list)
    """The offloaded encoders that are streamed (group offloading hooks installed: never moved whole)."""
    _decided: bool = field(default=False, init=False, repr=False)
    """Whether the first batch has decided which encoders to stream."""

    def __post_init__(self):
        family = family_of(self.pipe)  # encode_prompt's outputs, in order, as the pipeline's __call__ names them
        if family is None or family.encode_outputs is None:
            raise ModelLoadError(f"strategy=device_map does not know how {type(self.pipe).__name__} encodes prompts; "
                                 f"supported: {stageable()}")
        self._outputs = family.encode_outputs
        if family.encode_hooks is not None:  # exact, and what is streamed in for the encoding shrinks with it
            family.encode_hooks(self.pipe)
        self._call_params = set(inspect.signature(self.pipe.__call__).parameters)
        encode = inspect.signature(self.pipe.encode_prompt).parameters
        self._encode_params = set(encode)
        # prompt_2, prompt_3 without a default (SD3): None means "the same prompt" in diffusers' encode_prompt
        self._same_prompt = [n for n, p in encode.items()
                             if n.startswith("prompt_") and n[7:].isdigit() and p.default is inspect.Parameter.empty]

    def __getattr__(self, name: str) -> Any:  # components, config, ... of the wrapped pipeline
        if name == "pipe":
            raise AttributeError(name)
        return getattr(self.pipe, name)

    def __call__(self, prompt: str | list[str], *, height: int | None = None, width: int | None = None,
                 num_inference_steps: int = 28, guidance_scale: float | None = None,
                 true_cfg_scale: float | None = None, negative_prompt: str | list[str] | None = None,
                 max_sequence_length: int | None = None, generator=None, output_type: str = "pil",
                 return_dict: bool = True, image: Any = None, strength: float | None = None):
        """Encode ``prompt`` (and ``negative_prompt`` with true CFG), then denoise and decode; ``image`` and
        ``strength`` (a row's input image, image-to-image's strength) go to the pipeline as given: its VAE, on the
        replica's GPUs, encodes the image."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        with self._encoders_on_device():
            embeds = self.encode(prompts, max_sequence_length)
            if negative_prompt is not None and (true_cfg_scale or 1.0) > 1.0:
                negative = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else negative_prompt
                embeds.update({f"negative_{k}": v for k, v in self.encode(list(negative), max_sequence_length).items()})
        rest = dict(height=height, width=width, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                    true_cfg_scale=true_cfg_scale, max_sequence_length=max_sequence_length, generator=generator,
                    output_type=output_type, return_dict=return_dict, image=image, strength=strength)
        rest = {k: v for k, v in rest.items() if v is not None and k in self._call_params}
        return self.pipe(**embeds, **rest)

    def encode(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor]:
        """The pipeline's prompt embeddings for ``prompts``, named as its ``__call__`` takes them."""
        kw = dict(prompt=prompts, device=self.device, num_images_per_prompt=1, **dict.fromkeys(self._same_prompt))
        if max_sequence_length is not None and "max_sequence_length" in self._encode_params:
            kw["max_sequence_length"] = max_sequence_length
        with torch.no_grad():
            out = self.pipe.encode_prompt(**kw)
        return {name: value for name, value in zip(self._outputs, out) if name is not None}

    @contextlib.contextmanager
    def _encoders_on_device(self) -> Iterator[None]:
        if not self._decided:
            self._stream_what_does_not_fit()
        moved = [n for n in self.offloaded if n not in self.streamed]
        for name in moved:
            getattr(self.pipe, name).to(self.device)
        try:
            yield
        finally:
            for name in moved:
                getattr(self.pipe, name).to("cpu")
            if moved and self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _stream_what_does_not_fit(self) -> None:
        """Install streaming on each offloaded encoder too large for what the GPU has free now (once)."""
        self._decided = True
        room = room_to_encode(self.device, RESERVE_FRACTION)
        if room is None or not self.offloaded:
            return
        sizes = {n: _module_bytes(getattr(self.pipe, n)) for n in self.offloaded}
        for name in stream_plan(sizes, room):
            pinned = pin_streamed(pinned_bytes(getattr(self.pipe, name)))
            stream_encoder(getattr(self.pipe, name), self.device, pinned)
            self.streamed.append(name)
            log.info("device_map: %s (%.1f GiB) does not fit beside the transformer even to encode (%.1f GiB of room): "
                     "streamed layer by layer for each batch's encoding%s", name, sizes[name] / GiB, room / GiB,
                     "" if pinned else " (from pageable memory: the CPU has no room for a pinned copy)")


def replica_gpus(local_rank: int, gpus_per_replica: int) -> list[int]:
    """The GPUs of this rank's replica: local rank r spans GPUs [r*g, (r+1)*g)."""
    return list(range(local_rank * gpus_per_replica, (local_rank + 1) * gpus_per_replica))


def memory_caps(max_memory: Any, gpus: list[int]) -> dict[int, int]:
    """Bytes each of ``gpus`` may hold: ``strategy.max_memory`` (one size for each GPU, or a mapping whose keys
    are GPU indices within the replica), else 90% of what is free now."""
    caps = {}
    for i, gpu in enumerate(gpus):
        if isinstance(max_memory, (str, int, float)):
            given = max_memory
        else:
            given = (max_memory or {}).get(str(i), (max_memory or {}).get(i))
        caps[gpu] = parse_bytes(given) if given is not None else int(torch.cuda.mem_get_info(gpu)[0] * 0.9)
    return caps


def _module_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()) + \
        sum(b.numel() * b.element_size() for b in module.buffers())


def _load(cfg: GenerateConfig, gpus: list[int], caps: dict[int, int]) -> Any:
    """The pipeline with its transformer spread over ``gpus``; the other components still on the CPU."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.model.weights == "dummy":  # validation allows one GPU only: built there, the text encoders moved off it
        from shardgen.models.dummy import build_dummy_pipeline

        return build_dummy_pipeline(cfg.model.name, torch.device("cuda", gpus[0]), dtype, pipeline=cfg.model.pipeline,
                                    encoders_on_cpu=True)
    transformer = load_transformer(cfg.model, dtype, "", device_map="balanced", max_memory=caps)
    placed = {str(d) for d in (getattr(transformer, "hf_device_map", None) or {}).values()}
    off = sorted(placed - {str(g) for g in gpus})
    if off:
        raise ModelLoadError(
            f"the transformer does not fit GPUs {gpus} under max_memory {caps} (parts went to {off}); raise "
            "strategy.gpus_per_replica or strategy.max_memory")
    return load_pipeline(cfg.model, dtype, None, transformer=transformer)


def plan_encoders(sizes: dict[str, int], used: dict[int, int], caps: dict[int, int]) -> dict[str, int | None]:
    """Where each text encoder lives (pure): the GPU with most room when it fits there with
    ``RESERVE_FRACTION`` of the GPU to spare for activations, else None (offloaded). Largest first."""
    used, plan = dict(used), {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        room = {g: caps[g] * (1 - RESERVE_FRACTION) - used[g] for g in caps}
        gpu = max(room, key=room.get)
        plan[name] = gpu if sizes[name] <= room[gpu] else None
        if plan[name] is not None:
            used[gpu] += sizes[name]
    return plan


def place(pipe: Any, gpus: list[int], caps: dict[int, int]) -> list[str]:
    """VAE on the first GPU, the text encoders as ``plan_encoders`` says; returns the offloaded ones."""
    first = torch.device("cuda", gpus[0])
    if pipe.vae.device != first:
        pipe.vae.to(first)
    encoders = [n for n, c in pipe.components.items()
                if n.startswith("text_encoder") and isinstance(c, torch.nn.Module)]
    for name in encoders:  # measure the GPUs without them (dummy weights are built on the GPU)
        getattr(pipe, name).to("cpu")
    used = {g: torch.cuda.memory_allocated(g) for g in gpus}
    plan = plan_encoders({n: _module_bytes(getattr(pipe, n)) for n in encoders}, used, caps)
    for name, gpu in plan.items():
        size = _module_bytes(getattr(pipe, name)) / GiB
        if gpu is not None:
            getattr(pipe, name).to(torch.device("cuda", gpu))
            log.info("device_map: %s (%.1f GiB) resident on cuda:%d", name, size, gpu)
        else:
            log.info("device_map: %s (%.1f GiB) does not fit next to the transformer: offloaded to the CPU, moved "
                     "in to encode each batch (staged flow)", name, size)
    return [n for n, g in plan.items() if g is None]


@register
class DeviceMap(Strategy):
    """One process per replica, spanning ``strategy.gpus_per_replica`` GPUs (accelerate's balanced split)."""

    name = "device_map"
    spans_gpus_in_one_process = True

    def own_degrees(self, dims: ParallelDims) -> list[str]:
        return [f"strategy.gpus_per_replica={dims.gpus_per_replica}"]

    def check_degrees(self, dims: ParallelDims) -> None:
        if dims.cfg > 1:
            fail("cfg_degree=2 splits the two CFG branches over two ranks, and strategy=device_map runs one process "
                 "per replica; set cfg_degree=1, or use strategy=dp / tp / cp_* with cfg_degree=2")
        self.refuse_combined(dims, "set tp_degree=1 (or use strategy=tp)")
        if (dims.tp, dims.ulysses, dims.ring) != (1, 1, 1):
            fail("strategy=device_map spreads one process over several GPUs and ignores tp/ulysses/ring degrees; "
                 "set them to 1")
        if dims.gpus_per_replica < 1:
            fail(f"strategy.gpus_per_replica={dims.gpus_per_replica}: use 1 or more")

    def check_devices(self, dims: ParallelDims, facts, cfg: GenerateConfig) -> None:
        if facts.type != "cuda":
            fail(f"strategy=device_map spreads one replica over several GPUs, and {facts.where} has no CUDA GPU "
                 "(CPU only); on CPU use strategy=dp (or strategy=tp / cp_ulysses with launcher=local to debug)")
        if cfg.model.weights == "dummy" and dims.gpus_per_replica > 1:
            fail("model.weights=dummy builds the whole pipeline on one GPU; with strategy=device_map use "
                 "strategy.gpus_per_replica=1 (or pretrained weights to spread the transformer over several GPUs)")
        need = facts.local_ranks * dims.gpus_per_replica
        if need > facts.count:
            fail(f"strategy=device_map with strategy.gpus_per_replica={dims.gpus_per_replica} and {facts.local_ranks} "
                 f"rank(s) per node needs {need} GPUs, but {facts.where} has {facts.count}; lower "
                 "strategy.gpus_per_replica or launch fewer ranks per node")

    def check_model(self, dims: ParallelDims, cfg: GenerateConfig, info_fn) -> None:
        family = model_family(cfg)
        if family.encode_outputs is None:  # StagedPipeline encodes the prompts itself, then offloads the encoders
            fail(f"strategy=device_map encodes prompts apart from the pipeline and does not know how "
                 f"{cfg.model.pipeline} does ({family.name}: its prompts are encoded with its input images); use "
                 f"strategy=dp, tp or fsdp for this model. device_map runs {stageable()}")

    def weights_bytes(self, transformer: int, others: int, dtype_bytes: int, dims: ParallelDims) -> int:
        # the transformer's share: the text encoders live on the CPU when they do not fit beside it (moved in or
        # streamed for each batch's encoding), the VAE is within the memory check's headroom
        return transformer * dtype_bytes // max(1, dims.gpus_per_replica)

    def apply(self, cfg: GenerateConfig, world: World, dims: ParallelDims) -> StagedPipeline:
        return apply(cfg, world, dims)


def apply(cfg: GenerateConfig, world: World, dims: ParallelDims) -> StagedPipeline:
    """This process's replica over its GPUs, as a StagedPipeline."""
    gpus = replica_gpus(world.local_rank, dims.gpus_per_replica)
    torch.cuda.set_device(gpus[0])
    caps = memory_caps(cfg.strategy.max_memory, gpus)
    log.info("device_map: replica on GPUs %s, max_memory %s", gpus, {g: f"{c / GiB:.1f}GiB" for g, c in caps.items()})
    pipe = lora.apply(_load(cfg, gpus, caps), cfg)  # fused where each weight lives
    offloaded = place(pipe, gpus, caps)
    # the pipeline makes its latents on the device of its first GPU-resident component: decode there too
    device = pipe._execution_device
    if pipe.vae.device != device:
        pipe.vae.to(device)
    if dims.attention_backend:
        pipe.transformer.set_attention_backend(dims.attention_backend)
    split = getattr(pipe.transformer, "hf_device_map", None)
    if split:
        log.info("device_map: transformer over %s", sorted({str(d) for d in split.values()}))
    return StagedPipeline(pipe, device, offloaded)
