"""Will the model fit? Its weights' size, from its config (safetensors headers, or the dummy architecture
built on the meta device), against the memory of the device each rank builds it on; checked before any
weight is built or read, so an oversized model is a message, not "can't allocate memory" half-way.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from parallel.dims import ParallelDims
from shardgen.errors import UserError

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.memory")
GiB = 1 << 30
HEADROOM = 1.1  # weights are not all: activations, the allocator and the libraries take their share too


class MemoryCheckError(UserError, MemoryError):
    """The model's weights do not fit the memory of the device they are built on."""


def weights_per_process(params: dict[str, int], dtype_bytes: int, dims: ParallelDims, fused_whole: bool = False
                        ) -> int:
    """Bytes of weights one process holds: its strategy's share (``Strategy.weights_bytes``; dp and cp hold all
    of it, tp splits the transformer(s) over the replica's ranks, device_map the whole pipeline over its GPUs), or
    all of it when ``fused_whole`` (LoRA adapters are fused into the whole transformer before it is split)."""
    transformer = sum(n for k, n in params.items() if k.startswith("transformer"))  # Wan 2.2: two experts
    others = sum(params.values()) - transformer
    if fused_whole:
        return (transformer + others) * dtype_bytes
    return dims.kind.weights_bytes(transformer, others, dtype_bytes, dims)


def local_ranks() -> int:
    """Ranks of this run on this machine (the launcher's LOCAL_WORLD_SIZE; 1 outside a launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def available_bytes(device_type: str, local_ranks: int) -> tuple[int | None, str]:
    """(bytes free for one process, where); None when unknown. CPU ranks of one machine share its RAM."""
    if device_type == "cuda":
        import torch

        # blocks this process's caching allocator holds but does not use are free to it too (a second model built in
        # one process, e.g. the GPU tests one after another, saw them as taken)
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return torch.cuda.mem_get_info()[0] + max(0, cached), f"GPU {torch.cuda.current_device()}"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None, "the CPU"
    return kb * 1024 // max(1, local_ranks), f"the CPU ({local_ranks} rank(s) sharing its RAM)" if local_ranks > 1 \
        else "the CPU"


def memory_problem(cfg: GenerateConfig, dims: ParallelDims, params: dict[str, int], dtype_bytes: int,
                   available: int | None, where: str) -> str | None:
    """The message when the weights do not fit (pure: tests give it any figures); None when they do."""
    fused_whole = dims.kind.loras_fused_whole and bool(cfg.model.get("loras"))
    need = weights_per_process(params, dtype_bytes, dims, fused_whole)
    if available is None or need * HEADROOM <= available:
        return None
    kind = dims.kind
    split = "" if kind.splits_transformer or kind.spans_gpus_in_one_process else (
        " or split the transformer over several GPUs (strategy=tp tp_degree=N, strategy=device_map)")
    bigger = "a GPU with more memory" if where.startswith("GPU") else "a device with more memory (device=cuda)"
    transformer = sum(n for k, n in params.items() if k.startswith("transformer")) * dtype_bytes
    if split and where.startswith("GPU") and transformer * HEADROOM <= available and _stageable(cfg):
        bigger = (f"strategy=device_map (the transformer alone, {transformer / GiB:.1f} GiB, fits: the text encoders "
                  "stay in the machine's RAM and come in for each batch's encoding; strategy=auto picks it), " + bigger)
    if fused_whole:
        split = (" (with model.loras each tp rank fuses the adapters into the whole transformer before sharding it), "
                 "or strategy=device_map")
    borrowed = _borrowed_architecture(cfg)
    smaller = (f"model.weights=pretrained (weights=dummy gives model={cfg.model.name} {borrowed}'s whole architecture, "
               "with random weights)" if borrowed else "a smaller model (model=tiny)")
    return (f"model={cfg.model.name} (weights={cfg.model.weights}, dtype={cfg.dtype}) needs ~{need / GiB:.1f} GiB "
            f"for its weights in each process ({sum(params.values()) / 1e9:.1f}B parameters, strategy "
            f"{dims.strategy}), but {where} has {available / GiB:.1f} GiB available. Use {bigger}{split}, fewer "
            f"ranks per machine, {smaller}, or check_memory=false to try anyway")


def _borrowed_architecture(cfg: GenerateConfig) -> str | None:
    """The name of the architecture ``weights=dummy`` builds for a model that has none of its own (model=tiny: its
    family's, FLUX.1-dev's); None for every other run."""
    if cfg.model.get("weights") != "dummy":
        return None
    from shardgen.models.dummy import dummy_models, find_dummy

    if cfg.model.name in dummy_models():
        return None
    try:
        return find_dummy(cfg.model.name, cfg.model.get("pipeline"))[1].title
    except ValueError:
        return None


def _stageable(cfg: GenerateConfig) -> bool:
    """Whether strategy=device_map can run the model with its text encoders off the GPU (its family says how it
    encodes prompts)."""
    from shardgen.families import family_for

    return family_for(cfg.model.pipeline).encode_outputs is not None


def offload_problem(cfg: GenerateConfig, dims: ParallelDims, params: dict[str, int], dtype_bytes: int,
                    gpu_available: int, host_available: int | None, host_where: str) -> str | None:
    """The message when the text encoders device_map keeps on the CPU (those ``plan_encoders`` finds no room for
    beside the transformer's share of each GPU) do not fit this rank's share of the machine's RAM (pure); None when
    they do, or when the strategy keeps everything on its GPUs."""
    if not dims.kind.spans_gpus_in_one_process or host_available is None:
        return None
    from parallel.device_map import plan_encoders

    gpus = range(max(1, dims.gpus_per_replica))
    share = weights_per_process(params, dtype_bytes, dims)
    sizes = {k: n * dtype_bytes for k, n in params.items() if k.startswith("text_encoder")}
    plan = plan_encoders(sizes, dict.fromkeys(gpus, share), dict.fromkeys(gpus, gpu_available))
    off = sorted(k for k, gpu in plan.items() if gpu is None)
    need = sum(sizes[k] for k in off)
    if need * HEADROOM <= host_available:
        return None
    return (f"model={cfg.model.name} under strategy={dims.strategy} keeps {', '.join(off)} ({need / GiB:.1f} GiB) on "
            f"the CPU (no room beside the transformer on its GPU), but {host_where} has {host_available / GiB:.1f} GiB "
            "available. Use a machine with more RAM, fewer ranks per machine, or check_memory=false to try anyway")


def check_memory(cfg: GenerateConfig, dims: ParallelDims, device_type: str) -> None:
    """Refuse (MemoryCheckError) a model whose weights do not fit where this rank builds them: its device, and the
    machine's RAM for the text encoders strategy=device_map keeps on the CPU."""
    from shardgen.models.loader import component_params, torch_dtype

    if not cfg.check_memory:
        return
    try:
        params = component_params(cfg.model)
    except (OSError, ValueError) as e:  # a safetensors header that does not read
        log.debug("memory check skipped: %s", e)
        return
    if params is None:  # a hub id not on disk: nothing to size it from
        log.debug("memory check skipped: model.source=%r is not a local diffusers directory", cfg.model.source)
        return
    available, where = available_bytes(device_type, local_ranks())
    nbytes = torch_dtype(cfg.dtype).itemsize
    if problem := memory_problem(cfg, dims, params, nbytes, available, where):
        raise MemoryCheckError(problem)
    if device_type == "cuda" and available is not None:
        host, host_where = available_bytes("cpu", local_ranks())
        if problem := offload_problem(cfg, dims, params, nbytes, available, host, host_where):
            raise MemoryCheckError(problem)
