"""Where an fp8 transformer step's time goes on one GPU: the float8 GEMMs against bf16 at the step's shapes, and one
step of the job's own transformer (``accel.prepare``: the family's fused eager blocks, fp8 layers) split by kernel
kind.

    python benchmarks/probe_fp8_step.py [--models flux_dev,flux2_dev] [--batch 4] [--compile] [--graphs] \
        [--fa3-before] [--out probe.json]

GEMMs: ``torch.mm`` in bf16 against ``torch._scaled_mm`` (row-wise scales, with and without ``use_fast_accum``) at
FLUX.1-dev's 1024x1024 batch-4 shapes, in TFLOP/s, plus the row quantisation of the input. Step: the dummy
transformer (real widths and depths, random bf16 weights) on one 1024x1024 step (4096 image + 512 text tokens),
median of 5 calls after two warm-ups (with ``--graphs`` also replayed from a CUDA graph, as the job runs them), and a
profile of one call grouped into fp8 GEMMs, bf16 GEMMs, attention, the row quantisation, other Triton kernels and
the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GEMMS = [  # (name, M, K, N) at batch 4, 1024x1024
    ("single qkv / mlp-in 3072->3072", 4 * 4608, 3072, 3072),
    ("single mlp-up 3072->12288", 4 * 4608, 3072, 12288),
    ("single proj_out 15360->3072", 4 * 4608, 15360, 3072),
    ("double ff-down 12288->3072", 4 * 4096, 12288, 3072),
    ("double text qkv 3072->3072", 4 * 512, 3072, 3072),
]


def cuda_ms(fn, iters=10):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def gemm_table() -> list[dict]:
    from shardgen.speed import fp8

    rows = []
    for name, m, k, n in GEMMS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        xq, sx = fp8.quantize_rows(x)
        wq, sw = fp8.quantize_weight(w)
        flop = 2 * m * k * n
        r = {"gemm": name, "M": m, "K": k, "N": n}
        r["bf16_ms"] = cuda_ms(lambda: torch.nn.functional.linear(x, w, bias))
        for fast in (False, True):
            r[f"fp8{'_fast' if fast else ''}_ms"] = cuda_ms(lambda: torch._scaled_mm(
                xq, wq.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast))
        # one scale per tensor (cuBLASLt's tensor-wise path), the same float8 operands: whether row-wise scaling's
        # kernel leaves GEMM speed behind at these shapes
        one_x, one_w = sx.max().reshape(1, 1), sw.max().reshape(1, 1)
        r["fp8_fast_tensorwise_ms"] = cuda_ms(lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=one_x, scale_b=one_w, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True))
        r["quantize_ms"] = cuda_ms(lambda: fp8.quantize_rows(x))
        for key in ("bf16_ms", "fp8_ms", "fp8_fast_ms", "fp8_fast_tensorwise_ms"):
            r[key.replace("_ms", "_tflops")] = round(flop / r[key] / 1e9, 1)
        ref = torch.nn.functional.linear(x, w, bias).float()
        for fast in (False, True):
            out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=torch.bfloat16,
                                   use_fast_accum=fast).float()
            r[f"rel_rms{'_fast' if fast else ''}"] = round(((out - ref).norm() / ref.norm()).item(), 5)
        rows.append({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in r.items()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def kind(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ("_query_fp8", "_quantise_heads", "_rms_rope", "reduce_kernel", "cat")):
        return "attention_inputs"  # RoPE, the 8-bit kernels' quantisation, reductions, the values' join
    if "_ln_modulate" in low:
        return "norm"
    if "_quantise_rows" in low:
        return "attention_quantise"
    if "quantize_rows" in low:
        return "quantize"
    if any(s in low for s in ("fmha", "flash", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(s in low for s in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90")):
        # cuBLASLt's float8 kernels: "qq" in nvjet's names (both operands quantised), e4m3 in others'
        return "gemm_fp8" if any(s in low for s in ("e4m3", "fp8", "f8", "qqtst")) else "gemm_bf16"
    if "triton" in low:
        return "triton_other"
    return "other"


def profile_step(tr, kw) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as p:
        tr(**kw)
        torch.cuda.synchronize()
    events = [e for e in p.key_averages() if e.device_time_total > 0]
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind(e.key)] = by_kind.get(kind(e.key), 0.0) + e.device_time_total / 1000
    top = sorted(events, key=lambda e: -e.device_time_total)[:30]
    return {"by_kind_ms": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [(e.key[:100], e.count, round(e.device_time_total / 1000, 2)) for e in top]}


def step_ms(tr, kw, iters=5) -> float:
    ms = []
    with torch.no_grad():
        for _ in range(2):
            tr(**kw)
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            tr(**kw)
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def graphed_ms(tr, kw, iters=5) -> float:
    """One call replayed from a CUDA graph (what the job's cuda_graphs does after a shape's first two calls), median
    of ``iters`` replays: eager launch costs gone, each kernel's launch inside the graph kept."""
    with torch.no_grad():
        for _ in range(2):
            tr(**kw)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tr(**kw)
        ms = []
        for _ in range(iters + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
    del graph
    return statistics.median(ms[1:])


def main() -> None:
    import probe_fp8

    from shardgen.speed import accel, block_chain, fa3_fp8, fp8, fp8_attention, fused_kernels

    chain_successor, key_mean_tokens = block_chain.successor, fa3_fp8.KEY_MEAN_TOKENS
    kept_descales, triton_totals, heads_kernel_ok = (fa3_fp8._static_descales, fa3_fp8._totals,
                                                     fa3_fp8._heads_kernel_ok)

    def _descales_each_call(weights, batch, heads, dim, factor):
        return (factor * fa3_fp8._norm_bound(weights, dim) / fa3_fp8.FP8_MAX).expand(batch, heads).contiguous()

    def _totals_in_torch(partials, divisor=1):
        if partials.dim() == 4:
            return (partials.sum(dim=1) / divisor).contiguous()
        return (partials.amax(dim=1).clamp_min(1e-20) / fa3_fp8.FP8_MAX).contiguous()

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="flux_dev,flux2_dev")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--compile", action="store_true", help="also time fp8 with the blocks compiled")
    ap.add_argument("--no-gemms", action="store_true")
    ap.add_argument("--ways", default=None, help="comma-separated ways to time (default: all; fp8_attention: fp8 "
                    "layers and sdpa_backend=fp8; fp8_fa3: fp8 layers and sdpa_backend=fa3_fp8, where fa3-fwd "
                    "imports)")
    ap.add_argument("--tokens-major", action="store_true", help="also each way with fused_kernels."
                    "SDPA_TOKENS_MAJOR off and on (queries and keys handed to SDPA in (batch, heads, tokens, head_dim) "
                    "or (batch, tokens, heads, head_dim) memory), named WAY-tokens_major and WAY+tokens_major")
    ap.add_argument("--before", action="store_true", help="also each way as the blocks ran before the block chain "
                    "and the sampled keys' mean (block_chain.successor and fa3_fp8.KEY_MEAN_TOKENS switched off), "
                    "named WAY-before: the two changes' gain on one card, in one process")
    ap.add_argument("--fa3-before", action="store_true", help="also each fa3_fp8 way with its input passes as "
                    "they ran before: the static query and key descales worked out on every call (not kept), the "
                    "statistics' totals in torch ops, SDPA's queries and values through torch's maximum; named "
                    "WAY-fa3_before: what the three save, in one process")
    ap.add_argument("--graphs", action="store_true", help="also time each way's call replayed from a CUDA graph "
                    "(ms_per_call_graphed), as the job runs it")
    ap.add_argument("--out", default="probe_fp8_step.json")
    a = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not a.no_gemms:
        res["gemms"] = gemm_table()
    dev = torch.device("cuda")
    for model in [m for m in a.models.split(",") if m not in ("", "none")]:  # none: the GEMM table alone
        tr = probe_fp8.build(model, dev, torch.bfloat16)
        kw = probe_fp8.inputs(model, a.batch, dev, torch.bfloat16)
        pipe = types.SimpleNamespace(transformer=tr, _execution_device=dev)
        fp8_opts = accel.AccelOptions(fp8=True, cuda_graphs=False)
        ways = [("bf16", accel.AccelOptions(cuda_graphs=False)), ("fp8", fp8_opts), ("fp8_fast_accum", fp8_opts)]
        if a.compile:
            ways.append(("fp8_compiled", accel.AccelOptions(fp8=True, compile=True, cuda_graphs=False)))
        ways.append(("fp8_attention", fp8_opts))
        if fa3_fp8.unavailable_reason(dev) is None:
            ways.append(("fp8_fa3", fp8_opts))
        if a.ways:
            ways = [w for w in ways if w[0] in a.ways.split(",") or w[0] == "bf16"]
        # each way with SDPA's queries and keys heads-major, then tokens-major (fp8 cannot be switched off once on:
        # the bf16 ways come first); fa3_fp8 takes the projections themselves, so SDPA's layout is not its
        majors = [False, True] if a.tokens_major else [fused_kernels.SDPA_TOKENS_MAJOR]
        ways = [(name + ({False: "-tokens_major", True: "+tokens_major"}[major] if a.tokens_major else ""), name, opts,
                 major) for name, opts in ways for major in (majors if name != "fp8_fa3" else majors[-1:])]
        ways = [(label + suffix, name, opts, major) for label, name, opts, major in ways
                for suffix in (("-before", "") if a.before else ("",))]
        ways = [(label + suffix, name, opts, major) for label, name, opts, major in ways
                for suffix in (("-fa3_before", "") if a.fa3_before and name == "fp8_fa3" else ("",))]
        out = res[model] = {}
        ref = None
        for label, name, opts, major in ways:
            fused_kernels.SDPA_TOKENS_MAJOR = major
            before = label.endswith("-before")
            block_chain.successor = (lambda *args: None) if before else chain_successor
            fa3_fp8.KEY_MEAN_TOKENS = 1 << 40 if before else key_mean_tokens
            fa3_before = label.endswith("-fa3_before")
            fa3_fp8._static_descales = _descales_each_call if fa3_before else kept_descales
            fa3_fp8._totals = _totals_in_torch if fa3_before else triton_totals
            fa3_fp8._heads_kernel_ok = (lambda x: False) if fa3_before else heads_kernel_ok
            # fp8 and fp8_compiled without: their rows in docs/lossy.md
            fp8.USE_FAST_ACCUM = name in ("fp8_fast_accum", "fp8_attention", "fp8_fa3")
            done = accel.prepare(pipe, opts)
            if model == "qwen_image":  # the job's joint attention (fused q/k RMSNorm + RoPE, no key mask): the
                # family's hook installs it on a QwenImagePipeline, which this bare transformer is not
                from shardgen.families.qwen_image.speed import enable_prefix_attention

                enable_prefix_attention(tr)

            def attention(name=name):  # a fresh context per use: the way's sdpa_backend
                contexts = {"fp8_attention": fp8_attention.context, "fp8_fa3": fa3_fp8.context}
                return contexts.get(name, contextlib.nullcontext)()

            with torch.no_grad(), attention():
                sample = tr(**kw)[0].float()
            ref = sample if ref is None else ref
            with attention():
                ms = step_ms(tr, kw)
                profile = profile_step(tr, kw)
            row = out[label] = {"prepared": {k: v for k, v in done.items() if not isinstance(v, (dict, list))},
                                "ms_per_call": round(ms, 2)}
            if a.graphs:
                try:
                    with attention():
                        row["ms_per_call_graphed"] = round(graphed_ms(tr, kw), 2)
                except RuntimeError as e:  # Qwen-Image's call copies a CPU tensor: the job does not graph it either
                    row["ms_per_call_graphed"] = None
                    row["graph_error"] = str(e).split("\n")[0][:200]
                    torch.cuda.synchronize()
            row["ms_per_image"] = round(row["ms_per_call"] / a.batch, 2)
            row["rel_rms_vs_bf16"] = round(((sample - ref).norm() / ref.norm()).item(), 5)
            row.update(profile)
            print(model, label, json.dumps(row), flush=True)
        del tr, pipe
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
