"""Choosing, validating and applying a strategy: each one a module with ``apply(cfg, world, dims, mesh) -> pipeline``.

Replicas always split the data; a strategy says how one replica spreads over its ranks/devices.
``parallel_dims`` runs before any weight is read (on every rank, and before sbatch for SLURM): it
checks the degrees against the world and the devices, the model's transformer (from its config
file alone) against the degrees, the attention backend and the sequence lengths, and says what to
change. ``apply_strategy`` then builds this rank's part of its replica's pipeline.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from parallel.world import ParallelConfigError, ParallelDims

log = logging.getLogger("shardgen.strategies")

# strategy name -> module under parallel/ with an ``apply`` function
STRATEGY_MODULES = {
    "dp": "parallel.dp", "tp": "parallel.tp", "cp_ulysses": "parallel.cp", "cp_ring": "parallel.cp",
    "cp_unified": "parallel.cp", "device_map": "parallel.device_map", "auto": "parallel.auto",
}
CP_STRATEGIES = ("cp_ulysses", "cp_ring", "cp_unified")
# attention backends (diffusers 0.42 names) whose forward op returns the log-sum-exp ring attention merges with;
# all of them are CUDA kernels for bf16/fp16 inputs. ("native" and "_native_npu" refuse return_lse=True.)
LSE_BACKENDS = frozenset({"_native_cudnn", "_native_flash", "flash", "flash_hub", "flash_varlen_hub", "_flash_3_hub",
                          "_flash_3_varlen_hub", "sage", "sage_hub"})
HALF_DTYPES = ("bfloat16", "float16")
# text tokens the transformer sees per prompt: a config key (padded to it), or None when it varies per batch
TEXT_TOKENS = {"FluxPipeline": "max_sequence_length", "Flux2Pipeline": "max_sequence_length",
               "QwenImagePipeline": None}
UNSPLIT_TEXT = ("WanPipeline",)  # Wan's _cp_plan splits the video tokens only (its text feeds cross-attention)
LATENT_PATCH = 16  # pixels per image token: VAE downscale 8 x 2x2 latent patches (FLUX.1/2, Qwen-Image)


@dataclass(kw_only=True)
class StrategyDims(ParallelDims):
    """The degrees plus what the chosen strategy needs to apply itself (``auto`` is resolved here)."""

    strategy: str = "dp"
    """The strategy to apply (never ``auto``: its choice)."""
    gpus_per_replica: int = 1
    """device_map: GPUs the one process of a replica spans."""
    attention_backend: str | None = None
    """cp: the diffusers attention backend to set (resolved from the device when not configured)."""
    ulysses_anything: bool = False
    ring_anything: bool = False


@dataclass(frozen=True)
class Request:
    """A strategy with its degrees, as asked for on the command line or chosen by ``auto``."""

    strategy: str
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    gpus_per_replica: int = 1
    ulysses_anything: bool = False
    ring_anything: bool = False
    attention_backend: str | None = None

    @classmethod
    def from_cfg(cls, cfg: Any) -> "Request":
        s = cfg.strategy
        return cls(strategy=s.name, tp=cfg.tp_degree, ulysses=cfg.ulysses_degree, ring=cfg.ring_degree,
                   gpus_per_replica=s.gpus_per_replica, ulysses_anything=s.ulysses_anything,
                   ring_anything=s.ring_anything, attention_backend=s.attention_backend)


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


def device_facts(cfg: Any, world_size: int) -> DeviceFacts:
    """Facts about the devices, without touching them (no CUDA context is created)."""
    import torch

    ln = cfg.launcher
    if ln.name == "slurm":  # validating a submission: the nodes are described by the launcher config
        gpus = 0 if cfg.device == "cpu" else ln.gpus_per_node
        return DeviceFacts(type="cuda" if gpus else "cpu", count=gpus, local_ranks=ln.tasks_per_node or gpus or 1,
                           where=f"each SLURM node (launcher.gpus_per_node={ln.gpus_per_node})")
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (world_size if ln.name == "local" else 1)
    return DeviceFacts(type="cuda" if cuda else "cpu", count=torch.cuda.device_count() if cuda else 0,
                       local_ranks=local)


# --- the model's transformer, from its config alone --------------------------------------------------------

@dataclass(frozen=True)
class TransformerInfo:
    """The transformer class name and config of a model, read without loading any weight."""

    cls_name: str
    config: dict = field(default_factory=dict)
    source: str = ""

    @property
    def heads(self) -> int | None:
        return self.config.get("num_attention_heads")

    @property
    def hidden(self) -> int | None:
        h, d = self.heads, self.config.get("attention_head_dim")
        return h * d if h and d else None

    def model_class(self):
        import diffusers

        return getattr(diffusers, self.cls_name, None)

    def plan(self, kind: str):
        """The class's ``_tp_plan`` or ``_cp_plan`` (None when it has none)."""
        cls = self.model_class()
        return getattr(cls, f"_{kind}_plan", None) if cls is not None else None


def _hub_file(repo: str, filename: str, revision: str | None) -> Path | None:
    """A file of a hub model from the local Hugging Face cache only (no network: no hub is assumed reachable)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo, filename, revision=revision)
    except Exception:
        return None
    return Path(hit) if isinstance(hit, str) else None


def transformer_info(model_cfg: Any) -> TransformerInfo:
    """The transformer's class and config: the embedded tiny one, the dummy architecture, or config.json."""
    if model_cfg.weights == "dummy":
        from shardgen.models.dummy import dummy_architecture
        from shardgen.models.loader import dummy_arch

        spec = dummy_architecture(dummy_arch(model_cfg) or model_cfg.pipeline)["transformer"]
        return TransformerInfo(spec.cls, dict(spec.config), f"the dummy {model_cfg.pipeline} architecture")
    if model_cfg.source == "tiny":
        from shardgen.models.tiny import TRANSFORMER_CONFIG

        return TransformerInfo("FluxTransformer2DModel", dict(TRANSFORMER_CONFIG), "shardgen.models.tiny.TRANSFORMER_CONFIG")
    if model_cfg.source == "tiny_video":
        from shardgen.models import tiny_video

        return TransformerInfo("WanTransformer3DModel", dict(tiny_video.TRANSFORMER_CONFIG),
                               "shardgen.models.tiny_video.TRANSFORMER_CONFIG")
    path = Path(os.path.expanduser(model_cfg.source)) / "transformer" / "config.json"
    if not path.is_file():
        path = _hub_file(model_cfg.source, "transformer/config.json", model_cfg.revision)
    if path is None:
        raise ParallelConfigError(
            f"cannot read the transformer config of model.source={model_cfg.source!r} (not a local diffusers directory "
            "and not in the Hugging Face cache) to check the parallel degrees against it; download the model and point "
            "model.source at its directory")
    config = json.loads(path.read_text())
    return TransformerInfo(config.get("_class_name", "?"), config, str(path))


def sequence_tokens(cfg: Any) -> tuple[int, int | None]:
    """(image tokens, text tokens) one prompt puts through the transformer; text None when it varies."""
    image = (cfg.height // LATENT_PATCH) * (cfg.width // LATENT_PATCH) * latent_frames(cfg)
    if cfg.model.pipeline in UNSPLIT_TEXT:
        return image, 0  # nothing to divide
    key = TEXT_TOKENS.get(cfg.model.pipeline)
    return image, (cfg.model[key] if key else None)


# --- validation --------------------------------------------------------------------------------------------

def _fail(msg: str) -> None:
    raise ParallelConfigError(msg)


def _check_degrees(r: Request) -> None:
    """Each strategy's own degrees; CP and TP never combined."""
    name, cp = r.strategy, r.ulysses * r.ring
    if name == "dp" and (r.tp, r.ulysses, r.ring) != (1, 1, 1):
        _fail(f"strategy=dp ignores tp_degree/ulysses_degree/ring_degree ({r.tp}/{r.ulysses}/{r.ring}); pick "
              "strategy=tp or a cp_* strategy, or set the degrees to 1")
    if name == "tp":
        if cp > 1:
            _fail(f"strategy=tp with ulysses_degree={r.ulysses}, ring_degree={r.ring}: tensor and context parallelism "
                  "are not combined in one replica; set ulysses_degree=1 ring_degree=1 (or use a cp_* strategy)")
        if r.tp < 2:
            _fail(f"strategy=tp needs tp_degree >= 2 (got {r.tp}); e.g. strategy=tp tp_degree=2, or strategy=dp")
    if name in CP_STRATEGIES and r.tp > 1:
        _fail(f"strategy={name} with tp_degree={r.tp}: context and tensor parallelism are not combined in one "
              "replica; set tp_degree=1 (or use strategy=tp)")
    if name == "cp_ulysses" and (r.ulysses < 2 or r.ring != 1):
        _fail(f"strategy=cp_ulysses needs ulysses_degree >= 2 and ring_degree=1 (got {r.ulysses}/{r.ring}); "
              "e.g. strategy=cp_ulysses ulysses_degree=2, or strategy=cp_unified for both")
    if name == "cp_ring" and (r.ring < 2 or r.ulysses != 1):
        _fail(f"strategy=cp_ring needs ring_degree >= 2 and ulysses_degree=1 (got {r.ring}/{r.ulysses}); "
              "e.g. strategy=cp_ring ring_degree=2, or strategy=cp_unified for both")
    if name == "cp_unified" and cp < 2:
        _fail("strategy=cp_unified needs ring_degree x ulysses_degree >= 2; e.g. ring_degree=2 ulysses_degree=2")
    if r.ulysses_anything and not (name in CP_STRATEGIES and r.ulysses > 1 and r.ring == 1):
        _fail("strategy.ulysses_anything=true needs a Ulysses-only replica (strategy=cp_ulysses, ulysses_degree >= 2, "
              "ring_degree=1); set it to false")
    if r.ring_anything and not (name in CP_STRATEGIES and r.ring > 1 and r.ulysses == 1):
        _fail("strategy.ring_anything=true needs a ring-only replica (strategy=cp_ring, ring_degree >= 2, "
              "ulysses_degree=1); set it to false")
    if name == "device_map" and (r.tp, r.ulysses, r.ring) != (1, 1, 1):
        _fail("strategy=device_map spreads one process over several GPUs and ignores tp/ulysses/ring degrees; "
              "set them to 1")
    if name == "device_map" and r.gpus_per_replica < 1:
        _fail(f"strategy.gpus_per_replica={r.gpus_per_replica}: use 1 or more")


def _check_devices(r: Request, dims: ParallelDims, facts: DeviceFacts, cfg: Any) -> None:
    """Enough devices of the right kind for the ranks (and, for device_map, the GPUs each one spans)."""
    if r.strategy == "device_map":
        if facts.type != "cuda":
            _fail(f"strategy=device_map spreads one replica over several GPUs, and {facts.where} has no CUDA GPU "
                  "(CPU only); on CPU use strategy=dp (or strategy=tp / cp_ulysses with launcher=local to debug)")
        if cfg.model.weights == "dummy" and r.gpus_per_replica > 1:
            _fail("model.weights=dummy builds the whole pipeline on one GPU; with strategy=device_map use "
                  "strategy.gpus_per_replica=1 (or pretrained weights to spread the transformer over several GPUs)")
        need = facts.local_ranks * r.gpus_per_replica
        if need > facts.count:
            _fail(f"strategy=device_map with strategy.gpus_per_replica={r.gpus_per_replica} and {facts.local_ranks} "
                  f"rank(s) per node needs {need} GPUs, but {facts.where} has {facts.count}; lower "
                  "strategy.gpus_per_replica or launch fewer ranks per node")
        return
    if facts.type == "cuda" and facts.local_ranks > facts.count:
        _fail(f"{facts.local_ranks} ranks per node need one GPU each, but {facts.where} has {facts.count}; launch at "
              f"most {facts.count} ranks per node")
    several_nodes = dims.world_size > facts.local_ranks
    if r.strategy == "tp" and facts.type == "cuda" and several_nodes and facts.local_ranks != facts.count:
        # diffusers puts rank r's shard on GPU r % (GPUs per node): right only with one rank per GPU on every node
        _fail(f"strategy=tp over several nodes needs one rank per GPU on every node (diffusers places rank r on GPU "
              f"r % {facts.count}), but there are {facts.local_ranks} ranks per node; launch {facts.count} per node")
    if r.strategy == "tp" and facts.type == "cpu" and cfg.launcher.name != "slurm":
        import torch

        if torch.cuda.is_available():  # diffusers places each rank's shard on the accelerator, not on our device
            _fail("strategy=tp with device=cpu on a machine with a visible CUDA GPU: diffusers would put the shards "
                  "on the GPU; use device=cuda, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to try tp on CPU")


def _check_model(r: Request, info: TransformerInfo) -> None:
    """The transformer class can be split this way, and its heads divide by the degrees."""
    if r.strategy == "tp":
        if info.plan("tp") is None:
            _fail(f"strategy=tp: {info.cls_name} has no _tp_plan in this diffusers, so it cannot be tensor-parallel; "
                  "use strategy=device_map to spread it over GPUs, or a cp_* strategy")
        if info.heads and info.heads % r.tp:
            _fail(f"tp_degree={r.tp} does not divide the {info.heads} attention heads of {info.cls_name} "
                  f"(from {info.source}); use a tp_degree among {_divisors(info.heads)}")
    if r.strategy in CP_STRATEGIES:
        if info.plan("cp") is None:
            _fail(f"strategy={r.strategy}: {info.cls_name} has no _cp_plan in this diffusers, so its sequence cannot "
                  "be split; use strategy=tp or device_map")
        if r.ulysses > 1 and info.heads and info.heads % r.ulysses and not r.ulysses_anything:
            _fail(f"ulysses_degree={r.ulysses} does not divide the {info.heads} attention heads of {info.cls_name} "
                  f"(from {info.source}); use one of {_divisors(info.heads)}, or strategy.ulysses_anything=true")


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


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


def _check_attention(r: Request, facts: DeviceFacts, dtype: str) -> str:
    """The attention backend for a CP replica (configured, or the device's default), checked; returns it."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    needs_lse = r.ring > 1
    name = _check_backend_name(r.attention_backend or default_attention_backend(facts.type, needs_lse))
    cp_ok = sorted(_AttentionBackendRegistry._supports_context_parallel)
    if name not in cp_ok:
        _fail(f"strategy.attention_backend={name!r} does not support context parallelism; use one of {cp_ok}")
    what = "ring attention" if r.strategy == "cp_ring" else f"strategy={r.strategy} with ring_degree={r.ring}"
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


def _check_sequence(r: Request, cfg: Any, facts: DeviceFacts) -> None:
    """Each sequence the transformer splits (image tokens, text tokens) divides by the CP degree, unless an
    anything-variant is on; those split unevenly only on GPUs (gloo cannot all-gather pieces of unequal size)."""
    n = r.ulysses * r.ring
    image, text = sequence_tokens(cfg)
    anything = r.ulysses_anything or r.ring_anything
    variant = "strategy.ulysses_anything=true" if r.ring == 1 else "strategy.ring_anything=true" if r.ulysses == 1 \
        else None
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
            frames = "latent frames x " if cfg.get("num_frames") is not None else ""
            hint = (f"num_frames/height/width giving {frames}(H/16)*(W/16) divisible by {n}" if what == "image" else
                    f"model.max_sequence_length divisible by {n}")
            _fail(f"{what} tokens = {tokens} ({_token_rule(what, cfg)}) do not divide by the CP degree "
                  f"{n} (ulysses {r.ulysses} x ring {r.ring}); use {hint}{fix}")


def latent_frames(cfg: Any) -> int:
    """Frames the transformer sees: Wan's VAE compresses num_frames = 4k+1 into k+1 (1 for image models)."""
    n = cfg.get("num_frames")
    return 1 if n is None else (n - 1) // 4 + 1


def _token_rule(what: str, cfg: Any) -> str:
    if what == "image" and cfg.get("num_frames") is not None:
        return (f"{latent_frames(cfg)} latent frames of num_frames={cfg.num_frames} x {cfg.height}/{LATENT_PATCH} x "
                f"{cfg.width}/{LATENT_PATCH}")
    if what == "image":
        return f"{cfg.height}/{LATENT_PATCH} x {cfg.width}/{LATENT_PATCH}"
    return "model.max_sequence_length"


def validate_request(cfg: Any, r: Request, world_size: int, facts: DeviceFacts,
                     info_fn: Callable[[Any], TransformerInfo] = transformer_info) -> StrategyDims:
    """Every check of a strategy request, in order; the degrees to build the mesh from."""
    _check_degrees(r)
    dims = StrategyDims(world_size=world_size, tp=r.tp, ulysses=r.ulysses, ring=r.ring, strategy=r.strategy,
                        gpus_per_replica=r.gpus_per_replica if r.strategy == "device_map" else 1,
                        ulysses_anything=r.ulysses_anything, ring_anything=r.ring_anything)
    _check_devices(r, dims, facts, cfg)
    if r.strategy == "tp" or r.strategy in CP_STRATEGIES:
        _check_model(r, info_fn(cfg.model))
    if r.strategy in CP_STRATEGIES:
        dims.attention_backend = _check_attention(r, facts, cfg.dtype)
        _check_sequence(r, cfg, facts)
    elif r.attention_backend:
        dims.attention_backend = _check_backend_name(r.attention_backend)
    return dims


def parallel_dims(cfg: Any, world_size: int) -> StrategyDims:
    """The degrees the strategy implies, validated against the world, the devices and the model's
    config (no weights touched); ``auto`` is resolved to its choice here."""
    name = cfg.strategy.name
    if name not in STRATEGY_MODULES:
        raise ParallelConfigError(f"strategy={name} is not available; choose one of {sorted(STRATEGY_MODULES)}")
    facts = device_facts(cfg, world_size)
    if name == "auto":
        from parallel.auto import decide

        return validate_request(cfg, decide(cfg, world_size, facts), world_size, facts)
    return validate_request(cfg, Request.from_cfg(cfg), world_size, facts)


def apply_strategy(cfg: Any, world, dims: ParallelDims, mesh) -> Any:
    """Build this rank's part of its replica's pipeline."""
    name = getattr(dims, "strategy", cfg.strategy.name)
    module = importlib.import_module(STRATEGY_MODULES[name])
    log.info("strategy %s: %d replica(s) of %d rank(s)%s", name, dims.dp, dims.replica_size,
             f" x {dims.gpus_per_replica} GPU(s)" if name == "device_map" else "")
    return module.apply(cfg, world, dims, mesh)
