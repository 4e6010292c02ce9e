"""Probe where the compiled FLUX transformer's time goes, and what fusions buy, on one GPU.

    python benchmarks/probe_transformer.py [--batch 4] [--variants base,cd,fused_cd,...] [--profile]

Builds the FLUX.1-dev transformer alone (``shardgen.models.dummy``: real shapes, random bf16 weights), feeds it
one 1024x1024 step's inputs (4096 image + 512 text tokens) and, for each variant, compiles the
repeated blocks (``shardgen.speed.accel.compile_blocks``), times a batch call with CUDA events (median of
``--iters``) and compares sample 0's output with the eager batch-1 output and a float32 reference
(relative RMS error, and the same for eager batch 4: what batching alone changes). ``--profile`` prints
the top kernels of one call of each variant. Results go to ``$OUT/probe_transformer.json``.

Variants, ``_``-joined tokens: ``base`` = plain regional compilation; ``fused`` = shardgen/families/flux/fused.py's
block forwards (``cat``: without splitting the single blocks' proj_out; ``nocompile``: not compiled;
``plain``: without the eager-only LayerNorm+modulation and residual fusions);
``cd`` = inductor's coordinate-descent tuning of its Triton kernels; ``emu`` = inductor's
``emulate_precision_casts`` (round fused intermediates to bf16 where eager does). It also checks the
``rms_rope`` Triton kernel against eager diffusers.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 1024 ** 3


def build(device, dtype):
    from shardgen.models.dummy import construct_meta, dummy_architecture, materialize_random

    spec = dummy_architecture("FluxPipeline")["transformer"]
    g = torch.Generator(device).manual_seed(0)
    return materialize_random(construct_meta(spec), device, dtype, generator=g).eval()


def inputs(batch, device, dtype, size=1024, text=512):
    g = torch.Generator(device).manual_seed(1)
    n = (size // 16) ** 2
    ids = torch.zeros(size // 16, size // 16, 3, device=device)
    ids[..., 1] = torch.arange(size // 16, device=device)[:, None]
    ids[..., 2] = torch.arange(size // 16, device=device)[None, :]
    return dict(
        hidden_states=torch.randn(batch, n, 64, device=device, dtype=dtype, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 4096, device=device, dtype=dtype, generator=g),
        pooled_projections=torch.randn(batch, 768, device=device, dtype=dtype, generator=g),
        timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device, dtype=torch.float32),
        img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text, 3, device=device),
        return_dict=False)


def first(kw, k=1):
    return {n: (v[:k] if torch.is_tensor(v) and v.ndim and n not in ("img_ids", "txt_ids") else v)
            for n, v in kw.items()}


@torch.no_grad()
def call(tr, kw):
    return tr(**kw)[0]


def time_call(tr, kw, iters):
    ms = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        call(tr, kw)
        e.record()
        e.synchronize()
        ms.append(s.elapsed_time(e))
    return statistics.median(ms), ms


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def check_rms_rope(dev, dt):
    """The Triton RMSNorm+RoPE kernel against eager diffusers' ops at FLUX's shapes (batch 1)."""
    from shardgen.speed import fused_kernels

    g = torch.Generator(dev).manual_seed(2)
    xt = (torch.randn(1, 512, 24, 128, device=dev, generator=g) * 2).to(dt)
    xi = (torch.randn(1, 4096, 24, 128, device=dev, generator=g) * 2).to(dt)
    wt = (torch.rand(128, device=dev, generator=g) + 0.5).to(dt)
    wi = (torch.rand(128, device=dev, generator=g) + 0.5).to(dt)
    ang = torch.rand(4608, 64, device=dev, generator=g) * 6
    cos, sin = ang.cos().repeat_interleave(2, -1).contiguous(), ang.sin().repeat_interleave(2, -1).contiguous()
    ref = fused_kernels.rms_rope_reference([xt, xi], [wt, wi], cos, sin, 1e-6)
    out = fused_kernels.rms_rope([xt, xi], [wt, wi], cos, sin, 1e-6)
    diff = (out.float() - ref.float()).abs()
    return {"identical": float((out == ref).float().mean()), "max_abs": float(diff.max()), "rel": rel(out, ref)}


def top_kernels(tr, kw, n=25):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(tr, kw)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows.append((t / 1e3, ev.count, ev.key[:110]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return {"total_ms": round(total, 2), "top": [(round(t, 2), c, k) for t, c, k in rows[:n]]}


def gemm_libs(device, dtype):
    """ms of the hot GEMM shapes (batch 4) with cuBLAS vs cuBLASLt as the preferred library."""
    shapes = [(18432, 3072, 3072), (18432, 3072, 12288), (18432, 12288, 3072), (18432, 15360, 3072),
              (18432, 3072, 9216), (16384, 3072, 9216)]
    out = {}
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except Exception as e:
            out[lib] = str(e)[:200]
            continue
        res = {}
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype)
            b = torch.randn(n, device=device, dtype=dtype)
            for _ in range(3):
                torch.nn.functional.linear(a, w, b)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                torch.nn.functional.linear(a, w, b)
            e.record()
            e.synchronize()
            ms = s.elapsed_time(e) / 20
            res[f"{m}x{k}->{n}"] = {"ms": round(ms, 3), "tflops": round(2 * m * k * n / ms / 1e9, 1)}
        out[lib] = res
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--variants", default="base,fused_nocompile,fused_cd,fused_cat_cd")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-fp32", action="store_true")
    ap.add_argument("--gemm", action="store_true")
    args = ap.parse_args()

    from shardgen.speed import accel

    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "batch": args.batch, "variants": {}}
    out = os.environ.get("OUT")

    def save():
        if out:
            Path(out, "probe_transformer.json").write_text(json.dumps(res, indent=1))

    if args.gemm:
        res["gemm_libs"] = gemm_libs(dev, dt)
        print(json.dumps(res["gemm_libs"]), flush=True)
    t0 = time.perf_counter()
    tr = build(dev, dt)
    kw = inputs(args.batch, dev, dt)
    kw1 = first(kw)
    print(f"built in {time.perf_counter() - t0:.1f}s; {torch.cuda.memory_allocated() / GiB:.1f} GiB", flush=True)

    ref_b1 = call(tr, kw1)
    eager_b4 = call(tr, kw)
    res["eager"] = {"b4_vs_b1": rel(eager_b4[:1], ref_b1)}
    res["eager"]["ms_b1"], _ = time_call(tr, kw1, 3)
    res["eager"]["ms_batch"], _ = time_call(tr, kw, 3)
    if not args.no_fp32:
        tr32 = copy.deepcopy(tr).float()
        kw32 = {n: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for n, v in kw1.items()}
        ref32 = call(tr32, kw32)
        del tr32
        gc.collect()
        torch.cuda.empty_cache()
        res["eager"]["b1_vs_fp32"] = rel(ref_b1, ref32)
        res["eager"]["b4_vs_fp32"] = rel(eager_b4[:1], ref32)
    else:
        ref32 = None
    print("eager", json.dumps(res["eager"]), flush=True)
    save()

    res["rms_rope_check"] = check_rms_rope(dev, dt)
    print("rms_rope kernel vs eager", json.dumps(res["rms_rope_check"]), flush=True)
    names = args.variants.split(",")
    for name in names:
        t0 = time.perf_counter()
        accel.uncompile_blocks(tr)
        torch._dynamo.reset()
        import torch._inductor.config as ic

        tokens = name.split("_")
        ic.coordinate_descent_tuning = "cd" in tokens
        ic.emulate_precision_casts = "emu" in tokens
        if "fused" in tokens:
            from shardgen.families.flux import fused as flux_fused

            flux_fused.EAGER_DEVICES = () if "plain" in tokens else ("cuda",)
            forwards = flux_fused.enable(tr, split_proj_out="cat" not in tokens)
            for block, fwd in forwards.items():  # as accel.compile_blocks(fused=True), with the split choice
                block.__dict__["_shardgen_eager_forward"] = block.forward
                block.forward = fwd if "nocompile" in tokens else torch.compile(fwd, fullgraph=True, dynamic=False)
        else:
            accel.compile_blocks(tr)
        try:
            o4 = call(tr, kw)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            ms, all_ms = time_call(tr, kw, args.iters)
        except Exception as e:
            res["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            print(name, "FAILED", res["variants"][name], flush=True)
            save()
            continue
        r = {"compile_s": round(compile_s, 1), "ms_batch": round(ms, 2),
             "ms_per_image": round(ms / args.batch, 2), "all_ms": [round(x, 2) for x in all_ms],
             "b4_vs_eager_b1": rel(o4[:1], ref_b1)}
        if ref32 is not None:
            r["b4_vs_fp32"] = rel(o4[:1], ref32)
        if args.profile:
            r["kernels"] = top_kernels(tr, kw)
        res["variants"][name] = r
        print(name, json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
        if "kernels" in r:
            for row in r["kernels"]["top"]:
                print("   ", row, flush=True)
            print("    total", r["kernels"]["total_ms"], flush=True)
        save()
    res["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 1)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
