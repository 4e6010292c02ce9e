"""``sdpa``: the kernel behind diffusers' default attention backend (torch SDPA). ``auto`` measures flash /
efficient / cudnn (and FlashAttention-3's bf16 kernel where ``fa3-fwd`` is installed: ``speed/fa3.py``) once per
process at the run's attention shape, checks each against the others, and puts the fastest first in SDPA's priority
order, or routes the calls FA3 takes to it (inside each pipeline call only: ``sdpa_context``). Without it torch picks
flash (FA2), which on an H100/H200 is slower than cuDNN's fused attention. Nothing is applied by ``prepare``: the
choice is a context around each call. ``fa3`` asks for FA3's kernel by name. ``fa4`` (asked for by name, never by
``auto``: ``speed/fa4.py``) makes FlashAttention-4 the process's flash kernel and puts it first. ``sage``, ``fp8``
and ``fa3_fp8`` (opt-in, LOSSY: ``speed/sage.py``, ``speed/fp8_attention.py``, ``speed/fa3_fp8.py``) send the
calls they take to an 8-bit kernel (SageAttention's, shardgen's own INT8 ``QK^T`` / float8 ``PV``, or
FlashAttention-3's float8 one), the others to the kernels ``auto`` chose.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import torch

from shardgen.config.schema import EIGHT_BIT_ATTENTION
from shardgen.pick import pick
from shardgen.speed.techniques import AccelError, AccelOptions
from shardgen.speed.techniques import Technique, register_technique

log = logging.getLogger("shardgen.accel")

SDPA_CHOICES = ("auto", "default", "flash", "efficient", "cudnn", "math", "fa3", "fa4", "sage", "fp8", "fa3_fp8",
                "auto_8bit")
TORCH_KERNELS = ("flash", "cudnn", "efficient")  # what auto times always; fa3 too where it runs
EIGHT_BIT = EIGHT_BIT_ATTENTION  # the lossy kernels: sdpa_backend=NAME is in the fingerprint and provenance
AUTO_8BIT = "auto_8bit"  # one of them where it pays, else auto: chosen per run (shardgen/run/auto_8bit.py)
SDPA_MARGIN = 0.95  # sdpa=auto leaves torch's flash kernel only for one at least 5% faster (stable choice)
MEASURE_BYTES = 1 << 30  # the largest q (or k, v) sdpa=auto times the kernels on: measure_batch


@dataclass(frozen=True)
class SdpaConfig:
    """The option this technique reads."""

    sdpa: str = "auto"
    """auto | default | flash | efficient | cudnn | math | fa3 | fa4 | sage | fp8 | fa3_fp8 | auto_8bit
    (``sdpa_backend``; a run resolves auto_8bit to one of the others: shardgen/run/auto_8bit.py)."""


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "fa4": SDPBackend.FLASH_ATTENTION,  # FA4 runs as SDPA's flash
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


_SDPA_CHOICE: dict[tuple, tuple[str, dict]] = {}


def chosen_sdpa() -> dict[str, tuple[str, dict]]:
    """The attention kernels ``sdpa=auto`` chose in this process: (device, dtype, shape) -> (kernel, timings)."""
    return {str(k): v for k, v in _SDPA_CHOICE.items()}


def measure_sdpa(device: torch.device, dtype: torch.dtype, batch: int, heads: int, seq: int, head_dim: int,
                 iters: int = 5) -> dict:
    """ms per call of each fused SDPA kernel on (batch, heads, seq, head_dim) in diffusers' layout (a long video's
    batch one sample at a time: ``measure_batch``), and its largest deviation from the first kernel that ran, on the
    first sample's first two heads (a broken kernel is not chosen); FA3's (``fa3``) where it runs here."""
    from torch.nn.attention import sdpa_kernel

    torch.manual_seed(0)
    batch = measure_batch(batch, heads, seq, head_dim, dtype.itemsize)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).permute(0, 2, 1, 3)
               for _ in range(3))
    res, ref = {}, None
    kernels = TORCH_KERNELS + (("fa3",) if _fa3().unavailable_reason(device) is None else ())
    for name in kernels:
        try:
            with contextlib.nullcontext() if name == "fa3" else sdpa_kernel([_backend(name)]):
                call = _fa3().attention if name == "fa3" else torch.nn.functional.scaled_dot_product_attention
                out = call(q, k, v)
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    call(q, k, v)
                end.record()
                end.synchronize()
            sample = out[:1, :2].float()  # not the whole output in float32: GBs at a long video's length
            err = 0.0 if ref is None else float((sample - ref).abs().max())
            ref = sample if ref is None else ref
            res[name] = {"ms": start.elapsed_time(end) / iters, "max_abs_diff": err}
        except Exception as e:  # not available for this device/shape/dtype
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return res


def _fa3():
    """The module of FlashAttention-3's bf16 kernel (imported when first used, as the 8-bit kernels' are)."""
    from shardgen.speed import fa3

    return fa3


def measure_batch(batch: int, heads: int, seq: int, head_dim: int, itemsize: int = 2) -> int:
    """The batch the kernels are timed at: the run's, or 1 where one of q, k, v would be larger than MEASURE_BYTES
    (a 720p Wan 14B video: 75,600 tokens x 40 heads x 128 = 774 MB a sample), so timing never needs more memory
    than the run's own attention; at such lengths the fastest kernel for one sample is the fastest for four."""
    return batch if batch * heads * seq * head_dim * itemsize <= MEASURE_BYTES else 1


def choose_sdpa(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> tuple[str, dict]:
    """The fastest correct fused kernel for this attention shape (measured once per process)."""
    key = (str(device), dtype, shape[1:])  # chosen once per run: the last, smaller batch keeps the kernel
    if key not in _SDPA_CHOICE:
        timings = measure_sdpa(device, dtype, *shape)
        best = pick_kernel(timings)
        _SDPA_CHOICE[key] = (best, timings)
        log.info("attention kernel for %s: %s (%s)", shape, best,
                 ", ".join(f"{n} {t['ms']:.2f} ms" for n, t in timings.items() if "ms" in t))
    return _SDPA_CHOICE[key]


def pick_kernel(timings: dict) -> str:
    """The kernel ``sdpa=auto`` takes from ``measure_sdpa``'s timings: the fastest that agrees with the others,
    torch's flash unless another is 5% faster."""
    ok = {n: t for n, t in timings.items() if "ms" in t and t["max_abs_diff"] < 0.05}
    best = min(ok, key=lambda n: ok[n]["ms"]) if ok else "default"
    if best != "flash" and "flash" in ok and ok[best]["ms"] > SDPA_MARGIN * ok["flash"]["ms"]:
        best = "flash"  # torch's own first choice, unless another kernel is clearly faster
    return best


def attention_shape(pipe, height: int, width: int, batch: int, text_tokens: int,
                    input_size: tuple[int, int] | None = None,
                    num_frames: int | None = None) -> tuple[int, int, int, int] | None:
    """(batch, heads, tokens, head_dim) of the transformer's joint attention, from its config; ``input_size``: the
    (width, height) of the input image whose latent tokens join the sample's (an edit model's conditioned call: the
    sample's size for Kontext and FLUX.2, ~1024x1024 for Qwen-Image-Edit). A video pipeline's (``num_frames``):
    its self-attention over every latent frame's tokens."""
    tr = getattr(pipe, "transformer", None)
    cfg = getattr(tr, "config", None)
    if cfg is None or "num_attention_heads" not in cfg or "attention_head_dim" not in cfg:
        return None
    if num_frames is not None and hasattr(pipe, "vae_scale_factor_temporal"):
        return batch, int(cfg.num_attention_heads), _video_tokens(pipe, cfg, num_frames, height, width), \
            int(cfg.attention_head_dim)
    factor = getattr(pipe, "vae_scale_factor", 8) * 2  # latents packed in 2x2 patches
    tokens = (height // factor) * (width // factor) + text_tokens
    if input_size is not None:
        tokens += (input_size[1] // factor) * (input_size[0] // factor)
    return batch, int(cfg.num_attention_heads), int(tokens), int(cfg.attention_head_dim)


def _video_tokens(pipe, cfg, num_frames: int, height: int, width: int) -> int:
    """A video transformer's self-attention tokens: latent frames x latent pixels, in its (time, height, width)
    patches (Wan: 4x temporal, 8x spatial compression, 1x2x2 patches; the text enters by cross-attention)."""
    pt, ph, pw = tuple(cfg.get("patch_size", None) or (1, 2, 2))
    spatial = getattr(pipe, "vae_scale_factor_spatial", 8)
    latent_frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
    return (latent_frames // pt) * (height // spatial // ph) * (width // spatial // pw)


def sdpa_context(pipe, opts: AccelOptions, shape: tuple[int, int, int, int] | None):
    """A context for one pipeline call that puts the chosen SDPA kernel first (a no-op off CUDA, with
    ``sdpa=default``, or when the transformer uses another diffusers attention backend)."""
    device = getattr(pipe, "_execution_device", None) or getattr(pipe, "device", None)
    if opts.sdpa == AUTO_8BIT:  # not resolved by a run (shardgen/run/auto_8bit.py): lossless until it is
        opts = replace(opts, sdpa="auto")
    if opts.sdpa == "default" or device is None or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    if opts.sdpa in EIGHT_BIT:  # 8-bit attention where it takes the call; torch's kernels, auto's choice, elsewhere
        # auto times torch's kernels here, before the 8-bit kernel takes SDPA's place (else it would time that one)
        return _stacked(sdpa_context(pipe, replace(opts, sdpa="auto"), shape), eight_bit_kernel(opts.sdpa).context())
    if opts.sdpa == "fa3":  # FA3 where it takes the call; auto's choice elsewhere
        return _stacked(sdpa_context(pipe, replace(opts, sdpa="auto"), shape), _fa3().context())
    if opts.sdpa == "math":
        name = "math"
    elif opts.sdpa == "auto":
        if shape is None or not _uses_native_attention(pipe.transformer):
            return contextlib.nullcontext()
        name, timings = choose_sdpa(torch.device(device), pipe.transformer.dtype, shape)
        if name == "fa3":  # torch's fastest for the calls FA3 does not take (a mask, another head size)
            rest = pick_kernel({n: t for n, t in timings.items() if n != "fa3"})
            return _stacked(_torch_order(rest), _fa3().context())
    else:
        name = opts.sdpa
    return _torch_order(name)


def _stacked(*contexts):
    """The contexts entered in order (the last innermost), as one."""
    stack = contextlib.ExitStack()
    for context in contexts:
        stack.enter_context(context)
    return stack


def _torch_order(name: str):
    """SDPA's priority order with torch's kernel ``name`` first (``default``: torch's own order, nothing set)."""
    from torch.nn.attention import sdpa_kernel

    if name == "default":
        return contextlib.nullcontext()
    if name == "fa4":
        from shardgen.speed import fa4

        fa4.activate()  # process-wide: SDPA's flash kernel is FA4 from here on
    order = [_kernel(name)] + [n for n in ("flash", "cudnn", "efficient", "math") if n != _kernel(name)]
    try:
        return sdpa_kernel([_backend(n) for n in order], set_priority=True)
    except TypeError:  # torch without set_priority: the chosen kernel only (and math as a fallback)
        return sdpa_kernel([_backend(name), _backend("math")])


def eight_bit_kernel(name: str):
    """The module of an 8-bit attention kernel (``sage``, ``fp8`` or ``fa3_fp8``): its ``unavailable_reason``,
    ``context``, ``HEAD_DIMS``."""
    if name == "sage":
        from shardgen.speed import sage

        return sage
    if name == "fa3_fp8":
        from shardgen.speed import fa3_fp8

        return fa3_fp8
    from shardgen.speed import fp8_attention

    return fp8_attention


def _kernel(name: str) -> str:
    """SDPA's kernel name for a choice (FA4 runs as SDPA's flash kernel once active)."""
    return "flash" if name == "fa4" else name


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


def validate(opts: AccelOptions, device=None) -> None:
    """AccelError for a kernel name SDPA does not have, or FA4 asked for on a GPU where it cannot run (without a
    visible GPU the device check says so)."""
    name = pick(SdpaConfig, opts).sdpa
    if name not in SDPA_CHOICES:
        raise AccelError(f"sdpa_backend={name!r}: use one of {list(SDPA_CHOICES)}")
    if name in ("fa3", "fa4") and device is not None and torch.device(device).type == "cuda" \
            and torch.cuda.is_available():
        from shardgen.speed import fa3, fa4

        kernel = {"fa3": fa3, "fa4": fa4}[name]
        why = kernel.unavailable_reason(device)
        if why:
            raise AccelError(f"sdpa_backend={name}: {why}. {kernel.INSTALL}; or use sdpa_backend=auto (measures the "
                             "kernels this machine has)")
    if name in EIGHT_BIT and device is not None and (torch.device(device).type != "cuda" or torch.cuda.is_available()):
        kernel = eight_bit_kernel(name)
        if why := kernel.unavailable_reason(device):
            install = f"{kernel.INSTALL}; or" if hasattr(kernel, "INSTALL") else "Use"
            raise AccelError(f"sdpa_backend={name}: {why}. {install} sdpa_backend=auto (lossless)")


def _apply(step) -> dict:
    """With an 8-bit kernel (sdpa_backend=fp8, fa3_fp8 or sage) or FA3's bf16 one (fa3) on a GPU: the kernel checked
    on the rank's GPU once
    per process, when the pipeline is first prepared (outside any sample: a failure ends the job in one line). Nothing
    else is applied here: the kernel choice is a context around each call (``sdpa_context``). A transformer whose
    attention does not go through torch's SDPA is refused (the strategy's checks refuse the configurations that do
    so before any weight is read; this is the last line for any other)."""
    name = step.opts.sdpa
    if step.device is None or torch.device(step.device).type != "cuda":
        return {}
    if name == "fa3":
        return {"fa3_attention_error": round(_check_lossless(step), 4)}
    if name not in EIGHT_BIT:
        return {}
    if step.transformer is not None and not _uses_native_attention(step.transformer):
        raise AccelError(f"sdpa_backend={name} replaces torch's SDPA, and this transformer's attention runs through "
                         "another diffusers attention backend: the 8-bit kernel would never run. Set "
                         "sdpa_backend=auto")
    kernel = eight_bit_kernel(name)
    dim = getattr(getattr(step.transformer, "config", None), "attention_head_dim", None)
    dims = (dim,) if dim in kernel.HEAD_DIMS else kernel.HEAD_DIMS
    return {f"{name}_attention_error": round(_check_kernel(name, step.device, dims), 4)}


FA3_BOUND = 0.02  # relative RMS against exact float32 attention: bf16 kernels are ~0.3% off it


def _check_lossless(step) -> float:
    """FA3's bf16 kernel (``sdpa_backend=fa3``) against exact attention on the rank's GPU, before any sample:
    AccelError where a build or GPU runs it wrong."""
    from shardgen.speed import fa3
    from shardgen.speed.sdpa_route import self_check

    dim = getattr(getattr(step.transformer, "config", None), "attention_head_dim", None)
    err = self_check("fa3", lambda q, k, v: fa3.attention(q, k, v), step.device,
                     (dim,) if dim in fa3.HEAD_DIMS else fa3.HEAD_DIMS)
    if err > FA3_BOUND:
        raise AccelError(f"sdpa_backend=fa3: FlashAttention-3's output is {err:.1%} off exact attention on this GPU "
                         f"(a bf16 kernel is ~0.3% off): fa3-fwd does not run right here. Use sdpa_backend=auto")
    return err


KERNEL_NAMES = {"fp8": "the float8 attention kernel", "sage": "SageAttention",
                "fa3_fp8": "FlashAttention-3's float8 kernel"}
OTHER_KERNEL = {"fp8": "sage", "sage": "fp8", "fa3_fp8": "fp8"}  # the 8-bit way a refusal names beside lossless
# the packages each kernel runs on (their versions are named when it does not run): the distribution names
KERNEL_PACKAGES = {"fp8": ("triton",), "sage": ("sageattention", "triton"), "fa3_fp8": ("fa3-fwd", "triton")}


def _package_versions(name: str) -> str:
    """``"fa3-fwd 0.0.3, triton 3.5.0"``: the installed versions of the packages kernel ``name`` runs on."""
    from importlib.metadata import PackageNotFoundError, version

    def one(package):
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            return f"{package} not installed"

    return ", ".join(one(p) for p in KERNEL_PACKAGES[name])


def _check_kernel(name: str, device, head_dims: tuple[int, ...] | None = None) -> float:
    """The 8-bit attention kernel ``name``'s error on this device against exact attention
    (``sdpa_route.self_check``); AccelError, naming its packages' versions and the other ways, when it cannot be
    built or launched here (Triton's compiler, FA3's library) or it is further off than an 8-bit method is."""
    from shardgen.speed.sdpa_route import SELF_CHECK_BOUND, self_check

    kernel = eight_bit_kernel(name)
    where = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)
    other = OTHER_KERNEL[name]
    way_out = f"Use sdpa_backend=auto (lossless) or sdpa_backend={other}"
    try:
        err = self_check(name, lambda q, k, v: kernel.attention(q, k, v), device, head_dims or kernel.HEAD_DIMS)
        if hasattr(kernel, "check_parts"):  # its passes straight from the projections (rms_rope_attention)
            err = max(err, self_check(f"{name} from projections", kernel.check_parts, device,
                                      head_dims or kernel.HEAD_DIMS, exact=kernel.check_parts_exact))
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # it cannot be compiled or launched here (an older Triton, a driver it does not know)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise AccelError(f"sdpa_backend={name}: {KERNEL_NAMES[name]} does not run on {where} with "
                         f"{_package_versions(name)} ({type(e).__name__}: {first}). {way_out}") from e
    if err > SELF_CHECK_BOUND:
        raise AccelError(f"sdpa_backend={name}: {KERNEL_NAMES[name]}'s output is {err:.1%} off exact attention on "
                         f"{where} (an 8-bit method costs a few percent; bound {SELF_CHECK_BOUND:.0%}): this GPU or "
                         f"{_package_versions(name)} does not run it right. {way_out}")
    return err


register_technique(Technique("sdpa", 40, _apply, validate=validate,
                             lossy=lambda opts: {"sdpa": opts.sdpa} if opts.sdpa in EIGHT_BIT else {}))
