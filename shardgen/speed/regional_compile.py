"""``compile``: regional compilation, and the fused blocks a family may run instead (``fused_blocks``).

- ``compile``: ``auto`` by default: on for a CUDA device with one GPU per replica (strategy dp), off on a CPU
  (the tiny model would pay ~40 s of compilation for nothing) and for the model-parallel strategies (not measured
  compiled). Every block whose class is in the transformer's ``_repeated_blocks`` (FLUX: 19 double-stream + 38
  single-stream blocks) gets its ``forward`` compiled with ``torch.compile(fullgraph=True, dynamic=False)``
  (``compile_mode`` adds ``mode=``, e.g. ``max-autotune-no-cudagraphs``: autotuned GEMM templates, minutes per
  shape): one graph per block class, reused by all blocks of that class, so it compiles in seconds, like
  diffusers' ``compile_repeated_blocks``. The difference to ``compile_repeated_blocks`` (which compiles
  ``Module._call_impl``): diffusers' cache hooks (First-Block-Cache) replace a block's ``forward`` and must stay
  eager (they decide on the host whether to skip the remaining blocks); compiling the ``forward`` underneath
  them keeps the block bodies compiled when a cache is enabled.
- ``fused_blocks``: the blocks run the fused forwards their family names (``ModelFamily.fused_blocks``: FLUX.1
  shardgen/families/flux/fused.py, FLUX.2 flux2/fused.py, Qwen-Image qwen_image/fused.py): the memory-bound passes between
  the GEMMs (norms, modulation, RoPE, activations, gated residuals) in fewer passes. Without ``compile``
  (``compile=false``, a ``compile: auto`` process that stays eager or has not switched yet) they run eagerly on
  CUDA (H200, batch 4: FLUX.1-dev 3.70 s/image vs ~5.0 stock eager vs 3.59 compiled; FLUX.2-dev's and
  Qwen-Image's as fast as their compiled blocks). With ``compile`` a module whose ``COMPILED`` is true (FLUX.1's)
  has its forwards compiled; the others compile diffusers' own. Off CUDA without ``compile`` the stock blocks run
  (CPU runs keep diffusers' exact bytes).
- ``compile_tuning`` (with ``compile``, CUDA): inductor's coordinate-descent tuning of its Triton kernels.
- compiled artifacts are reused across processes: inductor's on-disk cache (FX graphs, Triton kernels, tuning
  results) lives in ``$SHARDGEN_CACHE/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set
  (``compile_cache_dir``), so a requeued job or a second process pays tracing, not code generation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from shardgen.cache import default_cache_dir
from shardgen.pick import pick
from shardgen.speed.blocks import fused_blocks, plain_forward, repeated_blocks
from shardgen.speed.techniques import AccelError, AccelOptions
from shardgen.speed.techniques import Step, Technique, register_technique

log = logging.getLogger("shardgen.accel")

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune")


@dataclass(frozen=True)
class CompileConfig:
    """The options this technique reads (AccelOptions' fields of the same names)."""

    compile: bool = False
    """Compile the repeated blocks (``compile: auto`` resolved)."""
    compile_mode: str = "default"
    """torch.compile's mode."""
    fused_blocks: bool = True
    """The family's fused block forwards (eager on CUDA; compiled too where the module's ``COMPILED`` says so)."""
    compile_tuning: bool = True
    """Inductor's coordinate-descent tuning (CUDA)."""

    @property
    def settings(self) -> tuple:
        """What the compiled blocks depend on (a change means compiling them again)."""
        return self.compile_mode, self.fused_blocks, self.compile_tuning


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
        path = default_cache_dir() / "inductor"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_blocks(transformer: torch.nn.Module, mode: str = "default", fused: bool = False,
                   tuning: bool = False) -> int:
    """Compile each repeated block's ``forward`` in place (idempotent); how many blocks. ``mode`` is
    torch.compile's (``default`` passes none: inductor's default mode). ``fused``: blocks compile their
    family's fused forwards where its module's ``COMPILED`` says so (FLUX.1's), else their own. ``tuning``:
    inductor's coordinate-descent tuning of its Triton kernels (process-wide; more compile time)."""
    blocks = repeated_blocks(transformer)
    if not blocks:
        raise AccelError(f"compile=true: {type(transformer).__name__} declares no _repeated_blocks to compile "
                         "regionally; set compile=false")
    _raise_recompile_limits()
    compile_cache_dir()
    import torch._inductor.config as inductor_config

    # process-wide: set either way, so a process that compiled tuned blocks and compiles again untuned (compile=auto
    # after compile=true in one test process) gets what it asked for
    inductor_config.coordinate_descent_tuning = tuning
    todo = [b for b in blocks if "_shardgen_eager_forward" not in b.__dict__]
    for block in todo:
        if not plain_forward(block):  # a hook wraps forward: compiling it would compile the hook
            raise AccelError(f"compile=true: {type(block).__name__}.forward is already wrapped (a hook?); "
                             "compile before adding hooks")
    forwards = {}
    module = fused_blocks(transformer)
    if fused and len(todo) == len(blocks) and module is not None and module.COMPILED:
        forwards = module.enable(transformer)
    for block in todo:
        block.__dict__["_shardgen_eager_forward"] = block.forward
        block.forward = _compiled(forwards.get(block, block.forward), mode)
    return len(blocks)


def fuse_blocks_eager(transformer: torch.nn.Module) -> int:
    """Run the family's fused block forwards (``blocks.fused_blocks``) eagerly, in place; how many blocks
    (0: not applicable, nothing touched). ``uncompile_blocks`` restores the stock blocks."""
    module = fused_blocks(transformer)
    if module is None or _blocks_replaced(transformer):
        return 0  # compiled or fused already
    if not all(plain_forward(b) for b in repeated_blocks(transformer)):
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


def _fused_eager(opts: CompileConfig, device: Any) -> bool:
    """Whether ``opts`` run the fused forwards without compiling them (CUDA only: see the module doc)."""
    return opts.fused_blocks and not opts.compile and device is not None and torch.device(device).type == "cuda"


def _compiled(target, mode: str):
    """``target`` wrapped by ``torch.compile`` with the blocks' options (the same options give backend objects
    that compare equal, so every wrapper shares the graphs compiled by any of them)."""
    if mode == "default":
        return torch.compile(target, fullgraph=True, dynamic=False)
    # autotuned GEMM templates with fused epilogues (minutes of compilation per shape)
    return torch.compile(target, fullgraph=True, dynamic=False, mode=mode)


def uncompile_blocks(transformer: torch.nn.Module) -> None:
    """The blocks' own forwards back (compiled or fused ones removed), in place."""
    module = fused_blocks(transformer)
    if module is not None:
        module.disable(transformer)
    for block in repeated_blocks(transformer):
        if "_shardgen_eager_forward" in block.__dict__:
            block.__dict__.pop("_shardgen_eager_forward")
            block.__dict__.pop("forward", None)


def validate(opts: AccelOptions, device=None) -> None:
    """AccelError for a compile mode torch.compile does not have, or a forced compile=auto path it does not know."""
    from shardgen.speed.autocompile import check_forced_path

    check_forced_path()
    mode = pick(CompileConfig, opts).compile_mode
    if mode not in COMPILE_MODES:
        raise AccelError(f"compile_mode={mode!r}: use one of {list(COMPILE_MODES)}")


def apply(step: Step) -> dict:
    """Bring the blocks to what is asked: compiled, fused eagerly (CUDA), or their own forward."""
    was, now, tr = pick(CompileConfig, step.was), pick(CompileConfig, step.opts), step.transformer
    done: dict[str, Any] = {}
    recompile = was.settings != now.settings
    was_fused = not was.compile and _blocks_replaced(tr)  # what the blocks run now, not what was asked
    fused = _fused_eager(now, step.device)
    if (was.compile and (not now.compile or recompile)) or (was_fused and not fused):
        uncompile_blocks(tr)
    if fused and not was_fused:
        done["fused_eager_blocks"] = fuse_blocks_eager(tr)
    if now.compile and (not was.compile or recompile):
        cuda = step.device is not None and torch.device(step.device).type == "cuda"
        done["compiled_blocks"] = compile_blocks(tr, now.compile_mode, fused=now.fused_blocks,
                                                 tuning=now.compile_tuning and cuda)
    return done


register_technique(Technique("compile", 20, apply, validate=validate, wanted=lambda opts: opts.compile))
