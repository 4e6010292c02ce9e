"""LoRA adapters (``model.loras``, and a row's own with ``prompts.row_settings=[loras]``): checked, hashed, and applied
to a pipeline through diffusers' own ``load_lora_weights`` / ``set_adapters`` / ``fuse_lora``.

An adapter is identified by its file's sha256 (in the run's fingerprint and each sample's json), never by its path:
a run moved with its adapters resumes; a different file at the same path is refused.

Adapters are always fused into the weights they adapt: a denoising step then costs what the base model's does (no
extra low-rank matmuls), and a strategy that splits the transformer (tp, cp) splits the adapted weights. With one
adapter set for the whole run, the adapters are fused and unloaded before the strategy shards the transformer. When
rows name their own sets, the peft layers stay and each set is fused in turn (``AdapterSets``): the adapted layers'
base weights are kept (on their GPU when it has room, else in host memory) and copied back before the next set is
fused, so a row's pixels are those of a run made with its set alone, whatever set came before (unfusing alone would
leave rounding behind).
"""

from __future__ import annotations

import hashlib
import math
import logging
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from shardgen.errors import ConfigError, UserError

log = logging.getLogger("shardgen.lora")

ROW_FIELD = "loras"
"""The ``prompts.row_settings`` name of a row's own adapters."""


class LoraError(UserError, ValueError):
    """An adapter that cannot be used as given; the message names it and what to change."""


class Lora(NamedTuple):
    """One adapter of a set: its file, the scale it is applied at, and the file's sha256 (a tuple: hashable for
    batching rows by adapter set, and plain JSON in a row's settings)."""

    path: str
    scale: float
    sha256: str

    @property
    def adapter_name(self) -> str:
        """The name diffusers knows it by: its content, so one file loaded twice is one adapter."""
        return f"lora_{self.sha256[:16]}"

    def as_json(self) -> dict:
        """For a sample's json and the plan."""
        return dict(path=self.path, scale=self.scale, sha256=self.sha256)


LoraSet = tuple  # tuple[Lora, ...]: the adapters of one pipeline call, as listed (fused in ``_fuse``'s one order)


_HASHES: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """The file's sha256, computed once per process while its size, mtime and ctime stay the same."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def checked_sha256(where: str, path: Path) -> str:
    """``check_file`` then ``file_sha256``; both once per process per file version (a million rows naming one
    adapter read it once)."""
    try:
        st = path.stat()
    except (OSError, ValueError):  # (ValueError: a NUL byte) check_file names what is wrong
        st = None
    if st is None or (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns) not in _HASHES:
        check_file(where, path)
    return file_sha256(path)


def check_file(where: str, path: Path) -> None:
    """LoraError unless ``path`` is a readable safetensors file with tensors in it (its header read, no weight)."""
    try:
        st = os.stat(path)
    except ValueError:
        raise LoraError(f"{where}: {str(path)!r} holds a NUL byte, which no file name may; give the path of a LoRA "
                        ".safetensors file") from None
    except FileNotFoundError:
        raise LoraError(f"{where}: {path} does not exist; give the path of a LoRA .safetensors file") from None
    except OSError as e:  # a name over 255 bytes, a path through a file, no permission
        raise LoraError(f"{where}: {str(path)[:200]} cannot be read ({e.strerror or e}); give the path of a LoRA "
                        ".safetensors file") from None
    if not stat.S_ISREG(st.st_mode):
        raise LoraError(f"{where}: {path} is not a file; give the path of a LoRA .safetensors file")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise LoraError(f"{where}: {path} is not a readable safetensors file ({type(e).__name__}: "
                        f"{_first_line(e)}); give a LoRA saved as .safetensors (pickled .bin/.pt adapters are "
                        "not loaded)") from None
    if not keys:
        raise LoraError(f"{where}: {path} holds no tensors; give a LoRA .safetensors file")


def resolve(entries: Iterable[Any], where: str, base_dir: Path | None = None) -> LoraSet:
    """The adapters of ``entries`` (``{path, scale}`` mappings; a relative path is taken from ``base_dir``, else
    the current directory), each file checked and hashed. LoraError names ``where`` and the entry."""
    out = []
    for i, entry in enumerate(entries or ()):
        at = f"{where}[{i}]"
        path, scale = _entry(entry, at)
        if "://" in path:  # s3://, https://, ...: not a local file (input images refuse URLs alike)
            raise LoraError(f"{at}: {path.strip()} is a URL: LoRA files are read from local paths; copy it locally "
                            "and give its path")
        p = Path(os.path.expanduser(path))
        p = (p if p.is_absolute() else (base_dir or Path.cwd()) / p).absolute()
        out.append(Lora(path=str(p), scale=scale, sha256=checked_sha256(at, p)))
    names = [lo.adapter_name for lo in out]
    dup = next((lo for lo in out if names.count(lo.adapter_name) > 1), None)
    if dup is not None:
        raise LoraError(f"{where}: {dup.path} (sha256 {dup.sha256[:16]}...) is listed twice; list each adapter once, "
                        "at the sum of its scales")
    return tuple(out)


# the largest |scale| accepted: far past any adapter's use, short of fused weights that overflow
MAX_SCALE = 100.0


def _entry(entry: Any, at: str) -> tuple[str, float]:
    import math

    if hasattr(entry, "get") and not isinstance(entry, str):
        unknown = sorted(str(k) for k in entry.keys() if k not in ("path", "scale"))
        if unknown:
            raise LoraError(f"{at}: no key {unknown[0]!r}; an adapter has a path and a scale: write "
                            "{path: FILE.safetensors, scale: 0.8}, or \"FILE.safetensors:0.8\"")
        path, scale = entry.get("path"), entry.get("scale", 1.0)
    else:
        path, scale = entry, 1.0
    if not isinstance(path, str) or not path.strip():
        raise LoraError(f"{at}: no path; write {{path: FILE.safetensors, scale: 0.8}}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise LoraError(f"{at}: scale {scale!r} is not a number; write e.g. scale: 0.8 (1.0 = as trained)")
    if abs(scale) > MAX_SCALE:  # fused into bf16 weights, such a scale makes every sample NaN or inf
        raise LoraError(f"{at}: scale {scale!r} is outside -{MAX_SCALE:g}..{MAX_SCALE:g}; adapters are used at scales "
                        "around 1 (1.0 = as trained, 0 = off)")
    return path, float(scale)


def parse_row(value: Any, text: bool, base_dir: Path | None) -> LoraSet:
    """A row's ``loras`` (``prompts.row_settings``): a list of ``{path, scale}`` objects or ``PATH[:SCALE]`` strings
    (jsonl, parquet), or in csv/tsv ``PATH[:SCALE];PATH[:SCALE]``; a relative path is taken from the prompt file's
    folder; ``[]``: no adapter for this row. LoraError says what is wrong.

    In a ``PATH[:SCALE]`` string, the part after the last ``:`` is the scale when it reads as a number. When it does
    not, it is still taken as a (mistyped) scale, and refused as "not a number", unless the whole string names an
    existing file or that part looks like a path (has a ``/`` or ends in ``.safetensors``): a path may hold a ``:``
    of its own (``runs:2024/style.safetensors``); ``style.safetensors:abc`` is a bad scale."""
    if isinstance(value, str):
        value = value.split(";") if text else [value]
    if hasattr(value, "tolist"):  # a parquet list column
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise LoraError(f"{value!r} is not a list of adapters: write [{{\"path\": \"style.safetensors\", "
                        "\"scale\": 0.8}] or [\"style.safetensors:0.8\"] (csv/tsv: style.safetensors:0.8;other.safetensors)")
    value = [v for v in value if not (isinstance(v, str) and not v.strip())]
    value = [_text_entry(v, f"{ROW_FIELD}[{i}]", base_dir) if isinstance(v, str) else v for i, v in enumerate(value)]
    return resolve(value, ROW_FIELD, base_dir)


def _text_entry(part: str, at: str, base_dir: Path | None) -> Any:
    """``PATH[:SCALE]`` as ``{path, scale}`` (``parse_row`` says how a ``:`` is read)."""
    part = part.strip()
    path, _, scale = part.rpartition(":")
    if not path:
        return part
    try:
        return dict(path=path, scale=float(scale))
    except ValueError:
        pass
    whole = Path(os.path.expanduser(part))
    whole = whole if whole.is_absolute() else (base_dir or Path.cwd()) / whole
    if "/" in scale or scale.lower().endswith(".safetensors") or whole.is_file():
        return part  # a colon of the path itself
    raise LoraError(f"{at}: {part!r}: scale {scale!r} is not a number; write PATH:SCALE, e.g. "
                    f"{Path(path).name or 'style.safetensors'}:0.8 (1.0 = as trained)")


def check_planned(adapters: dict[str, str]) -> None:
    """The adapter files rows named when the run was planned (sha256 -> path) still hold what they held: a row's
    adapter changed under a run is refused like a changed ``model.loras``, at launch. (A file no longer at its
    planned path, as in a run moved with its prompt file, is checked when its rows are read: ``Plan.rows``.)"""
    for digest, path in sorted(adapters.items(), key=lambda kv: kv[1]):
        p = Path(path)
        now = file_sha256(p) if p.is_file() else digest
        if now != digest:
            raise LoraError(f"{path}: a row of this run names this LoRA, which changed since the run was planned "
                            f"(sha256 {digest[:16]}..., now {now[:16]}...); restore it, or start a new run_dir")


def run_set(cfg: Any) -> LoraSet:
    """The run's adapters (``model.loras``), checked and hashed."""
    where = "model.loras"
    entries = cfg.model.get("loras") or ()
    return resolve([_text_entry(e, f"{where}[{i}]", None) if isinstance(e, str) else e
                    for i, e in enumerate(entries)], where)


def check_run_set(cfg: Any) -> None:
    """The run's adapters exist and are safetensors (their headers read, no weight); fp8 cannot switch per row."""
    run_set(cfg)
    # per-row adapters under a strategy that splits the transformer: parallel/strategies.py, which knows strategies
    if per_row(cfg) and cfg.get("fp8"):
        raise ConfigError("fp8=true quantizes the weights once, and prompts.row_settings=[loras] changes them between "
                          "batches; set fp8=false, or give the run one adapter set in model.loras")


def per_row(cfg: Any) -> bool:
    """True when rows may name their own adapters (``prompts.row_settings`` lists ``loras``)."""
    return ROW_FIELD in (cfg.prompts.get("row_settings") or ())


def fingerprint_fields(loras: LoraSet) -> dict:
    """The adapters' part of the run fingerprint: content and scale (not the path); {} without adapters, so runs
    made before adapters existed resume unchanged."""
    return {"model.loras": [[lo.sha256, lo.scale] for lo in loras]} if loras else {}


def _first_line(e: BaseException, limit: int = 300) -> str:
    """``e``'s message on one line (torch's state-dict errors put the mismatch on the second)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return (text[:limit] + "...") if len(text) > limit else text or type(e).__name__


def _check_pipeline(pipe: Any) -> None:
    if not hasattr(pipe, "load_lora_weights"):
        raise LoraError(f"model.loras: {type(pipe).__name__} cannot load LoRA adapters in this diffusers; remove "
                        "model.loras (and loras from prompts.row_settings)")


def _load(pipe: Any, lora: Lora, where: str = "LoRA") -> None:
    """Load one adapter (not yet active); LoraError, naming ``where`` (``model.loras[i]``), when it does not fit the
    model: a tensor of another shape (diffusers raises), or a tensor whose name matches no layer (diffusers only
    warns, loads the rest, and may give the layers it made for it fresh weights: ``_unloaded``). A refused adapter
    is deleted from the pipeline again."""
    try:
        with warnings.catch_warnings():  # peft warns that a second adapter is a second adapter
            warnings.filterwarnings("ignore", message=".*multiple adapters", category=UserWarning)
            pipe.load_lora_weights(lora.path, adapter_name=lora.adapter_name)
    except Exception as e:
        raise LoraError(f"{where}: {lora.path} does not fit {type(pipe).__name__}'s model ({type(e).__name__}: "
                        f"{_first_line(e)}); use an adapter trained for this model") from None
    present = {n for names in pipe.get_list_adapters().values() for n in names}
    problem = _unloaded(pipe, lora)
    if problem is None and lora.adapter_name not in present:
        problem = (f"matches no layer of {type(pipe).__name__}'s model (its weight names are another model's); use an "
                   "adapter trained for this model")
    if problem is not None:
        if lora.adapter_name in present:
            try:
                pipe.delete_adapters(lora.adapter_name)
            except Exception:  # best effort: the error below stops the job anyway
                log.debug("could not delete adapter %s", lora.adapter_name, exc_info=True)
        raise LoraError(f"{where}: {lora.path}: {problem}")


_LORA_WEIGHT = (".lora_A.weight", ".lora_B.weight")  # peft's names of a LoRA's two matrices, as diffusers loads them


def _unloaded(pipe: Any, lora: Lora) -> str | None:
    """What of ``lora``'s file did not load into ``pipe`` (None: all of it): its LoRA matrices after diffusers'
    own key conversion (``lora_state_dict``: kohya, xlabs, ... to peft's names, each prefixed by its component)
    against those the loaded adapter holds (``get_peft_model_state_dict`` of each LoRA-loadable component). A
    matrix of the file that no layer holds matches no layer of the model; a layer holding a matrix the file lacks
    was given made-up weights. Keys in other layouts (alphas, full weights) are left to diffusers."""
    from peft.utils import get_peft_model_state_dict

    components = [c for c in getattr(pipe, "_lora_loadable_modules", ()) if getattr(pipe, c, None) is not None]
    loaded: set[str] = set()
    for c in components:
        try:
            keys = get_peft_model_state_dict(getattr(pipe, c), adapter_name=lora.adapter_name)
        except Exception:  # the component has no such adapter (no key of the file named it)
            continue
        loaded.update(f"{c}.{k}" for k in keys if k.endswith(_LORA_WEIGHT))
    try:
        converted = pipe.lora_state_dict(lora.path)
    except Exception:  # load_lora_weights read it: a conversion it did not need here
        return None
    if isinstance(converted, tuple):  # (state_dict, network_alphas[, metadata]) in some pipelines
        converted = converted[0]
    wanted = {k for k in converted if k.endswith(_LORA_WEIGHT)}
    bare = {k.split(".", 1)[1] for k in loaded}
    unmatched = sorted(k for k in wanted if k not in loaded and k not in bare)  # no component prefix: bare keys
    fresh = sorted(k for k in loaded if k not in wanted and k.split(".", 1)[1] not in wanted)
    name = type(pipe).__name__
    if unmatched:
        comp = next((c for c in components if unmatched[0].startswith(f"{c}.")), None)
        example = unmatched[0][len(comp) + 1:] if comp else unmatched[0]
        where = f"{name}'s {comp}" if comp else f"{name}'s model ({', '.join(components)})"
        return (f"{len(unmatched)} of its {len(converted)} tensors match no layer of {where} (e.g. {example!r}): a "
                "LoRA for another model? Use an adapter trained for this model")
    if fresh:
        return (f"{len(fresh)} LoRA weights of {name}'s model are not in the file (e.g. {fresh[0]!r}: diffusers would "
                "use made-up ones): a LoRA for another model? Use an adapter trained for this model")
    return None


def _fuse(pipe: Any, scales: dict[str, float]) -> None:
    """Fuse the adapters ``scales`` names (adapter name -> scale), in one order whatever the set: that of their
    names (their sha256), so equal sets give equal weights, and a compiled layer's merged adapters keep one order."""
    names = sorted(scales)
    pipe.set_adapters(names, [scales[n] for n in names])
    pipe.fuse_lora(components=list(pipe._lora_loadable_modules), adapter_names=names)


def fuse_into(pipe: Any, loras: LoraSet) -> None:
    """Fuse ``loras`` into ``pipe``'s weights for good and drop the peft layers: the pipeline is the base one with
    adapted weights (what tp then shards)."""
    if not loras:
        return
    _check_pipeline(pipe)
    for i, lora in enumerate(loras):
        _load(pipe, lora, f"model.loras[{i}]")
    _fuse(pipe, {lo.adapter_name: lo.scale for lo in loras})
    pipe.unload_lora_weights()
    log.info("LoRA fused: %s", _names(loras))


class _Factor(NamedTuple):
    """One adapter's low-rank factors for one layer, as peft held them once loaded: ``base`` the layer's own
    (unwrapped) module, ``a``/``b`` its LoRA matrices, and what peft's ``get_delta_weight`` scales them by."""

    base: Any
    a: Any
    b: Any
    alpha: float
    r: int
    rslora: bool
    fan_in_fan_out: bool


def _delta(f: _Factor, scale: float) -> Any:
    """peft's ``Linear.get_delta_weight`` at ``scale`` (``set_scale``'s scaling), operation for operation: the bytes
    of the weights peft's own merge makes, so a row's set gives the pixels of a run with that set in model.loras."""
    import torch

    dtype = f.b.dtype
    cast = f.b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    a, b = (f.a.float(), f.b.float()) if cast else (f.a, f.b)
    scaling = scale * f.alpha / math.sqrt(f.r) if f.rslora else scale * f.alpha / f.r
    out = b @ a
    out = (out.T if f.fan_in_fan_out else out) * scaling
    return out.to(dtype=dtype) if cast else out


class AdapterSets:
    """Switches a pipeline between adapter sets, batch by batch (rows with their own ``loras``), in time proportional
    to the adapters that change.

    Each adapter is loaded once through diffusers (its checks: ``_load``), its low-rank factors kept per layer, and
    unloaded again: the model keeps its own modules, never more peft layers as adapters accumulate. A switch restores
    the base weights of the layers the old or the new set adapts (a copy kept of each adapted layer) and adds each
    adapter of the new set as peft's merge does (``_delta``, in ``_fuse``'s one order: by sha256): the same bytes as
    fusing that set alone. Weights change in place, so a compiled transformer's guards hold and switching compiles
    nothing."""

    def __init__(self, pipe: Any):
        _check_pipeline(pipe)
        self.pipe = pipe
        self.current: LoraSet = ()
        self._factors: dict[str, list[_Factor]] = {}  # adapter name -> its factors, one per layer it adapts
        self._base: dict[int, tuple[Any, Any]] = {}  # id(adapted module) -> (module, its base weight's copy)

    def activate(self, loras: LoraSet, load: Iterable[Lora] = ()) -> None:
        """Make ``loras`` the fused set, loading its adapters (and those of ``load``) not loaded yet."""
        import torch

        loras = tuple(loras)
        for lora in {lo.adapter_name: lo for lo in (*loras, *load)}.values():
            if lora.adapter_name not in self._factors:
                self._take(lora)
        if loras == self.current:
            return
        touched = {id(f.base): f.base for lo in (*self.current, *loras) for f in self._factors[lo.adapter_name]}
        with torch.no_grad():
            for key in touched:
                module, weight = self._base[key]
                module.weight.copy_(weight, non_blocking=weight.is_pinned())
            scales = {lo.adapter_name: lo.scale for lo in loras}
            for name in sorted(scales):
                for f in self._factors[name]:
                    f.base.weight.data += _delta(f, scales[name])
        self.current = loras

    def _take(self, lora: Lora) -> None:
        """Load ``lora`` through diffusers (LoraError when it does not fit), keep its factors and a copy of each
        layer's base weight not kept yet (never adapted so far: still the base), and unload it again."""
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer

        pipe, name = self.pipe, lora.adapter_name
        _load(pipe, lora)
        factors = []
        try:
            for component in pipe._lora_loadable_modules:
                model = getattr(pipe, component, None)
                for layer in (m for m in (model.modules() if model is not None else ())
                              if isinstance(m, BaseTunerLayer) and name in getattr(m, "lora_A", {})):
                    if type(layer) is not LoraLinear or name in getattr(layer, "lora_variant", {}) \
                            or getattr(layer, "lora_bias", {}).get(name):
                        raise LoraError(f"{lora.path}: adapts {type(layer.get_base_layer()).__name__} layers, or with "
                                        "DoRA or a bias, which rows' own adapters cannot switch; give it in "
                                        "model.loras instead")
                    factors.append(_Factor(layer.get_base_layer(), layer.lora_A[name].weight.detach(),
                                           layer.lora_B[name].weight.detach(), layer.lora_alpha[name], layer.r[name],
                                           bool(layer.use_rslora.get(name, False)), bool(layer.fan_in_fan_out)))
        finally:
            pipe.unload_lora_weights()  # the model's own modules back in place (the factors keep the matrices)
        fresh = [f.base for f in factors if id(f.base) not in self._base]
        where = _copy_place([m.weight for m in fresh])
        for module in fresh:
            self._base[id(module)] = (module, _copy_to(module.weight, where))
        self._factors[name] = factors


HEADROOM = 8 << 30
"""Device memory left free after keeping a copy of the adapted weights there (activations, the VAE's decode)."""


def _copy_place(tensors: list) -> str:
    """Where the copy of the adapted layers' base weights is kept: beside them on their GPU when it has the room
    and HEADROOM to spare (restoring is then a device-to-device copy), else in pinned host memory (an asynchronous
    copy over PCIe; pageable memory is copied through a staging buffer, several times slower)."""
    import torch

    devices = {t.device for t in tensors}
    if len(devices) == 1 and (device := devices.pop()).type == "cuda":
        need = sum(t.numel() * t.element_size() for t in tensors)
        free, _ = torch.cuda.mem_get_info(device)
        if free - need >= HEADROOM:
            return "device"
        return "pinned"
    return "cpu"


def _copy_to(t: Any, where: str) -> Any:
    t = t.detach()
    if where == "device":
        return t.clone()
    copy = t.to("cpu", copy=True)
    return copy.pin_memory() if where == "pinned" else copy


def activate(pipe: Any, loras: LoraSet) -> None:
    """Before a pipeline call: the call's adapter set fused into ``pipe`` (no-op when it already is)."""
    sets = getattr(pipe, "_shardgen_adapter_sets", None)
    if sets is not None:
        sets.activate(loras)
        return
    built = getattr(pipe, "_shardgen_loras", ())
    if tuple(loras) != built:
        raise LoraError(f"a call asks for LoRA adapters {_names(loras)} and the pipeline has {_names(built)} fused; "
                        "build it with shardgen.models.lora.apply(pipe, cfg) (rows naming their own adapters need "
                        f"{ROW_FIELD} in prompts.row_settings)")


def _names(loras: LoraSet) -> str:
    return "[" + ", ".join(f"{Path(lo.path).name} x{lo.scale:g}" for lo in loras) + "]"


def preload(pipe: Any, adapters: dict[str, str]) -> None:
    """Load the adapters a run's rows name (``Plan.adapters()``: sha256 -> path) before its first batch: one that
    does not fit the model stops the job before any generation, and switching never changes the layers of a compiled
    transformer. A file no longer at its planned path loads when its rows come."""
    sets = getattr(pipe, "_shardgen_adapter_sets", None)
    if sets is None or not adapters:
        return
    here = [Lora(path, 1.0, digest) for digest, path in sorted(adapters.items(), key=lambda kv: kv[1])
            if Path(path).is_file()]
    sets.activate(sets.current, load=here)


def apply(pipe: Any, cfg: Any) -> Any:
    """The run's adapters applied to a freshly loaded ``pipe`` (before any strategy splits it): fused for good, or,
    when rows name their own, ready to switch set by set. Returns ``pipe``."""
    loras = run_set(cfg)
    if per_row(cfg):
        pipe._shardgen_adapter_sets = AdapterSets(pipe)
        pipe._shardgen_adapter_sets.activate(loras)
    else:
        fuse_into(pipe, loras)
        pipe._shardgen_loras = loras
    return pipe
