"""What the benchmark measures with: device rates, transformer timing and FLOPs, GPU idle time from a
profiler trace, PSNR, memory, dynamo's compilation count, and the images each way wrote."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from shardgen.speed.autocompile import compiled_graphs  # noqa: F401  (the bench's ways import it from here)

GiB = 1024 ** 3




def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype) -> dict:
    """The matmul rate of this device in ``dtype``: the best of a few big square products (TFLOP/s)."""
    sizes = (8192, 16384) if device.type == "cuda" else (512, 1024)
    best, per = 0.0, {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):
            torch.matmul(a, b)
        iters = 10 if device.type == "cuda" else 3
        sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                torch.matmul(a, b)
            end.record()
            end.synchronize()
            sec = start.elapsed_time(end) / 1e3
        else:
            for _ in range(iters):
                torch.matmul(a, b)
            sec = time.perf_counter() - t0
        rate = 2 * n ** 3 * iters / sec / 1e12
        per[n] = round(rate, 1)
        best = max(best, rate)
        del a, b
    return {"tflops": best, "per_size": per, "dtype": str(dtype).replace("torch.", "")}


class TransformerTimer:
    """GPU time inside each transformer call (CUDA events around forward; wall time on a CPU)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs: list = []
        self.captured: tuple | None = None
        self.capture_next = False
        self._open = None
        self._h = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                   module.register_forward_hook(self._post)]

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        if self.capture_next:  # keep one call's inputs for the FLOP count
            self.capture_next = False
            clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x
            self.captured = (tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()})
        self._open = self._now()

    def _post(self, module, args, output):
        self.pairs.append((self._open, self._now()))

    def reset(self) -> None:
        self.pairs = []

    def total_s(self, first: int = 0) -> float:
        """Seconds inside the transformer over the calls from the ``first``-th on."""
        pairs = self.pairs[first:]
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        return sum(b - a for a, b in pairs)

    def remove(self) -> None:
        for h in self._h:
            h.remove()


def count_flops(module: torch.nn.Module, captured) -> float:
    """FLOPs of one forward call with the captured inputs (matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    args, kwargs = captured
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        module(*args, **kwargs)
    return float(fc.get_total_flops())


def flux_flops(config, image_tokens: int, text_tokens: int) -> float:
    """FLOPs of one FLUX transformer call for one image, from the config (matmuls and attention).

    Per block (double- or single-stream) and token: q, k, v, out projections (4 D^2 MACs) and an MLP of
    ratio 4 (8 D^2 MACs) = 12 D^2 MACs; attention over all N tokens: QK^T and AV = 2 N^2 D MACs.
    Plus the input/output embeddings. FLOPs = 2 x MACs.
    """
    d = config.num_attention_heads * config.attention_head_dim
    n = image_tokens + text_tokens
    blocks = config.num_layers + config.num_single_layers
    macs = blocks * (12 * d * d * n + 2 * n * n * d)
    macs += image_tokens * config.in_channels * d + text_tokens * config.joint_attention_dim * d
    macs += image_tokens * d * (config.out_channels or config.in_channels)
    return 2.0 * macs


def gpu_busy_s(prof) -> tuple[float, int, list[float], dict[str, float]]:
    """(seconds during which at least one kernel/copy ran, number of GPU activities, 5 largest gaps in ms,
    the 12 kernels with the most GPU time in ms)."""
    from collections import Counter

    from torch.autograd import DeviceType

    spans, per_kernel = [], Counter()
    try:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == DeviceType.CUDA:
                spans.append((e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3))  # us
                per_kernel[e.name()[:120]] += e.duration_ns() / 1e6
    except Exception:  # older/newer internals: the public (slower) path
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                spans.append((e.time_range.start, e.time_range.end))
                per_kernel[e.name[:120]] += (e.time_range.end - e.time_range.start) / 1e3
    top = {k: round(v, 1) for k, v in per_kernel.most_common(12)}
    if not spans:
        return 0.0, 0, [], top
    spans.sort()
    busy, gaps = 0.0, []
    cur_a, cur_b = spans[0]
    for a, b in spans[1:]:
        if a > cur_b:
            busy += cur_b - cur_a
            gaps.append(a - cur_b)
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    return busy / 1e6, len(spans), [round(g / 1e3, 2) for g in sorted(gaps, reverse=True)[:5]], top


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def psnr_stats(images: dict[int, np.ndarray], ref: dict[int, np.ndarray]) -> dict:
    """PSNR of ``images`` against ``ref`` over the indices both hold: first, mean of the finite ones
    (inf when all are identical), min, n; None figures when they share none."""
    vals = [psnr(images[i], ref[i]) for i in sorted(images) if i in ref]
    finite = [v for v in vals if not math.isinf(v)]
    return {"first": vals[0] if vals else None, "mean": float(np.mean(finite)) if finite else math.inf,
            "min": min(vals) if vals else None, "n": len(vals)}


def read_outputs(folder: Path, n: int) -> dict[int, np.ndarray]:
    """The baseline loop's ``000000.png`` (or ``.mp4``) ... of ``folder`` as RGB arrays (videos: FxHxWx3), by index."""
    from shardgen.dataio.shards import decode_video
    from shardgen.rasters import decode_rgb

    out = {}
    for i in range(n):
        video = folder / f"{i:06d}.mp4"
        out[i] = decode_video(video.read_bytes())[0] if video.exists() else \
            decode_rgb((folder / f"{i:06d}.png").read_bytes(), str(folder / f"{i:06d}.png"))
    return out


def fmt_db(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1f}"


def peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_allocated_GiB": round(torch.cuda.max_memory_allocated(device) / GiB, 2),
                "peak_reserved_GiB": round(torch.cuda.max_memory_reserved(device) / GiB, 2)}
    import resource

    return {"peak_rss_GiB_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def shard_images(run_dir: Path) -> dict[int, np.ndarray]:
    """prompt index -> decoded image (a video: its FxHxWx3 frames) of every committed sample of a run."""
    from shardgen.dataio.shards import read_shard_members
    from shardgen.rasters import decode_rgb

    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for key, mem in read_shard_members(tar).items():
            img = next((v for k, v in mem.items() if k in ("png", "jpg", "webp")), None)
            if img is not None:
                out[int(key)] = decode_rgb(img, f"{tar}: {key}")
            elif "mp4" in mem:
                from shardgen.dataio.shards import decode_video

                out[int(key)] = decode_video(mem["mp4"])[0]
    return out


