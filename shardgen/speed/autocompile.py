"""``compile: auto`` decided per process, from what compiling costs and saves here.

Compiling the transformer's repeated blocks makes each image faster (H200: ~1.35x over the stock eager blocks; over
a family's fused, CUDA-graphed eager blocks far less: FLUX.1-dev 1.02x, FLUX.2-dev 1.01x, Qwen-Image none; with
fp8=true the fused eager blocks are the faster ones: FLUX.1-dev 0.91x with fa3_fp8, FLUX.2-dev 0.98x), but the
first compiled batch pays 40-65 s (a fresh compile cache) or 6-25 s (a warm one) before that. A job with a few dozen
prompts left, a requeued job near its end, or a short debug run loses more than it saves. So with ``compile: auto``
(on CUDA, one GPU per replica) each process decides for itself:

- **the estimate**: the samples this process is still expected to make (the run's unfinished shards
  divided among its replicas) x the eager seconds per sample x (1 - 1/speed-up) = the time compiling
  would save; compile when that exceeds ``MARGIN`` x what compiling costs: the cold or the warm cost, warm when this
  cache has compiled this model and shape set before.
- **the figures**: measured on this GPU for this model and shape set by earlier processes and kept in
  ``$SHARDGEN_CACHE/compile/records.json`` (eager and compiled seconds per sample, the cold and warm
  compile costs); where none is recorded yet, the priors below (H200 measurements, benchmarks/results/performance-history.md).
  Without a recorded eager speed the first two batches run eagerly and the second is timed (real work, not a
  probe): the first pays the process's one-time GPU costs (H200: the first batch 10-25% slower than
  the next), and that inflated figure had compiled 24-prompt jobs that then lost 3-4% to ``compile=false``.
- **the decision is final** for the process (no switching back and forth) and logged with its figures. With
  recorded figures it is taken before the first batch.

**On the main thread**: a process that decides to compile runs its next batch on compiled blocks, and that batch
waits for the compilation; its cost is that wait (the first compiled batch minus a steady one, per batch), recorded
as ``compile_cold_s`` or ``compile_warm_s`` for the next process. A fresh cache is compiled, and so warmed for every
later process on it, only where the estimate says a job is long enough to pay the cold cost. Hiding the wait behind
eager batches (compiling on a thread beside them) would gain little: the families whose eager blocks are fused run
them within 1-2% of their compiled blocks (H200, FLUX.1-dev: 3.64 s/image eager, 3.59 compiled), so over 1,000
FLUX.1-dev samples such a thread would save ~62 s against ~46 s for waiting on a warm cache (a 25 s wait), under
0.5% of the run; FLUX.2-dev's and Qwen-Image's fused eager blocks are not the ones their blocks compile, so eager
batches beside a thread would run their slower stock blocks (docs/performance.md).

**Kernel tuning** (``compile_tuning: auto``, the default): inductor's coordinate-descent tuning makes the compiled
steps ~2% faster and adds ~25-40 s to a fresh cache's compilation, so it pays only over several hundred samples. A
process that compiles weighs both variants over the work it has left, each with its own records (the key covers the
tuning), and takes the one that saves more (``_choose_tuning``). ``compile=true`` tunes; ``compile_tuning=true|false``
fixes it.

**Forcing a path** (tests, benchmarks): ``SHARDGEN_COMPILE_AUTO=eager|main`` in the environment makes a
``compile: auto`` process take that path whatever the figures say, after its first ``EAGER_BATCHES`` eager batches:
stay eager, or compile on the main thread. tests/test_gpu_matrix.py walks both.

The records are advisory: a lost update (two processes writing at once) or a damaged file only means the
priors are used again; the file is replaced atomically, so a reader never sees half of one, and a field this
module does not read is kept and ignored. A key covers the model, the shapes (size, frames, batch, steps), true
CFG, the compile settings, the GPU and the torch/diffusers versions: a change in any of them starts from the
priors, never from a stale figure.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from shardgen.cache import default_cache_dir
from shardgen.speed.sdpa import EIGHT_BIT

log = logging.getLogger("shardgen.compile")

PRIOR_COLD_S = 45.0   # first compiled batch minus a steady one, fresh cache, kernels tuned (H200: 40-52 s, FLUX.1/2,
# Qwen)
PRIOR_COLD_UNTUNED_S = 20.0  # the same without the tuning (docs/config.md: the tuning adds ~40 s once per process)
TUNING_GAIN = 0.02    # tuned compiled steps over untuned ones (H200, FLUX.1-dev: 1.3-2.9%, performance-history.md)
PRIOR_WARM_S = 15.0   # the same from a warm cache (H200: 6-13 s)
EAGER_BATCHES = 2     # full eager batches before deciding without a recorded eager speed (the last one is timed)
PRIOR_SPEEDUP = 1.35  # eager s/sample over compiled s/sample at batch 4 (H200: 1.37 FLUX.1-dev)
MIN_SPEEDUP = 1.0     # a recorded speed-up below this (compiling did not help here) turns compiling off
FORCE_ENV = "SHARDGEN_COMPILE_AUTO"
FORCE_PATHS = ("eager", "main")
MARGIN = 1.2          # compile only when the expected saving is this much over the cost: the figures are estimates
# (H200, Qwen-Image, 24 prompts, warm cache: 17 s saved vs 15 s prior cost -> compiled, and lost 5% to eager)


def prior_speedup(pipe: Any, fused_blocks: bool, fp8: bool = False) -> float:
    """The speed-up compiling is expected to bring ``pipe``'s eager path before a process has recorded one: its
    family's measured ``compiled_speedup`` (over its fused eager blocks, when it has some, only with
    ``fused_blocks`` on; with ``fp8``, its ``compiled_speedup_fp8`` where measured), else ``PRIOR_SPEEDUP``. Below
    ``MIN_SPEEDUP`` a process without records of its own stays eager however long its run."""
    from shardgen.speed.handdown import family_of

    family = family_of(pipe)
    if family is None or not (fused_blocks or not family.fused_blocks):
        return PRIOR_SPEEDUP
    if fp8 and family.compiled_speedup_fp8:
        return family.compiled_speedup_fp8
    return family.compiled_speedup or PRIOR_SPEEDUP


def check_forced_path(value: str | None = None) -> None:
    """AccelError unless ``value`` (default: ``$SHARDGEN_COMPILE_AUTO``) is unset or one of ``FORCE_PATHS``; called
    by ``shardgen.speed.techniques.validate`` too, so a typo is refused before any weight is read."""
    from shardgen.speed.techniques import AccelError

    value = (os.environ.get(FORCE_ENV) or None) if value is None else value
    if value is not None and value not in FORCE_PATHS:
        raise AccelError(f"{FORCE_ENV}={value!r}: use one of {list(FORCE_PATHS)} or leave it unset")


def records_path() -> Path:
    """``$SHARDGEN_CACHE/compile/records.json`` (next to the inductor cache it describes)."""
    return default_cache_dir() / "compile" / "records.json"


def read_records(path: Path) -> dict:
    """The records, or {} when the file is missing, damaged or not ours (advisory data: never an error)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(path: Path, key: str, record: dict) -> None:
    """Merge ``record`` into ``path`` under ``key`` (read, update, atomic replace; errors only logged)."""
    from shardgen.dataio.rundir import atomic_write_bytes

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_records(path)
        data[key] = {**(data.get(key) if isinstance(data.get(key), dict) else {}), **record}
        atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())
    except OSError as e:
        log.warning("could not record timings in %s (%s); the next process starts without them", path, e)


def _number(value: Any) -> float | None:
    """A recorded figure: a positive finite number (json reads Infinity and NaN too), else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def _as_record(value: Any) -> dict:
    """A key's record, or {} for a missing or damaged one (advisory data)."""
    return value if isinstance(value, dict) else {}


def record_key(pipe: Any, settings: Any, shapes: list[str] | None = None) -> str:
    """What the figures depend on: model, shapes, CFG, compile settings, GPU, library versions. ``shapes``: the
    run's image/video shapes when its rows set their own (``prompts.row_settings``; the plan's shape set): a mixed
    run compiles a graph set per shape and its batches take several speeds, so it keeps figures of its own."""
    import diffusers
    import torch

    device = getattr(pipe, "_execution_device", None) or getattr(pipe, "device", "cpu")
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    tr = getattr(pipe, "transformer", None)
    a = settings.accel
    parts = dict(model=settings.model, transformer=type(tr).__name__, size=f"{settings.height}x{settings.width}",
                 frames=settings.num_frames, batch=settings.batch_size, steps=settings.steps,
                 true_cfg=settings.true_cfg_scale > 1.0, cfg_batching=a.cfg_batching, fp8=a.fp8,
                 fbc=a.first_block_cache, mode=a.compile_mode, fused=a.fused_blocks, tuning=a.compile_tuning,
                 gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda, diffusers=diffusers.__version__)
    if shapes and len(shapes) > 1:
        parts["shapes"] = sorted(shapes)
    if a.sdpa in EIGHT_BIT:  # an 8-bit attention kernel changes both sides' seconds (absent otherwise: the records
        parts["sdpa"] = a.sdpa  # made before it stay valid)
    return json.dumps(parts, sort_keys=True)


@dataclass
class AutoCompile:
    """One process's ``compile: auto``: ``settings()`` before each batch, ``observe()`` after it."""

    key: str
    remaining: Callable[[], int]
    """Samples this process is still expected to generate (asked once, when deciding)."""
    path: Path = field(default_factory=lambda: records_path())
    decided: bool | None = None
    """None until decided; True or False from the start for ``compile: true`` (then only timed and recorded)."""
    reason: str = ""
    prior_speedup: float = PRIOR_SPEEDUP
    """The speed-up expected from compiling while none is recorded (``prior_speedup``)."""
    shapes: int = 1
    """Shapes the run's batches take (per-row sizes): without a recorded cost, each compiles its own graphs."""
    untuned_key: str | None = None
    """``compile_tuning: auto``: the records of compiling without kernel tuning. Compiling then takes the variant that
    saves more over the work left (``_choose_tuning``); None: the tuning as configured."""
    tuned: bool = True
    """Whether the blocks compile with kernel tuning (``compile_tuning``); False once ``_choose_tuning`` drops it."""
    force: str | None = field(default_factory=lambda: os.environ.get(FORCE_ENV) or None)
    """The path taken whatever the figures say (``FORCE_PATHS``; the module doc), None: decided from the figures."""
    _eager: list[float] = field(default_factory=list)      # seconds per sample of full eager batches
    _compiled: list[float] = field(default_factory=list)   # ... of full compiled batches, first one included
    _record: dict = field(default_factory=dict)
    _untuned: dict = field(default_factory=dict)  # the records under ``untuned_key``

    def __post_init__(self) -> None:
        check_forced_path(self.force)
        records = read_records(self.path)
        self._record, self._untuned = (_as_record(records.get(k)) for k in (self.key, self.untuned_key))

    def _recorded_eager(self) -> float | None:
        """The eager speed recorded by an earlier process (none when forced: the eager batches run first)."""
        return None if self.force else _number(self._record.get("eager_s"))

    def settings(self, s: Any) -> Any:
        """``s`` with ``accel.compile`` set for the next batch (deciding now when the figures allow)."""
        if self.decided is None:
            eager = self._recorded_eager() or (self._eager[-1] if len(self._eager) >= EAGER_BATCHES else None)
            if eager is not None:
                self._decide(eager)
        return replace(s, accel=replace(s.accel, compile=bool(self.decided),
                                        compile_tuning=s.accel.compile_tuning and self.tuned))

    def _cost(self, key: str, prior: float, record: dict | None = None) -> tuple[float, str]:
        """(seconds, note): the compile cost recorded under ``key`` (in ``record``, default this key's), else
        ``prior`` per shape, noted as a prior."""
        recorded = _number((self._record if record is None else record).get(key))
        return (recorded, "") if recorded else (prior * max(1, self.shapes), ", prior")

    def _choose_tuning(self, eager_s: float, left: int, tuned_speedup: float, tuned_cost: float,
                       compiling: bool = False) -> str:
        """``compile_tuning: auto``: drop the kernel tuning when compiling without it saves more over the ``left``
        samples, and more than nothing unless ``compiling`` anyway (the tuning's ~2% faster steps pay for its compile
        time only over several hundred samples). Switches this decider to the untuned variant's records and returns
        the reason's words for it, or "" (tuned, as configured)."""
        if self.untuned_key is None:
            return ""
        r = self._untuned
        warm = bool(r.get("compiled_before"))
        cost, note = (self._cost("compile_warm_s", PRIOR_WARM_S, r) if warm
                      else self._cost("compile_cold_s", PRIOR_COLD_UNTUNED_S, r))
        compiled = _number(r.get("compiled_s"))
        speedup = eager_s / compiled if compiled else tuned_speedup / (1.0 + TUNING_GAIN)

        def net(sp: float, c: float) -> float:
            return left * eager_s * ((1.0 - 1.0 / sp) if sp > MIN_SPEEDUP else 0.0) - MARGIN * c

        untuned, tuned = net(speedup, cost), net(tuned_speedup, tuned_cost)
        if untuned <= tuned or (untuned <= 0 and not compiling):
            return ""
        eager_record = {"eager_s": self._record["eager_s"]} if _number(self._record.get("eager_s")) else {}
        self.tuned, self.key, self._record = False, self.untuned_key, {**eager_record, **r}
        return (f"; without kernel tuning: {left} samples x {eager_s:.2f} s x (1 - 1/{speedup:.2f} speed-up"
                f"{'' if compiled else ' (prior)'}) "
                f"- {cost:.0f} s x {MARGIN} to compile ({'warm' if warm else 'cold'} cache{note}) = {untuned:.0f} s net, "
                f"more than {tuned:.0f} s net with it")

    def _decide(self, eager_s: float) -> None:
        r = self._record
        warm = bool(r.get("compiled_before"))
        compiled = _number(r.get("compiled_s"))
        speedup = eager_s / compiled if compiled else self.prior_speedup
        left = max(0, int(self.remaining()))
        # the warm cost where this cache compiled the blocks before
        cost, note = (self._cost("compile_warm_s", PRIOR_WARM_S) if warm
                      else self._cost("compile_cold_s", PRIOR_COLD_S))
        if self.force:
            self.decided = self.force != "eager"
            self.reason = f"forced by {FORCE_ENV}={self.force}, {eager_s:.2f} s/sample eager"
            if self.decided:  # the path is forced, the tuning still chosen from the figures
                self.reason += self._choose_tuning(eager_s, left, speedup, cost, compiling=True)
        else:
            gain = (1.0 - 1.0 / speedup) if speedup > MIN_SPEEDUP else 0.0
            saving = left * eager_s * gain
            self.reason = (f"{left} samples left here x {eager_s:.2f} s eager x (1 - 1/{speedup:.2f} speed-up"
                           f"{'' if compiled else ' (prior)'}) = {saving:.0f} s saved vs {cost:.0f} s x {MARGIN} to "
                           f"compile ({'warm' if warm else 'cold'} cache{note})")
            untuned = self._choose_tuning(eager_s, left, speedup, cost)
            self.decided = bool(untuned) or saving > MARGIN * cost
            self.reason += untuned
        log.info("compile=auto: %s (%s)", "compiling" if self.decided else "staying eager", self.reason)

    def finish(self) -> None:
        """The end of the process's work: record the steady eager speed of a process that stayed eager."""
        self._record_steady_eager()

    def _record_steady_eager(self) -> None:
        """A process that stayed eager leaves the median of its eager batches after the first as ``eager_s``: the
        second batch alone, timed to decide, runs ~10% slower than the steady ones (H200, Qwen-Image: 2.96 against
        2.67 s/image), which overstates what compiling saves for the next process that reads the records."""
        steady = self._eager[1:]
        if self.decided is False and len(steady) >= EAGER_BATCHES and not self.force:
            write_record(self.path, self.key, {"eager_s": statistics.median(steady)})

    def observe(self, s: Any, samples: int, seconds: float) -> None:
        """Time of one batch of ``samples`` real samples made with ``s``. A compiled call is padded to the batch
        size, so it is timed per batch slot; a short eager batch is not timed (its per-sample time is off)."""
        if seconds <= 0 or samples <= 0 or (samples < s.batch_size and not s.accel.compile):
            return
        per_sample = seconds / max(samples, s.batch_size)
        if not s.accel.compile:
            self._eager.append(per_sample)
            if len(self._eager) == EAGER_BATCHES and not _number(self._record.get("eager_s")):
                write_record(self.path, self.key, {"eager_s": per_sample})
            return
        self._compiled.append(per_sample)
        if len(self._compiled) == 2:  # the first compiled batch paid the compilation, the second did not
            first, steady = self._compiled
            warm = bool(self._record.get("compiled_before"))
            update = {"compiled_s": steady, "compiled_before": True,
                      "compile_warm_s" if warm else "compile_cold_s": max(0.0, (first - steady) * s.batch_size)}
            if self._eager:
                update["eager_s"] = statistics.median(self._eager)
            write_record(self.path, self.key, update)

    def summary(self) -> str:
        """One line for the end of the job: the decision and the batch timings behind it."""
        parts = [f"compile={'auto' if self.reason else str(self.decided).lower()} "
                 f"{'compiled' if self.decided else 'eager'}"
                 f"{' without kernel tuning' if self.decided and not self.tuned else ''}"]
        if self._eager:  # the rate after the first batch, which pays the warm-up (cuDNN plans, lazy kernels)
            steady = self._eager[1:] or self._eager
            parts.append(f"{len(self._eager)} eager batches, {statistics.median(steady):.2f} s/sample")
        if self._compiled:
            parts.append(f"{len(self._compiled)} compiled batches, first {self._compiled[0]:.2f} s/sample"
                         + (f", steady {statistics.median(self._compiled[1:]):.2f} s/sample"
                            if len(self._compiled) > 1 else ""))
        return "; ".join(parts)


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (0 without torch._dynamo's counters)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def compile_cache_counts() -> str:
    """Where this process's compiled graphs came from: inductor's FX graph cache and AOTAutograd's cache hits and
    misses (a warm cache that misses recompiles from scratch: why a "warm" compilation can take as long as a cold
    one), and ``""`` before any compilation."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return ""
    ind, aot = counters["inductor"], counters["aot_autograd"]
    parts = {"fx graph cache": (ind["fxgraph_cache_hit"], ind["fxgraph_cache_miss"]),
             "aot autograd cache": (aot["autograd_cache_hit"], aot["autograd_cache_miss"])}
    return ", ".join(f"{name} {hit} hit / {miss} miss" for name, (hit, miss) in parts.items() if hit or miss)
