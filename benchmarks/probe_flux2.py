"""What FLUX.2-dev's fused blocks (shardgen/families/flux2/fused.py) buy, eagerly and compiled, on one GPU.

    python benchmarks/probe_flux2.py [--batch 4] [--double 2] [--single 8] [--compiled] [--profile]

Builds a FLUX.2-dev transformer with the real widths (48 heads x 128, 15360-wide text features) and ``--double`` +
``--single`` blocks (the real model: 8 + 48) with random bf16 weights, feeds it one 1024x1024 step (4096 image +
512 text tokens) and times a batch call per variant with CUDA events (median of ``--iters``): ``stock`` eager
diffusers, ``fused`` eager, and with ``--compiled`` both regionally compiled. Each variant's output is compared
with a float32 stock reference (relative RMS error), beside the stock bf16 error (what bf16 alone costs). The
Triton kernels are checked against their torch paths (max abs difference, differing elements). ``--profile``
prints one call's top kernels per variant. Results: ``$OUT/probe_flux2.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(double: int, single: int, device, dtype):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        tr = Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=double, num_single_layers=single,
                                     attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360,
                                     timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                                     rope_theta=2000, eps=1e-6, guidance_embeds=True)
    with torch.no_grad():
        for p in tr.parameters():  # weights of a trained model's scale (the default init leaves norms at 1)
            p.normal_(0, 0.02) if p.ndim > 1 else p.normal_(1, 0.1)
    return tr.to(dtype).eval()


def inputs(batch, device, dtype, size=1024, text=512):
    g = torch.Generator(device).manual_seed(1)
    side = size // 16
    ar = torch.arange(side, device=device, dtype=torch.float32)
    z = torch.zeros(1, device=device)
    img_ids = torch.stack(torch.meshgrid(z, ar, ar, z, indexing="ij"), -1).reshape(-1, 4)
    txt_ids = torch.zeros(text, 4, device=device)
    txt_ids[:, 3] = torch.arange(text, device=device)
    return dict(hidden_states=torch.randn(batch, side * side, 128, device=device, dtype=dtype, generator=g),
                encoder_hidden_states=torch.randn(batch, text, 15360, device=device, dtype=dtype, generator=g),
                timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
                guidance=torch.full((batch,), 4.0, device=device, dtype=dtype),
                img_ids=img_ids, txt_ids=txt_ids, return_dict=False)


def cast(kw, dtype):
    return {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k not in ("img_ids", "txt_ids")
                else v) for k, v in kw.items()}


@torch.no_grad()
def timed(tr, kw, iters):
    for _ in range(2):
        tr(**kw)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = tr(**kw)[0]
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out


def rel_rms(a, ref):
    return ((a.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()


@torch.no_grad()
def profile(tr, kw, top=12):
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CUDA]) as p:
        tr(**kw)
        torch.cuda.synchronize()
    rows = sorted(p.key_averages(), key=lambda e: -e.device_time_total)[:top]
    total = sum(e.device_time_total for e in p.key_averages())
    return [(e.key[:90], round(e.device_time_total / 1000, 2), round(100 * e.device_time_total / total, 1))
            for e in rows]


def check_kernels(device):
    from shardgen.families.flux2 import fused as f2
    from shardgen.speed import fused_kernels as flux_fused

    g = torch.Generator(device).manual_seed(2)
    out = {}
    x = torch.randn(4, 4608, 6144, device=device, dtype=torch.bfloat16, generator=g)
    mod = torch.randn(4, 1, 3 * 6144, device=device, dtype=torch.bfloat16, generator=g) * 0.3
    shift, scale, _ = mod.chunk(3, dim=-1)
    fused, ref = f2.ln_modulate(x, shift, scale, 1e-6), flux_fused.ln_modulate_reference(x, shift, scale, 1e-6)
    out["ln_modulate"] = dict(max_abs=(fused.float() - ref.float()).abs().max().item(),
                              differing=(fused != ref).float().mean().item())
    wide = torch.randn(4, 4608, 3 * 6144 + 2 * 18432, device=device, dtype=torch.bfloat16, generator=g)
    view = wide[..., 3 * 6144:]
    half = view.shape[-1] // 2
    fused, ref = f2.swiglu(view), torch.nn.functional.silu(view[..., :half]) * view[..., half:]
    out["swiglu"] = dict(max_abs=(fused.float() - ref.float()).abs().max().item(),
                         differing=(fused != ref).float().mean().item())
    for name, fn in (("ln_modulate", lambda: f2.ln_modulate(x, shift, scale, 1e-6)),
                     ("ln_modulate_eager", lambda: flux_fused.ln_modulate_reference(x, shift, scale, 1e-6)),
                     ("swiglu", lambda: f2.swiglu(view)),
                     ("swiglu_eager", lambda: torch.nn.functional.silu(view[..., :half]) * view[..., half:])):
        for _ in range(3):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.setdefault("ms", {})[name] = round(a.elapsed_time(b) / 10, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from shardgen.families.flux2 import fused as flux2_fused
    from shardgen.speed import accel

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"kernels": check_kernels(dev), "args": vars(args)}
    print(json.dumps(result["kernels"]), flush=True)
    tr = build(args.double, args.single, dev, torch.float32)
    kw32 = inputs(args.batch, dev, torch.float32)
    with torch.no_grad():
        ref = tr(**kw32)[0]
    tr = tr.to(bf16)
    kw = cast(kw32, bf16)
    variants = {}
    stock_ms, stock = timed(tr, kw, args.iters)
    variants["stock"] = dict(ms=stock_ms, rel_rms=rel_rms(stock, ref))
    if args.profile:
        variants["stock"]["top"] = profile(tr, kw)
    n = accel.fuse_blocks_eager(tr)
    ms, out = timed(tr, kw, args.iters)
    variants["fused"] = dict(ms=ms, rel_rms=rel_rms(out, ref), vs_stock=rel_rms(out, stock), blocks=n,
                             speedup=round(stock_ms / ms, 3))
    if args.profile:
        variants["fused"]["top"] = profile(tr, kw)
    if args.compiled:
        for name, fused in (("stock_compiled", False), ("fused_compiled", True)):
            accel.uncompile_blocks(tr)
            torch._dynamo.reset()
            if fused:
                forwards = flux2_fused.enable(tr)
                for block, fwd in forwards.items():
                    block.__dict__["_shardgen_eager_forward"] = block.forward
                    block.forward = torch.compile(fwd, fullgraph=True, dynamic=False)
            else:
                accel.compile_blocks(tr)
            ms, out = timed(tr, kw, args.iters)
            variants[name] = dict(ms=ms, rel_rms=rel_rms(out, ref), speedup=round(stock_ms / ms, 3))
    result["variants"] = variants
    for k, v in variants.items():
        print(k, {a: b for a, b in v.items() if a != "top"}, flush=True)
        for row in v.get("top", []):
            print("   ", row)
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "probe_flux2.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
