"""Choosing, validating and applying a strategy: each one a module with ``apply(cfg, world, dims) -> pipeline``.

Replicas always split the data; a strategy says how one replica spreads over its ranks/devices.
``parallel_dims`` runs before any weight is read (on every rank, and before sbatch for SLURM): the
degrees are checked against each other and the world by ``ParallelDims`` itself, then here against
the devices, the model's transformer (from its config file alone), the attention backend and the
sequence lengths, each message saying what to change. ``apply_strategy`` then builds this rank's
part of its replica's pipeline, through ``STRATEGIES`` (the one registry: add a strategy there).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from parallel import cfg as cfg_parallel
from parallel import cp, device_map, dp, tp
from parallel.auto import decide
from parallel.dims import CP_STRATEGIES, ParallelConfigError, ParallelDims, divisors
from parallel.transformer import (HALF_DTYPES, TransformerInfo, latent_frames, model_family, sequence_tokens,
                                  transformer_info)
from shardgen.config.launchers import launcher_of
from shardgen.models import lora

if TYPE_CHECKING:
    from parallel.world import World
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.strategies")

STRATEGIES: dict[str, Callable[..., Any]] = {
    "dp": dp.apply, "tp": tp.apply, "cp_ulysses": cp.apply, "cp_ring": cp.apply, "cp_unified": cp.apply,
    "device_map": device_map.apply,
}
"""Strategy name -> ``apply(cfg, world, dims)``, building this rank's part of its replica's pipeline.
``auto`` is not here: ``parallel_dims`` resolves it to one of these."""
CHOICES = sorted([*STRATEGIES, "auto"])
# attention backends (diffusers 0.42 names) whose forward op returns the log-sum-exp ring attention merges with;
# all of them are CUDA kernels for bf16/fp16 inputs. ("native" and "_native_npu" refuse return_lse=True.)
LSE_BACKENDS = frozenset({"_native_cudnn", "_native_flash", "flash", "flash_hub", "flash_varlen_hub", "_flash_3_hub",
                          "_flash_3_varlen_hub", "sage", "sage_hub"})


def _fail(msg: str) -> None:
    raise ParallelConfigError(msg)


@dataclass(frozen=True)
class DeviceFacts:
    """The devices the ranks will run on: this machine, or the nodes a SLURM submission asks for."""

    type: str
    """cuda | cpu"""
    count: int
    """GPUs per node (0 on CPU)."""
    local_ranks: int
    """Ranks sharing one node."""
    where: str = "this machine"


def device_facts(cfg: GenerateConfig, world_size: int) -> DeviceFacts:
    """Facts about the devices, without touching them (no CUDA context is created)."""
    import torch

    launcher = launcher_of(cfg)
    if launcher.described_nodes:  # validating a submission: the nodes are described by the launcher config
        gpus, local_ranks, where = launcher.described_nodes(cfg)
        return DeviceFacts(type="cuda" if gpus else "cpu", count=gpus, local_ranks=local_ranks, where=where)
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or launcher.local_ranks(world_size)
    return DeviceFacts(type="cuda" if cuda else "cpu", count=torch.cuda.device_count() if cuda else 0,
                       local_ranks=local)


def _check_devices(dims: ParallelDims, facts: DeviceFacts, cfg: GenerateConfig) -> None:
    """Enough devices of the right kind for the ranks (and, for device_map, the GPUs each one spans)."""
    if dims.strategy == "device_map":
        if facts.type != "cuda":
            _fail(f"strategy=device_map spreads one replica over several GPUs, and {facts.where} has no CUDA GPU "
                  "(CPU only); on CPU use strategy=dp (or strategy=tp / cp_ulysses with launcher=local to debug)")
        if cfg.model.weights == "dummy" and dims.gpus_per_replica > 1:
            _fail("model.weights=dummy builds the whole pipeline on one GPU; with strategy=device_map use "
                  "strategy.gpus_per_replica=1 (or pretrained weights to spread the transformer over several GPUs)")
        need = facts.local_ranks * dims.gpus_per_replica
        if need > facts.count:
            _fail(f"strategy=device_map with strategy.gpus_per_replica={dims.gpus_per_replica} and {facts.local_ranks} "
                  f"rank(s) per node needs {need} GPUs, but {facts.where} has {facts.count}; lower "
                  "strategy.gpus_per_replica or launch fewer ranks per node")
        return
    if facts.type == "cuda" and facts.local_ranks > facts.count:
        _fail(f"{facts.local_ranks} ranks per node need one GPU each, but {facts.where} has {facts.count}; launch at "
              f"most {facts.count} ranks per node")
    several_nodes = dims.world_size > facts.local_ranks
    if dims.strategy == "tp" and facts.type == "cuda" and several_nodes and facts.local_ranks != facts.count:
        # diffusers puts rank r's shard on GPU r % (GPUs per node): right only with one rank per GPU on every node
        _fail(f"strategy=tp over several nodes needs one rank per GPU on every node (diffusers places rank r on GPU "
              f"r % {facts.count}), but there are {facts.local_ranks} ranks per node; launch {facts.count} per node")
    if dims.strategy == "tp" and facts.type == "cpu" and not launcher_of(cfg).described_nodes:
        import torch

        if torch.cuda.is_available():  # diffusers places each rank's shard on the accelerator, not on our device
            _fail("strategy=tp with device=cpu on a machine with a visible CUDA GPU: diffusers would put the shards "
                  "on the GPU; use device=cuda, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to try tp on CPU")


def _check_model(dims: ParallelDims, info: TransformerInfo) -> None:
    """The transformer class can be split this way, and its heads divide by the degrees."""
    if dims.strategy == "tp":
        if info.plan("tp") is None:
            _fail(f"strategy=tp: {info.cls_name} has no _tp_plan in this diffusers, so it cannot be tensor-parallel; "
                  "use strategy=device_map to spread it over GPUs, or a cp_* strategy")
        if info.heads and info.heads % dims.tp:
            _fail(f"tp_degree={dims.tp} does not divide the {info.heads} attention heads of {info.cls_name} "
                  f"(from {info.source}); use a tp_degree among {divisors(info.heads)}")
    if dims.strategy in CP_STRATEGIES:
        if info.plan("cp") is None:
            _fail(f"strategy={dims.strategy}: {info.cls_name} has no _cp_plan in this diffusers, so its sequence "
                  "cannot be split; use strategy=tp or device_map")
        if dims.ulysses > 1 and info.heads and info.heads % dims.ulysses and not dims.ulysses_anything:
            _fail(f"ulysses_degree={dims.ulysses} does not divide the {info.heads} attention heads of {info.cls_name} "
                  f"(from {info.source}); use one of {divisors(info.heads)}, or strategy.ulysses_anything=true")


def _check_cfg(r: ParallelDims, cfg: GenerateConfig) -> None:
    """cfg_degree=2 needs a pipeline that runs true CFG (two transformer branches per step), switched on."""
    if r.cfg == 1:
        return
    m = cfg.model
    if not cfg_parallel.has_true_cfg(m.pipeline):
        _fail(f"cfg_degree={r.cfg}: {m.pipeline} has no true classifier-free guidance (no true_cfg_scale; guidance-"
              "distilled models run the transformer once per step), so there is no second branch to split off; "
              "set cfg_degree=1")
    if m.true_cfg_scale <= 1:
        _fail(f"cfg_degree={r.cfg} splits true CFG's two branches over two ranks, but model.true_cfg_scale="
              f"{m.true_cfg_scale} turns true CFG off (one branch per step); set model.true_cfg_scale above 1 (with "
              "model.negative_prompt, default \" \") or cfg_degree=1")


def default_attention_backend(device_type: str, needs_lse: bool) -> str:
    """CUDA: cuDNN attention when ring needs the LSE, else native SDPA (faster on one H200, see docs/strategies.md);
    CPU: native."""
    return "_native_cudnn" if device_type == "cuda" and needs_lse else "native"


def _check_backend_name(name: str) -> str:
    from diffusers.models.attention_dispatch import AttentionBackendName

    valid = sorted(b.value for b in AttentionBackendName)
    if name not in valid:
        _fail(f"strategy.attention_backend={name!r} is not a diffusers attention backend; use one of {valid}")
    return name


def _check_attention(dims: ParallelDims, facts: DeviceFacts, dtype: str) -> str:
    """The attention backend for a CP replica (configured, or the device's default), checked; returns it."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    needs_lse = dims.ring > 1
    name = _check_backend_name(dims.attention_backend or default_attention_backend(facts.type, needs_lse))
    cp_ok = sorted(_AttentionBackendRegistry._supports_context_parallel)
    if name not in cp_ok:
        _fail(f"strategy.attention_backend={name!r} does not support context parallelism; use one of {cp_ok}")
    what = "ring attention" if dims.strategy == "cp_ring" else f"strategy={dims.strategy} with ring_degree={dims.ring}"
    if needs_lse and name not in LSE_BACKENDS:
        if facts.type != "cuda":
            _fail(f"{what} needs an attention backend that returns the log-sum-exp (LSE) to merge the ring's partial "
                  f"results, and on CPU none does (native SDPA refuses return_lse); use strategy=cp_ulysses on CPU, "
                  "or run ring attention on CUDA GPUs")
        _fail(f"{what} needs an attention backend that returns the log-sum-exp (LSE); {name!r} does not. Set "
              f"strategy.attention_backend to one of {sorted(LSE_BACKENDS)} (default _native_cudnn)")
    if name in LSE_BACKENDS:
        if facts.type != "cuda":
            _fail(f"strategy.attention_backend={name} is a CUDA kernel and {facts.where} has no CUDA GPU; use native "
                  "on CPU")
        if dtype not in HALF_DTYPES:
            _fail(f"strategy.attention_backend={name} runs bfloat16/float16 only, and dtype={dtype}; set "
                  "dtype=bfloat16" + (" (ring attention needs such a backend)" if needs_lse else
                                      " or strategy.attention_backend=native"))
    return name


def _check_sequence(dims: ParallelDims, cfg: GenerateConfig, facts: DeviceFacts) -> None:
    """Each sequence the transformer splits (image tokens, text tokens) divides by the CP degree, unless an
    anything-variant is on; those split unevenly only on GPUs (gloo cannot all-gather pieces of unequal size)."""
    n = dims.ulysses * dims.ring
    image, text = sequence_tokens(cfg)
    anything = dims.ulysses_anything or dims.ring_anything
    variant = "strategy.ulysses_anything=true" if dims.ring == 1 else \
        "strategy.ring_anything=true" if dims.ulysses == 1 else None
    fix = f", or {variant}" if variant and facts.type == "cuda" else ""
    for what, tokens in (("image", image), ("text", text)):
        if tokens is None and not anything:
            _fail(f"{cfg.model.pipeline} gives each batch a text length of its own, which a CP degree of {n} need not "
                  f"divide; set {variant or 'ulysses_degree or ring_degree to 1 and its anything-variant'} (on GPUs)")
        if tokens is None or tokens % n == 0:
            continue
        if anything and facts.type != "cuda":
            _fail(f"{what} tokens = {tokens} ({_token_rule(what, cfg)}) do not divide by the CP degree {n}: the "
                  "anything-variants split them unevenly, which needs NCCL (gloo cannot all-gather pieces of unequal "
                  f"size), and {facts.where} has no CUDA GPU; use sizes that divide by {n}")
        if anything and tokens < n:
            _fail(f"{tokens} {what} tokens cannot be split over {n} ranks; use a smaller CP degree")
        if not anything:
            family = model_family(cfg)
            frames = "latent frames x " if family.is_video else ""
            p = family.latent_patch
            hint = (f"num_frames/height/width giving {frames}(H/{p})*(W/{p}) divisible by {n}" if what == "image" else
                    f"model.max_sequence_length divisible by {n}")
            _fail(f"{what} tokens = {tokens} ({_token_rule(what, cfg)}) do not divide by the CP degree "
                  f"{n} (ulysses {dims.ulysses} x ring {dims.ring}); use {hint}{fix}")


def check_row_shapes(cfg: GenerateConfig, dims: ParallelDims, shapes: dict | None, device_type: str | None = None
                     ) -> None:
    """``_check_sequence``'s image-token rule for the shapes rows give themselves (prompts.row_settings), once the
    plan has counted them (``Plan.shapes``; Shape -> rows), before any weight is read: a row whose tokens the CP
    degree does not divide would otherwise stop the job inside a collective, half-way through the run.
    ``device_type``: this rank's ("cuda" or "cpu"; None: from the config, as the launch checks find it)."""
    n = dims.ulysses * dims.ring
    if n == 1 or not shapes:
        return
    device_type = device_type or device_facts(cfg, dims.world_size).type
    if (dims.ulysses_anything or dims.ring_anything) and device_type == "cuda":  # they split unevenly on GPUs
        return
    family = model_family(cfg)
    p = family.latent_patch
    bad = [(shape, rows, family.image_tokens(shape.height, shape.width) * family.latent_frames(shape.frames))
           for shape, rows in shapes.items()]
    bad = [(shape, rows, tokens) for shape, rows, tokens in bad if tokens % n]
    if bad:
        some = ", ".join(f"{rows} rows at {shape.label} ({tokens} tokens)" for shape, rows, tokens in bad[:3])
        _fail(f"prompts.row_settings: {some}{' ...' if len(bad) > 3 else ''}: their image tokens do not divide by "
              f"the CP degree {n} (ulysses {dims.ulysses} x ring {dims.ring}); give those rows sizes whose "
              f"{'latent frames x ' if family.is_video else ''}(H/{p})*(W/{p}) divides by {n}, or use strategy=dp or "
              "tp for this prompt file")


def _token_rule(what: str, cfg: GenerateConfig) -> str:
    family = model_family(cfg)
    patch = family.latent_patch
    if what == "image" and family.is_video:
        return (f"{latent_frames(cfg)} latent frames of num_frames={cfg.num_frames} x {cfg.height}/{patch} x "
                f"{cfg.width}/{patch}")
    if what == "image":
        return f"{cfg.height}/{patch} x {cfg.width}/{patch}"
    return "model.max_sequence_length"


def validate(cfg: GenerateConfig, dims: ParallelDims, facts: DeviceFacts,
             info_fn: Callable[[Any], TransformerInfo] = transformer_info) -> ParallelDims:
    """Every check of ``dims`` that needs the devices or the model's config, in order; returns ``dims`` with its
    attention backend resolved."""
    _check_devices(dims, facts, cfg)
    _check_cfg(dims, cfg)
    if dims.strategy == "tp" and lora.per_row(cfg):  # auto may choose tp
        _fail(lora.TP_PER_ROW)
    if dims.strategy == "tp" or dims.strategy in CP_STRATEGIES:
        _check_model(dims, info_fn(cfg.model))
    if dims.strategy in CP_STRATEGIES:
        dims.attention_backend = _check_attention(dims, facts, cfg.dtype)
        _check_sequence(dims, cfg, facts)
    elif dims.attention_backend:
        dims.attention_backend = _check_backend_name(dims.attention_backend)
    return dims


def parallel_dims(cfg: GenerateConfig, world_size: int) -> ParallelDims:
    """The strategy and degrees to run, validated against the world, the devices and the model's config
    (no weights touched); ``auto`` is resolved to its choice here."""
    name = cfg.strategy.name
    if name not in CHOICES:
        raise ParallelConfigError(f"strategy={name} is not available; choose one of {CHOICES}")
    facts = device_facts(cfg, world_size)
    dims = decide(cfg, world_size, facts) if name == "auto" else ParallelDims.from_cfg(cfg, world_size)
    return validate(cfg, dims, facts)


def apply_strategy(cfg: GenerateConfig, world: World, dims: ParallelDims) -> Any:
    """Build this rank's part of its replica's pipeline (``dims.build_mesh`` has run)."""
    log.info("strategy %s: %d replica(s) of %d rank(s)%s%s", dims.strategy, dims.dp, dims.replica_size,
             f" x {dims.gpus_per_replica} GPU(s)" if dims.strategy == "device_map" else "",
             f" (cfg parallel x{dims.cfg})" if dims.cfg > 1 else "")
    pipe = STRATEGIES[dims.strategy](cfg, world, dims)
    if dims.cfg > 1:
        cfg_mesh = dims.mesh("cfg")
        cfg_parallel.enable(pipe.transformer, cfg_mesh.get_group(), cfg_mesh.get_local_rank())
    return pipe
