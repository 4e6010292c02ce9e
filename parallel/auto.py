"""strategy=auto: pick dp / device_map / tp / cp from the model size, free device memory, sequence length
and device count, and log one line per reason; parallel/strategies.py then applies the choice.

The table (docs/strategies.md has it with its sources); the first row that matches wins:

1. no CUDA GPU                                         -> dp (model parallelism only pays off on GPUs)
2. whole pipeline + one batch's activations fit a GPU  -> dp (no communication: the fastest for batches)
3. weights + VAE decode fit, the transformer's         -> cp_ulysses (heads and tokens divide by the degree),
   activations do not (long sequences), several ranks     else cp_ring (an LSE backend, bf16/fp16)
4. the transformer (+ activations) fits, the encoders  -> device_map on 1 GPU, staged (offload the encoders
   do not                                                  between encoding and denoising)
5. the transformer does not fit, several ranks,        -> tp, the smallest degree whose shard fits
   the class has a _tp_plan
6. the transformer does not fit, one process with      -> device_map over the fewest GPUs that fit
   several GPUs
7. otherwise                                           -> an error saying what would make it fit
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parallel.dims import ParallelConfigError, ParallelDims, divisors
from parallel.transformer import HALF_DTYPES, SequenceShape, transformer_info
from parallel.world import on_rank0_then_share
from shardgen.config.launchers import launcher_of
from shardgen.config.sizes import GiB

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig

log = logging.getLogger("shardgen.auto")
USABLE = 0.9            # of a GPU's free memory a plan may fill
TRANSFORMER_ACT = 16    # live activation tensors of width hidden per token in a DiT block (MLP 4x, q/k/v, residuals)
VAE_ACT = 6 * 128       # VAE decoder: ~6 live full-resolution maps of 128 channels per image


@dataclass(frozen=True)
class AutoInputs:
    """Everything auto decides from (no device or file access: ``choose`` is pure)."""

    device_type: str
    device_count: int
    """GPUs per node."""
    world_size: int
    free_bytes: int | None
    """Free memory of one GPU (None: unknown)."""
    transformer_bytes: int
    other_bytes: int
    """Text encoders + VAE in the run's dtype."""
    image_tokens: int
    text_tokens: int | None
    heads: int | None
    hidden: int
    """Transformer width (config.json's, or the model family's ``hidden_default`` when it does not say)."""
    height: int
    width: int
    batch_size: int
    dtype_bytes: int
    half_dtype: bool
    has_tp_plan: bool
    has_cp_plan: bool
    true_cfg: bool = False
    """The pipeline runs true CFG (two transformer branches per step)."""
    can_stage: bool = True
    """strategy=device_map can run the model (its family says how it encodes prompts: ``encode_outputs``)."""
    fp8_transformer_bytes: int | None = None
    """fp8=true: the transformer's bytes once its block layers are float8 (``fp8.converted_bytes``); None: fp8 off.
    It loads in the run's dtype first (``transformer_bytes``), then is converted in place, layer by layer."""

    @property
    def resident_transformer_bytes(self) -> int:
        """The transformer's bytes while it generates (float8 layers with fp8=true)."""
        return self.fp8_transformer_bytes or self.transformer_bytes

    def dit_bytes(self, cp_degree: int = 1) -> int:
        """One batch's peak transformer activations (split over the CP degree)."""
        tokens = self.image_tokens + (self.text_tokens or 0)
        return self.batch_size * tokens * self.hidden * self.dtype_bytes * TRANSFORMER_ACT // cp_degree

    def vae_bytes(self) -> int:
        """One batch's peak VAE-decode activations (context parallelism does not split them)."""
        return self.batch_size * self.height * self.width * VAE_ACT * self.dtype_bytes

    def activation_bytes(self, cp_degree: int = 1) -> int:
        return max(self.dit_bytes(cp_degree), self.vae_bytes())


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _pick(x: AutoInputs, strategy: str, **degrees: int) -> ParallelDims:
    return ParallelDims(world_size=x.world_size, strategy=strategy, **degrees)


def _choose_cfg(x: AutoInputs, room: int, why: list[str]) -> ParallelDims:
    """A true-CFG model whose pipeline fits one GPU: both branches batched in one call where their activations fit
    (best throughput, no communication), else CFG parallel over rank pairs (one branch's activations per GPU,
    half the latency per image), tried before context parallelism."""
    both = 2 * x.dit_bytes()
    if both <= room or x.world_size % 2:
        why.append("the whole pipeline fits one GPU: dp; true CFG's two branches run on the same GPU (batched in one "
                   "transformer call where they fit: the best throughput, no communication)" +
                   ("" if both <= room else f"; cfg_degree=2 would need an even number of ranks ({x.world_size})"))
        return _pick(x, "dp")
    why.append(f"true CFG with both branches batched needs ~{_gib(both)} of transformer activations, more than the "
               f"{_gib(room)} left: cfg_degree=2 (one branch per rank of a pair, one latents-sized all-gather per step, "
               "half the latency per image), before context parallelism")
    return _pick(x, "dp", cfg=2)


def choose(x: AutoInputs) -> tuple[ParallelDims, list[str]]:
    """The strategy and degrees for ``x`` and the reasons, one line each."""
    why = []
    if x.device_type != "cuda" or not x.free_bytes:
        why.append(f"no CUDA GPU here ({x.device_type}): model parallelism only pays off on GPUs, so dp (a full "
                   f"pipeline per rank, {x.world_size} replica(s))")
        return _pick(x, "dp"), why
    budget = x.free_bytes * USABLE
    loading = x.transformer_bytes + x.other_bytes  # fp8 converts the transformer after it loads in the run's dtype
    weights = x.resident_transformer_bytes + x.other_bytes
    act = x.activation_bytes()
    why.append(f"model: transformer {_gib(x.transformer_bytes)} + text encoders/VAE {_gib(x.other_bytes)} in the run's "
               f"dtype; a batch of {x.batch_size} at {x.height}x{x.width} = {x.image_tokens} image + "
               f"{x.text_tokens or '?'} text tokens needs ~{_gib(act)} of activations")
    if x.fp8_transformer_bytes:
        why.append(f"fp8=true: the transformer holds {_gib(x.fp8_transformer_bytes)} once its block layers are float8 "
                   f"(converted in place after it loads: {_gib(loading)} of weights at the peak of loading)")
    why.append(f"devices: {x.world_size} rank(s), {x.device_count} GPU(s) per node, {_gib(x.free_bytes)} free per GPU "
               f"(plans use {USABLE:.0%}: {_gib(budget)})")
    if weights + act <= budget and loading <= budget:
        if x.true_cfg:
            return _choose_cfg(x, budget - weights, why), why
        why.append("the whole pipeline fits one GPU: dp, the fastest for batch generation (no communication, every "
                   "GPU on its own prompts)")
        return _pick(x, "dp"), why
    if weights + x.vae_bytes() <= budget and x.world_size > 1 and x.has_cp_plan:
        why.append(f"the weights and the VAE decode fit one GPU, the transformer's activations "
                   f"({_gib(x.dit_bytes())} for {x.image_tokens + (x.text_tokens or 0)} tokens) do not")
        cp = _choose_cp(x, budget - weights, why)
        if cp is not None:
            return cp, why
    if x.resident_transformer_bytes + act <= budget and x.transformer_bytes <= budget and x.can_stage:
        why.append(f"the transformer fits one GPU but not with the text encoders ({_gib(max(weights + act, loading))} "
                   f"> {_gib(budget)}): device_map on 1 GPU, staged (encode, offload the encoders, denoise, decode; an "
                   "encoder too large to sit beside the transformer is streamed in layer by layer)")
        return _pick(x, "device_map", gpus_per_replica=1), why
    why.append(f"the transformer alone ({_gib(x.transformer_bytes)} + activations) does not fit one GPU")
    if x.world_size > 1 and x.has_tp_plan:
        for k in divisors(x.world_size):
            if (x.heads is None or x.heads % k == 0) and x.transformer_bytes / k + x.other_bytes + act <= budget:
                why.append(f"tp_degree={k}: the smallest degree dividing the {x.world_size} ranks and the {x.heads} "
                           f"heads whose shard ({_gib(x.transformer_bytes / k)}) fits next to the encoders; each rank "
                           "reads only its shard")
                return _pick(x, "tp", tp=k), why
        why.append(f"no tp_degree dividing {x.world_size} ranks and {x.heads} heads makes a shard fit")
    if x.world_size == 1 and x.device_count > 1 and x.can_stage:
        for g in range(2, x.device_count + 1):
            if x.transformer_bytes / g + act <= budget:
                why.append(f"one process with {x.device_count} GPUs: device_map over {g} GPU(s) (balanced), the "
                           "encoders resident where they fit, else offloaded between batches")
                return _pick(x, "device_map", gpus_per_replica=g), why
    raise ParallelConfigError(
        "strategy=auto found no way to fit the model: " + "; ".join(why) + ". Launch more ranks (tp), give one "
        "process several GPUs (device_map, launcher with one rank per node), lower batch_size, or use a smaller dtype")


def _choose_cp(x: AutoInputs, room: float, why: list[str]) -> ParallelDims | None:
    """The smallest CP degree (dividing the world) whose share of the activations fits in ``room``."""
    tokens = [t for t in (x.image_tokens, x.text_tokens) if t is not None]
    for k in divisors(x.world_size):
        if x.dit_bytes(k) > room:
            continue
        if all(t % k == 0 for t in tokens) and len(tokens) == 2:
            if x.heads is None or x.heads % k == 0:
                why.append(f"cp_ulysses ulysses_degree={k}: the {x.heads} heads and the token counts divide by it")
                return _pick(x, "cp_ulysses", ulysses=k)
            if x.half_dtype:
                why.append(f"{k} does not divide the {x.heads} heads: cp_ring ring_degree={k} (cuDNN attention "
                           "returns the LSE ring attention needs)")
                return _pick(x, "cp_ring", ring=k)
    why.append("no CP degree dividing the ranks splits the sequence evenly and makes it fit")
    return None


# --- gathering the inputs (rank 0) ------------------------------------------------------------------------

def gather_inputs(cfg: GenerateConfig, world_size: int, facts, sequence: SequenceShape) -> AutoInputs:
    """AutoInputs for this run on these devices (reads config files and safetensors headers only)."""
    import torch

    from shardgen.models.loader import component_params, torch_dtype

    nbytes = torch_dtype(cfg.dtype).itemsize
    # what activations are sized from: an edit model's input tokens are in the sequence too
    image, text, family = sequence.with_input, sequence.text, sequence.family
    if facts.type != "cuda":  # the first rule decides: no need to size the model
        return AutoInputs(device_type=facts.type, device_count=0, world_size=world_size, free_bytes=None,
                          transformer_bytes=0, other_bytes=0, image_tokens=image, text_tokens=text, heads=None,
                          hidden=family.hidden_default, height=cfg.height, width=cfg.width,
                          batch_size=cfg.batch_size, dtype_bytes=nbytes,
                          half_dtype=cfg.dtype in HALF_DTYPES, has_tp_plan=False, has_cp_plan=False)
    info = transformer_info(cfg.model)
    params = component_params(cfg.model)
    if params is None:
        raise ParallelConfigError(f"strategy=auto needs the model's size; model.source={cfg.model.source!r} is not a "
                                  "local diffusers directory: download it and point model.source there, or choose a "
                                  "strategy (e.g. strategy=dp)")
    free = torch.cuda.mem_get_info()[0]
    return AutoInputs(
        device_type=facts.type, device_count=facts.count, world_size=world_size, free_bytes=free,
        transformer_bytes=params.get("transformer", 0) * nbytes,
        other_bytes=sum(n for k, n in params.items() if k != "transformer") * nbytes,
        image_tokens=image, text_tokens=text, heads=info.heads,
        hidden=info.hidden or family.hidden_default, height=cfg.height, width=cfg.width,
        batch_size=cfg.batch_size, dtype_bytes=nbytes, half_dtype=cfg.dtype in HALF_DTYPES,
        has_tp_plan=info.plan("tp") is not None, has_cp_plan=info.plan("cp") is not None,
        true_cfg=cfg.model.true_cfg_scale > 1 and sequence.true_cfg,
        can_stage=family.encode_outputs is not None,
        fp8_transformer_bytes=_fp8_bytes(info, params.get("transformer", 0), nbytes) if cfg.fp8 else None)


def _fp8_bytes(info, params: int, nbytes: int) -> int | None:
    """The transformer's bytes with fp8=true: its architecture built on the meta device, each block linear that
    fp8 converts counted at one byte per weight; None when the class cannot be built here (sized as bf16)."""
    from shardgen.speed.fp8 import converted_bytes

    module = info.meta_module()
    if module is None:
        return None
    counted = sum(p.numel() for p in module.parameters())
    converted = converted_bytes(module, nbytes)
    # the checkpoint's own count where it differs from the architecture's (an extra tensor): kept in the dtype
    return converted + max(0, params - counted) * nbytes


def decide(cfg: GenerateConfig, world_size: int, facts, sequence: SequenceShape) -> ParallelDims:
    """Rank 0 chooses (so every rank applies the same choice) and logs why; every rank gets the choice."""
    if launcher_of(cfg).described_nodes:  # submitting: the nodes measure and choose when the job starts
        return ParallelDims(world_size=world_size, strategy="dp", cfg=cfg.cfg_degree)

    def _choose():
        dims, reasons = choose(gather_inputs(cfg, world_size, facts, sequence))
        if cfg.cfg_degree > 1 and dims.cfg == 1:  # asked for on the command line: kept on the chosen shape
            reasons.append(f"cfg_degree={cfg.cfg_degree} as asked, on top of the choice")
            dims = dataclasses.replace(dims, cfg=cfg.cfg_degree)
        for line in reasons:
            log.info("auto: %s", line)
        log.info("auto: applying strategy=%s", " ".join(filter(None, (dims.strategy, dims.describe()))))
        return dims

    return on_rank0_then_share(_choose)
