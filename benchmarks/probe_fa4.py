"""Attention kernels at each model's joint-attention shape on one GPU, FlashAttention-4 among them when installed.

    python benchmarks/probe_fa4.py [--out DIR] [--iters 20]

For every model in conf/model/ that fits one GPU, at its default size (1024x1024 images, Wan 480x832x33) and the
batch the default path runs, times one attention call (CUDA events, median) with each SDPA kernel torch has
(cudnn / flash / efficient) and, where the ``flash-attn-4`` package imports, FlashAttention-4: through torch's own
hook as shardgen activates it (``shardgen.speed.fa4``: SDPA's flash kernel becomes FA4, so the processors and
compiled graphs call it unchanged) and directly (``flash_attn.cute.flash_attn_func`` on
(batch, tokens, heads, dim)). Each output is compared with a float32 reference of the first sample's first two heads. Also: the
first FA4 call's time (its kernels are compiled just in time) and FA4 inside a ``torch.compile(fullgraph=True)``
region. Results: ``$OUT/probe_fa4.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from probe_attention import timed  # benchmarks/: the median of CUDA-event timings after a warm-up

# (batch, heads, tokens, head_dim) of one joint-attention call on the default path (batch 4; Wan: 2 videos)
SHAPES = {
    "flux_dev": (4, 24, 4096 + 512, 128),
    "flux2_dev": (4, 48, 4096 + 512, 128),
    "qwen_image": (4, 24, 4096 + 128, 128),
    "sd35_large": (4, 38, 4096 + 333, 64),
    "wan21_t2v_1_3b": (2, 12, 9 * 1560, 128),  # 33 frames
    "wan21_t2v_1_3b_81f": (2, 12, 21 * 1560, 128),  # its default 81 frames
}
KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


def tflops(shape, ms: float) -> float:
    b, h, s, d = shape
    return 4 * b * h * s * s * d / (ms * 1e-3) / 1e12


def probe_shape(name: str, shape, iters: int, fa4_direct, activate) -> dict:
    b, h, s, d = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3) for _ in range(3))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float())
    out = {"shape": list(shape)}

    def record(kernel, fn):
        try:
            t0 = time.perf_counter()
            o = fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            err = (o[:1, :2].float() - ref).abs()
            ms = timed(fn, iters, warm=3)
            out[kernel] = {"ms": round(ms, 3), "tflops": round(tflops(shape, ms), 1), "first_call_s": round(first, 2),
                           "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean())}
        except Exception as e:  # a kernel that does not take this shape/device
            out[kernel] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, kernel, out[kernel], flush=True)

    for kernel, backend in KERNELS.items():
        def call(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)
        record(kernel, call)
    if fa4_direct is not None:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (b, s, h, d) views, as diffusers holds them

        def direct():
            o = fa4_direct(qt, kt, vt)
            return (o[0] if isinstance(o, tuple) else o).transpose(1, 2)
        record("fa4_direct", direct)
    if activate:
        from shardgen.speed import fa4

        fa4.activate()
        try:
            def fa4_sdpa():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v)
            record("fa4_sdpa", fa4_sdpa)

            @torch.compile(fullgraph=True, dynamic=False)
            def region(q, k, v):
                return F.scaled_dot_product_attention(q * 1.0, k, v) + 0.0

            def compiled():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return region(q, k, v)
            record("fa4_compiled", compiled)
        finally:
            fa4.restore()
    q = k = v = ref = None  # the tensors freed before the cache is emptied (the closures above hold them too)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated model names")
    args = ap.parse_args()
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version()}
    try:
        from flash_attn.cute import flash_attn_func
        import flash_attn
        res["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception as e:  # not installed here
        flash_attn_func = None
        res["flash_attn"] = f"not importable: {type(e).__name__}: {str(e)[:300]}"
    from shardgen.speed import fa4

    why = fa4.unavailable_reason("cuda")
    activate = why is None
    res["fa4_hook"] = why or "available"
    print(res, flush=True)
    only = [m for m in args.only.split(",") if m]
    res["shapes"] = {m: probe_shape(m, shape, args.iters, flash_attn_func, activate)
                     for m, shape in SHAPES.items() if not only or m in only}
    path = Path(args.out) / "probe_fa4.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
