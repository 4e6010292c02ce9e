"""Speed options for a built pipeline, applied once before its first call (``prepare``).

Exact (outputs change only by bf16 rounding noise):

- ``compile``: regional compilation, ``auto`` by default: on for a CUDA device with one GPU per replica
  (strategy dp), off on a CPU (the tiny model would pay ~40 s of compilation for nothing) and for the
  model-parallel strategies (not measured compiled). Every block whose class is in the transformer's
  ``_repeated_blocks`` (FLUX: 19 double-stream + 38 single-stream blocks) gets its ``forward``
  compiled with ``torch.compile(fullgraph=True, dynamic=False)`` (``compile_mode`` adds ``mode=``, e.g.
  ``max-autotune-no-cudagraphs``: autotuned GEMM templates, minutes per shape): one graph per block class, reused
  by all blocks of that class, so it compiles in seconds, like diffusers' ``compile_repeated_blocks``.
  The difference to ``compile_repeated_blocks`` (which compiles ``Module._call_impl``): diffusers'
  cache hooks (First-Block-Cache) replace a block's ``forward`` and must stay eager (they decide on
  the host whether to skip the remaining blocks); compiling the ``forward`` underneath them keeps the
  block bodies compiled when a cache is enabled.
- ``fused_blocks``: FLUX.1 blocks run shardgen/speed/flux_fused.py's forwards, which do q/k RMSNorm+RoPE in
  one Triton pass, the MLP GELU in the GEMM epilogue and the single blocks' ``proj_out`` without the
  concatenation; other transformers keep their own forward. With ``compile`` those forwards are what is
  compiled; without it (``compile=false``, a ``compile: auto`` process that stays eager or has not switched
  yet) they run eagerly on CUDA (H200, FLUX.1-dev batch 4: 3.95 s/image eager fused vs ~5.0 stock eager vs
  3.50 compiled). Off CUDA without ``compile`` the stock blocks run (the fused ones only help through the
  Triton kernel, and CPU runs keep diffusers' exact bytes).
- ``compile_tuning`` (with ``compile``, CUDA): inductor's coordinate-descent tuning of its Triton kernels.
- compiled artifacts are reused across processes: inductor's on-disk cache (FX graphs, Triton kernels,
  tuning results) lives in ``$SHARDGEN_CACHE/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set
  (``compile_cache_dir``), so a requeued job or a second process pays tracing, not code generation.
- Qwen-Image (shardgen/speed/qwen.py): prompt embeddings padded to a few text lengths (no recompilation
  per batch), RoPE on real tensors inside the compiled blocks, with ``fused_blocks`` on CUDA the joint
  attention without its key-padding mask (keys ordered [image, text], one unmasked SDPA call per run of equal
  text lengths: shardgen/speed/prefix_attention.py), and ``cfg_batching``: true CFG's conditional and
  unconditional transformer calls as one call.
- ``sdpa``: the kernel behind diffusers' default attention backend (torch SDPA). ``auto`` measures
  flash / efficient / cudnn once per process at the run's attention shape, checks each against the
  others, and puts the fastest first in SDPA's priority order (inside each pipeline call only, see
  ``sdpa_context``). Without it torch picks flash (FA2), which on an H100/H200 is slower than cuDNN's
  fused attention.

Opt-in, lossy (off by default, recorded in each sample's json under ``lossy``):

- ``first_block_cache``: diffusers' First-Block-Cache (``FirstBlockCacheConfig(threshold)``):
  when the first block's residual changed by less than ``threshold`` (relative) since the previous
  step, the remaining blocks are skipped and their cached residual reused. The decision is taken for
  the whole batch, so a sample's pixels then depend on which prompts share its batch.
- ``fp8``: the linear layers of the repeated blocks compute in float8 (e4m3) with ``torch._scaled_mm``:
  weights quantised once per output channel, activations per token at run time (row-wise scales),
  bf16 output. Needs compute capability 8.9+ (Ada, Hopper, Blackwell) for a real speed-up, and
  ``compile=true`` (eager, the quantisation kernels cost more than the faster matmul saves). The
  adaLN modulation layers and everything outside the blocks stay in bf16. The bf16 weights are
  kept, so it can be switched off again (memory: +1 byte per block weight).
  diffusers' ``enable_layerwise_casting(storage_dtype=float8)`` is not offered: it only stores weights
  in float8 and computes in bf16 (saves memory, costs time).

Everything is reversible and idempotent (``prepare`` brings a pipeline from whatever state it is in to
the asked one), so a benchmark can reconfigure one pipeline object between runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from shardgen.errors import UserError
from shardgen.families import family_of
from shardgen.pick import pick
from shardgen.speed.background import STATE_ATTR, BackgroundCompile, DeferredForward
from shardgen.speed.blocks import fused_blocks, repeated_blocks

log = logging.getLogger("shardgen.accel")

SDPA_CHOICES = ("auto", "default", "flash", "efficient", "cudnn", "math")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune")
SDPA_MARGIN = 0.95  # sdpa=auto leaves torch's flash kernel only for one at least 5% faster (stable choice)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_STATE_ATTR = "_shardgen_accel"


class AccelError(UserError, ValueError):
    """An acceleration option that cannot work here; the message says what to change."""


@dataclass(frozen=True)
class AccelOptions:
    """What ``prepare`` applies. Defaults = the plain pipeline (nothing touched)."""

    compile: bool = False
    """Resolved: ``compile: auto`` in the config becomes True or False in ``from_cfg``."""
    sdpa: str = "auto"
    first_block_cache: float = 0.0
    fp8: bool = False
    compile_mode: str = "default"
    fused_blocks: bool = True
    compile_tuning: bool = True
    cfg_batching: bool = False
    compile_background: bool = False
    """With ``compile``: the blocks run eagerly while their graphs are compiled on a background thread, and
    switch to them between two batches (shardgen/speed/background.py; what ``compile: auto`` does on CUDA)."""

    @classmethod
    def from_cfg(cls, cfg: Any, one_gpu_per_replica: bool = True) -> "AccelOptions":
        """The options of ``cfg``; ``one_gpu_per_replica``: whether the strategy that runs (``strategy=auto``
        resolved) makes a replica one rank on one GPU (``Strategy.one_gpu_per_replica``, parallel/registry.py)."""
        get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
        # the other fields are SpeedConfig's keys of the same name (shardgen/pick.py); a key absent from a partial
        # config keeps this class's default
        return pick(cls, cfg, compile=resolve_compile(get("compile", "auto"), str(get("device", "auto")),
                                                  one_gpu_per_replica),
                    sdpa=str(get("sdpa_backend", cls.sdpa)))

    @property
    def lossy(self) -> dict:
        """The lossy options that are on (empty when the output is exact)."""
        out = {}
        if self.first_block_cache > 0:
            out["first_block_cache"] = self.first_block_cache
        if self.fp8:
            out["fp8"] = True
        return out


def resolve_compile(value: Any, device: str = "auto", one_gpu_per_replica: bool = True) -> bool:
    """``compile`` as configured (true, false or auto) -> on or off for this run. ``auto``: on when the
    run's device is CUDA and each replica is one GPU (strategy dp: what compile=auto was measured on), off
    otherwise."""
    if isinstance(value, bool):
        return value
    if str(value).lower() != "auto":
        raise AccelError(f"compile={value!r}: use true, false or auto (on for CUDA with strategy dp, else off)")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return cuda and one_gpu_per_replica


def validate(opts: AccelOptions, device: torch.device | str | None = None) -> None:
    """Raise AccelError for an impossible option (no weights needed; call before loading)."""
    from shardgen.speed.autocompile import check_forced_path

    check_forced_path()
    if opts.sdpa not in SDPA_CHOICES:
        raise AccelError(f"sdpa_backend={opts.sdpa!r}: use one of {list(SDPA_CHOICES)}")
    if opts.compile_mode not in COMPILE_MODES:
        raise AccelError(f"compile_mode={opts.compile_mode!r}: use one of {list(COMPILE_MODES)}")
    if not 0.0 <= opts.first_block_cache < 1.0:
        raise AccelError(f"first_block_cache={opts.first_block_cache}: use 0 (off) or a threshold in (0, 1), "
                         "e.g. 0.05-0.2")
    if opts.fp8:
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            raise AccelError(f"fp8=true needs torch._scaled_mm and float8 dtypes (torch {torch.__version__} has not)")
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(dev)
            if cap < (8, 9):
                raise AccelError(f"fp8=true needs a GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell); "
                                 f"{torch.cuda.get_device_name(dev)} is {cap[0]}.{cap[1]}. Set fp8=false.")


# --- regional compilation ----------------------------------------------------------------------------

def _raise_recompile_limits() -> None:
    import torch._dynamo.config as dc

    # one entry per block class and per variant (fp8 on/off, the last partial batch of a shard);
    # the defaults (8) are low for a process that reconfigures one pipeline several times
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, max(getattr(dc, name), 64))
    if hasattr(dc, "accumulated_recompile_limit"):
        dc.accumulated_recompile_limit = max(dc.accumulated_recompile_limit, 1024)


def compile_cache_dir() -> str:
    """Where inductor keeps compiled artifacts: ``TORCHINDUCTOR_CACHE_DIR`` if set, else
    ``$SHARDGEN_CACHE/inductor`` (``~/.cache/shardgen/inductor``), set for this process before its first
    compilation. Inductor writes every entry to a temporary file and renames it into place, so processes
    on several nodes can share the directory on NFS/Lustre; a key covers the graph, the torch version and
    the GPU, so a stale or foreign entry is never used, only missed."""
    import os

    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        from shardgen.models.tiny import default_cache_dir

        path = default_cache_dir() / "inductor"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_blocks(transformer: torch.nn.Module, mode: str = "default", fused: bool = False,
                   tuning: bool = False, background: bool = False) -> int:
    """Compile each repeated block's ``forward`` in place (idempotent); how many blocks. ``mode`` is
    torch.compile's (``default`` passes none: inductor's default mode). ``fused``: FLUX blocks compile
    shardgen/speed/flux_fused.py's forwards instead of their own (other models: ignored). ``tuning``:
    inductor's coordinate-descent tuning of its Triton kernels (process-wide; more compile time).
    ``background``: the blocks stay eager until a background thread has compiled their graphs
    (shardgen/speed/background.py)."""
    blocks = repeated_blocks(transformer)
    if not blocks:
        raise AccelError(f"compile=true: {type(transformer).__name__} declares no _repeated_blocks to compile "
                         "regionally; set compile=false")
    _raise_recompile_limits()
    compile_cache_dir()
    if tuning:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    todo = [b for b in blocks if "_shardgen_eager_forward" not in b.__dict__]
    for block in todo:
        if not _plain_forward(block):  # a hook wraps forward: compiling it would compile the hook
            raise AccelError(f"compile=true: {type(block).__name__}.forward is already wrapped (a hook?); "
                             "compile before adding hooks")
    forwards = {}
    module = fused_blocks(transformer)
    if fused and len(todo) == len(blocks) and module is not None and module.COMPILED:
        forwards = module.enable(transformer)
    state = None
    if background and todo:
        # made earlier when compile=auto decided before the first batch (it starts at the first step)
        state = transformer.__dict__.setdefault(STATE_ATTR, BackgroundCompile())
    for block in todo:
        block.__dict__["_shardgen_eager_forward"] = block.forward
        target = forwards.get(block, block.forward)
        compiled = _compiled(target, mode)
        if state is not None:
            compiled = DeferredForward(block, target, compiled, state)
        block.forward = compiled
    return len(blocks)


def fuse_blocks_eager(transformer: torch.nn.Module) -> int:
    """Run FLUX.1's fused block forwards (shardgen/speed/flux_fused.py) eagerly, in place; how many blocks
    (0: not applicable, nothing touched). ``uncompile_blocks`` restores the stock blocks."""
    module = fused_blocks(transformer)
    if module is None or _blocks_replaced(transformer):
        return 0  # compiled or fused already
    if not all(_plain_forward(b) for b in repeated_blocks(transformer)):
        # a hook wraps the blocks (accelerate's device placement under device_map): replacing forward would drop it
        log.info("fused blocks not used eagerly: a hook wraps the blocks' forward")
        return 0
    forwards = module.enable(transformer)
    for block, fused in forwards.items():
        block.__dict__["_shardgen_eager_forward"] = block.forward
        block.forward = fused
    return len(forwards)


def _blocks_replaced(transformer: torch.nn.Module) -> bool:
    """Whether the repeated blocks run a forward set here (compiled or fused), not their own."""
    return any("_shardgen_eager_forward" in b.__dict__ for b in repeated_blocks(transformer))


def _fused_eager(opts: AccelOptions, device: Any) -> bool:
    """Whether ``opts`` run the fused FLUX.1 forwards without compiling them (CUDA only: see the module doc)."""
    return opts.fused_blocks and not opts.compile and device is not None and torch.device(device).type == "cuda"


def _compiled(target, mode: str):
    """``target`` wrapped by ``torch.compile`` with the blocks' options (the same options give backend objects
    that compare equal, so every wrapper shares the graphs compiled by any of them)."""
    if mode == "default":
        return torch.compile(target, fullgraph=True, dynamic=False)
    # autotuned GEMM templates with fused epilogues (minutes of compilation per shape)
    return torch.compile(target, fullgraph=True, dynamic=False, mode=mode)


def _plain_forward(block: torch.nn.Module) -> bool:
    """True when ``block.forward`` is its class's own method (diffusers leaves the bound method as an
    instance attribute after removing its hooks; that counts as plain)."""
    f = block.__dict__.get("forward")
    return f is None or (getattr(f, "__self__", None) is block and getattr(f, "__func__", None) is type(block).forward)


def uncompile_blocks(transformer: torch.nn.Module) -> None:
    module = fused_blocks(transformer)
    if module is not None:
        module.disable(transformer)
    transformer.__dict__.pop(STATE_ATTR, None)
    for block in repeated_blocks(transformer):
        if "_shardgen_eager_forward" in block.__dict__:
            block.__dict__.pop("_shardgen_eager_forward")
            block.__dict__.pop("forward", None)


# --- float8 linear layers ------------------------------------------------------------------------------

class Float8Linear(torch.nn.Module):
    """``nn.Linear`` computing ``x @ W.T + b`` in float8 e4m3: W quantised per output channel once,
    x per row (token) on every call, products accumulated in fp32 by ``torch._scaled_mm``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # (out, 1)
        self.register_buffer("weight_fp8", (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, out), float32
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        object.__setattr__(self, "_original", linear)  # kept (not a submodule) to switch fp8 off again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        scale_a = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (tokens, 1)
        xq = (x2.float() / scale_a).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        out = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=scale_a, scale_b=self.weight_scale,
                               out_dtype=out_dtype)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn row-wise"


def _fp8_candidates(transformer: torch.nn.Module):
    """(parent, attribute, linear) for each block linear worth quantising."""
    for block in repeated_blocks(transformer):
        for name, mod in block.named_modules():
            if not isinstance(mod, torch.nn.Linear) or "norm" in name:  # adaLN modulation stays bf16
                continue
            if mod.in_features % 16 or mod.out_features % 16:  # _scaled_mm's shape rule
                continue
            parent_name, _, attr = name.rpartition(".")
            yield block.get_submodule(parent_name) if parent_name else block, attr, mod


def enable_fp8(transformer: torch.nn.Module) -> int:
    n = 0
    for parent, attr, lin in list(_fp8_candidates(transformer)):
        setattr(parent, attr, Float8Linear(lin))
        n += 1
    return n


def disable_fp8(transformer: torch.nn.Module) -> int:
    n = 0
    for block in repeated_blocks(transformer):
        for name, mod in list(block.named_modules()):
            if isinstance(mod, Float8Linear):
                parent_name, _, attr = name.rpartition(".")
                setattr(block.get_submodule(parent_name) if parent_name else block, attr, mod._original)
                n += 1
    return n


def fp8_enabled(transformer: torch.nn.Module) -> bool:
    return any(isinstance(m, Float8Linear) for m in transformer.modules())


# --- First-Block-Cache ---------------------------------------------------------------------------------

def _cache_enabled(transformer) -> bool:
    return bool(getattr(transformer, "is_cache_enabled", False))


def enable_first_block_cache(transformer, threshold: float) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    if not hasattr(transformer, "enable_cache"):
        raise AccelError(f"first_block_cache: {type(transformer).__name__} has no diffusers cache support; set 0")
    transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))


def disable_cache(transformer) -> None:
    if _cache_enabled(transformer):
        transformer.disable_cache()


# --- attention kernel ---------------------------------------------------------------------------------

def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


_SDPA_CHOICE: dict[tuple, tuple[str, dict]] = {}


def chosen_sdpa() -> dict[str, tuple[str, dict]]:
    """The attention kernels ``sdpa=auto`` chose in this process: (device, dtype, shape) -> (kernel, timings)."""
    return {str(k): v for k, v in _SDPA_CHOICE.items()}


def measure_sdpa(device: torch.device, dtype: torch.dtype, batch: int, heads: int, seq: int, head_dim: int,
                 iters: int = 5) -> dict:
    """ms per call of each fused SDPA kernel on (batch, heads, seq, head_dim) in diffusers' layout,
    and its largest deviation from the first kernel that ran (a broken kernel is not chosen)."""
    from torch.nn.attention import sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).permute(0, 2, 1, 3)
               for _ in range(3))
    res, ref = {}, None
    for name in ("flash", "cudnn", "efficient"):
        try:
            with sdpa_kernel([_backend(name)]):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v)
                end.record()
                end.synchronize()
            err = 0.0 if ref is None else float((out.float() - ref).abs().max())
            ref = out.float() if ref is None else ref
            res[name] = {"ms": start.elapsed_time(end) / iters, "max_abs_diff": err}
        except Exception as e:  # not available for this device/shape/dtype
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return res


def choose_sdpa(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> tuple[str, dict]:
    """The fastest correct fused kernel for this attention shape (measured once per process)."""
    key = (str(device), dtype, shape[1:])  # chosen once per run: the last, smaller batch keeps the kernel
    if key not in _SDPA_CHOICE:
        timings = measure_sdpa(device, dtype, *shape)
        ok = {n: t for n, t in timings.items() if "ms" in t and t["max_abs_diff"] < 0.05}
        best = min(ok, key=lambda n: ok[n]["ms"]) if ok else "default"
        if best != "flash" and "flash" in ok and ok[best]["ms"] > SDPA_MARGIN * ok["flash"]["ms"]:
            best = "flash"  # torch's own first choice, unless another kernel is clearly faster
        _SDPA_CHOICE[key] = (best, timings)
        log.info("attention kernel for %s: %s (%s)", shape, best,
                 ", ".join(f"{n} {t['ms']:.2f} ms" for n, t in timings.items() if "ms" in t))
    return _SDPA_CHOICE[key]


def attention_shape(pipe, height: int, width: int, batch: int, text_tokens: int) -> tuple[int, int, int, int] | None:
    """(batch, heads, tokens, head_dim) of the transformer's joint attention, from its config."""
    tr = getattr(pipe, "transformer", None)
    cfg = getattr(tr, "config", None)
    if cfg is None or "num_attention_heads" not in cfg or "attention_head_dim" not in cfg:
        return None
    factor = getattr(pipe, "vae_scale_factor", 8) * 2  # latents packed in 2x2 patches
    tokens = (height // factor) * (width // factor) + text_tokens
    return batch, int(cfg.num_attention_heads), int(tokens), int(cfg.attention_head_dim)


def sdpa_context(pipe, opts: AccelOptions, shape: tuple[int, int, int, int] | None):
    """A context for one pipeline call that puts the chosen SDPA kernel first (a no-op off CUDA, with
    ``sdpa=default``, or when the transformer uses another diffusers attention backend)."""
    from torch.nn.attention import sdpa_kernel

    device = getattr(pipe, "_execution_device", None) or getattr(pipe, "device", None)
    if opts.sdpa == "default" or device is None or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    if opts.sdpa == "math":
        name = "math"
    elif opts.sdpa == "auto":
        if shape is None or not _uses_native_attention(pipe.transformer):
            return contextlib.nullcontext()
        name, _ = choose_sdpa(torch.device(device), pipe.transformer.dtype, shape)
        if name == "default":
            return contextlib.nullcontext()
    else:
        name = opts.sdpa
    order = [name] + [n for n in ("flash", "cudnn", "efficient", "math") if n != name]
    try:
        return sdpa_kernel([_backend(n) for n in order], set_priority=True)
    except TypeError:  # torch without set_priority: the chosen kernel only (and math as a fallback)
        return sdpa_kernel([_backend(name), _backend("math")])


def _uses_native_attention(transformer) -> bool:
    """True when no non-default diffusers attention backend was set (then torch SDPA does the work);
    looked up once per transformer (strategies set backends before the first call)."""
    cached = transformer.__dict__.get("_shardgen_native_attention")
    if cached is None:
        cached = transformer.__dict__["_shardgen_native_attention"] = _scan_native_attention(transformer)
    return cached


def _scan_native_attention(transformer) -> bool:
    for mod in transformer.modules():
        processor = getattr(mod, "processor", None)
        backend = getattr(processor, "_attention_backend", None)
        if backend is not None and str(getattr(backend, "value", backend)) not in ("native",):
            return False
    return True


# --- the entry point ----------------------------------------------------------------------------------

def family_speed_hooks(pipe):
    """The speed hooks the pipeline's family names (``ModelFamily.speed_hooks``), or None."""
    import importlib

    family = family_of(pipe)
    if family is None or not family.speed_hooks:
        return None
    module, _, name = family.speed_hooks.partition(":")
    return getattr(importlib.import_module(module), name)


def current(pipe) -> AccelOptions | None:
    return getattr(pipe, _STATE_ATTR, None)


def _compile_settings(opts: AccelOptions) -> tuple:
    """What the compiled blocks depend on (a change means compiling them again)."""
    return opts.compile_mode, opts.fused_blocks, opts.compile_tuning, opts.compile_background


def prepare(pipe, opts: AccelOptions) -> dict:
    """Bring ``pipe`` to ``opts`` (no-op when it already is); returns what was done, with timings.

    With all options at their defaults this touches nothing (the exact diffusers pipeline runs).
    Compilation itself happens lazily at the first call (torch.compile); its time shows up there.
    """
    if current(pipe) == opts:
        return {}
    tr = getattr(pipe, "transformer", None)
    device = getattr(pipe, "_execution_device", None)
    validate(opts, device)
    done: dict[str, Any] = {}
    t0 = time.perf_counter()
    if tr is None:
        if opts.compile or opts.fp8 or opts.first_block_cache:
            raise AccelError(f"{type(pipe).__name__} has no transformer: compile/fp8/first_block_cache do not apply")
        setattr(pipe, _STATE_ATTR, opts)
        return done
    was = current(pipe) or AccelOptions()
    # hooks come off first: compilation must go underneath them
    if _cache_enabled(tr):
        disable_cache(tr)
    if opts.fp8 != fp8_enabled(tr):
        done["fp8_layers"] = enable_fp8(tr) if opts.fp8 else -disable_fp8(tr)
    recompile = _compile_settings(was) != _compile_settings(opts)
    was_fused = not was.compile and _blocks_replaced(tr)  # what the blocks run now, not what was asked
    fused = _fused_eager(opts, device)
    if (was.compile and (not opts.compile or recompile)) or (was_fused and not fused):
        uncompile_blocks(tr)
    if fused and not was_fused:
        done["fused_eager_blocks"] = fuse_blocks_eager(tr)
    if opts.compile and (not was.compile or recompile):
        cuda = device is not None and torch.device(device).type == "cuda"
        done["compiled_blocks"] = compile_blocks(tr, opts.compile_mode, fused=opts.fused_blocks,
                                                 tuning=opts.compile_tuning and cuda,
                                                 background=opts.compile_background)
    if opts.first_block_cache > 0:
        enable_first_block_cache(tr, opts.first_block_cache)
        done["first_block_cache"] = opts.first_block_cache
    hook = family_speed_hooks(pipe)
    if hook is not None:  # the family's own hooks (Qwen-Image's)
        done.update(hook(pipe, opts))
    done["prepare_s"] = round(time.perf_counter() - t0, 3)
    setattr(pipe, _STATE_ATTR, opts)
    if opts != AccelOptions(sdpa=opts.sdpa):
        log.info("accelerations %s applied: %s", asdict(opts), done)
    return done
