"""The speed techniques, one registry, and ``AccelOptions``, what they are asked (one field per speed key of the
config; each technique reads the fields it needs into a config of its own). ``prepare`` brings a pipeline to the
asked options by running each registered technique in order (diffusers' hook-registry pattern: every technique's
hooks come off first, then each applies itself). A technique is one module of shardgen/speed/ defining its config,
its ``apply`` and (when its hooks must come off before the others change the blocks) its ``release``, registered
with ``register_technique``; the built-in ones are the modules in ``BUILTIN``.

Everything is reversible and idempotent (``prepare`` brings a pipeline from whatever state it is in to the asked
one), so a benchmark can reconfigure one pipeline object between runs.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from shardgen.errors import UserError
from shardgen.pick import pick

log = logging.getLogger("shardgen.accel")

# imported when the techniques are first listed, in this order (each registers itself with its own order)
BUILTIN = ("shardgen.speed.fp8", "shardgen.speed.regional_compile", "shardgen.speed.first_block_cache",
           "shardgen.speed.sdpa", "shardgen.speed.family_hooks", "shardgen.speed.fused_decode",
           "shardgen.speed.cuda_graphs")
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
    fused_decode: bool = True
    compile_tuning: bool = True
    cfg_batching: bool = False
    cuda_graphs: bool = True
    """Resolved: the config's ``cuda_graphs`` where a replica is one GPU, else False (shardgen/speed/cuda_graphs.py:
    where else it applies)."""

    @classmethod
    def from_cfg(cls, cfg: Any, one_gpu_per_replica: bool = True) -> "AccelOptions":
        """The options of ``cfg``; ``one_gpu_per_replica``: whether the strategy that runs (``strategy=auto``
        resolved) makes a replica one rank on one GPU (``Strategy.one_gpu_per_replica``, parallel/registry.py)."""
        get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
        # the other fields are SpeedConfig's keys of the same name (shardgen/pick.py); a key absent from a partial
        # config keeps this class's default
        return pick(cls, cfg, compile=resolve_compile(get("compile", "auto"), str(get("device", "auto")),
                                                  one_gpu_per_replica),
                    sdpa=str(get("sdpa_backend", cls.sdpa)), compile_tuning=resolve_tuning(get("compile_tuning", "auto")),
                    cuda_graphs=bool(get("cuda_graphs", cls.cuda_graphs)) and one_gpu_per_replica)

    @property
    def lossy(self) -> dict:
        """The lossy options that are on (empty when the output is exact): what each technique reports."""
        out: dict = {}
        for technique in techniques():
            out.update(technique.lossy(self))
        return out


def resolve_compile(value: Any, device: str = "auto", one_gpu_per_replica: bool = True) -> bool:
    """``compile`` as configured (true, false or auto) -> on or off for this run. ``auto``: on when the
    run's device is CUDA and each replica is one GPU (strategy dp: what compile=auto was measured on), off
    otherwise."""
    import torch

    if isinstance(value, bool):
        return value
    if str(value).lower() != "auto":
        raise AccelError(f"compile={value!r}: use true, false or auto (on for CUDA with strategy dp, else off)")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return cuda and one_gpu_per_replica


def resolve_tuning(value: Any) -> bool:
    """``compile_tuning`` as configured (true, false or auto) -> whether compiled blocks are tuned unless ``compile:
    auto`` decides otherwise: ``auto`` tunes under compile=true and lets compile=auto choose (speed/autocompile.py)."""
    if isinstance(value, bool):
        return value
    if str(value).lower() != "auto":
        raise AccelError(f"compile_tuning={value!r}: use true, false or auto (compile=auto tunes the kernels only "
                         "when the work left pays for the tuning's compile time)")
    return True


@dataclass(frozen=True)
class Step:
    """What a technique sees while ``prepare`` runs: the pipeline, its transformer and execution device, the options
    it had (``was``) and the ones asked (``opts``)."""

    pipe: Any
    transformer: Any
    device: Any
    was: AccelOptions
    opts: AccelOptions


@dataclass(frozen=True)
class Technique:
    """One speed technique: how ``prepare`` checks, removes and applies it."""

    name: str
    order: int
    """Where it applies among the others (lower first): fp8 10, compile 20, First-Block-Cache 30, the family's 50,
    the VAE decoder's 55, CUDA graphs 60 (around whatever the others made of the transformer)."""
    apply: Callable[[Step], dict]
    """Bring the transformer to ``step.opts`` for this technique; what was done (shown in the log, the bench)."""
    release: Callable[[Step], dict] = lambda step: {}
    """Take its hooks off before any technique applies (compilation must go underneath hooks)."""
    validate: Callable[[AccelOptions, Any], None] = lambda opts, device: None
    """AccelError for an impossible option (no weights needed: called before loading, with the device)."""
    wanted: Callable[[AccelOptions], bool] = lambda opts: False
    """Whether ``opts`` ask for it on the transformer (refused for a pipeline without one)."""
    lossy: Callable[[AccelOptions], dict] = lambda opts: {}
    """The options of it that change pixels beyond rounding, when on (recorded in each sample's json)."""


_REGISTRY: dict[str, Technique] = {}


def register_technique(technique: Technique) -> Technique:
    """Add (or replace) a technique under its name; returns it."""
    _REGISTRY[technique.name] = technique
    return technique


def unregister_technique(name: str) -> None:
    """Remove a technique (a test's toy one)."""
    _REGISTRY.pop(name, None)


def techniques() -> list[Technique]:
    """Every registered technique in applying order (the built-in modules imported first)."""
    for module in BUILTIN:
        importlib.import_module(module)
    return sorted(_REGISTRY.values(), key=lambda t: t.order)


def validate(opts: AccelOptions, device: Any = None) -> None:
    """Raise AccelError for an impossible option (no weights needed; call before loading)."""
    for technique in techniques():
        technique.validate(opts, device)


def current(pipe) -> AccelOptions | None:
    """The options ``prepare`` last brought ``pipe`` to (None: never prepared)."""
    return getattr(pipe, _STATE_ATTR, None)


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
        asked = [t.name for t in techniques() if t.wanted(opts)]
        if asked:
            raise AccelError(f"{type(pipe).__name__} has no transformer: {'/'.join(asked)} do not apply")
        setattr(pipe, _STATE_ATTR, opts)
        return done
    step = Step(pipe, tr, device, current(pipe) or AccelOptions(), opts)
    ordered = techniques()
    for technique in ordered:  # hooks come off first: compilation must go underneath them
        done.update(technique.release(step))
    for technique in ordered:
        done.update(technique.apply(step))
    done["prepare_s"] = round(time.perf_counter() - t0, 3)
    setattr(pipe, _STATE_ATTR, opts)
    if opts != AccelOptions(sdpa=opts.sdpa):
        log.info("accelerations %s applied: %s", asdict(opts), done)
    return done
