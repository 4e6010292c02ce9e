"""fa3_fp8 from a fused processor's projections at FLUX.1-dev's attention shape, kernel by kernel, beside what it
replaces: ms per call (CUDA events, median).

    python benchmarks/probe_fa3_parts.py [--iters 20] [--out probe_fa3_parts.json]

Rows: the queries through their one pass (``fa3_fp8.quantise_queries``: RMSNorm + RoPE + float8 on the static
scale) against ``rms_rope`` + ``fa3_fp8.quantise``; the keys and values through their two passes
(``fa3_fp8.quantise_keys``: the mean, then float8 on a static scale; ``quantise_values``) against the way ``attention``
takes them (``rms_rope`` or the join, then ``quantise``);
the whole attention both ways (``rms_rope_attention`` against ``rms_rope`` twice + the joined values +
``attention``). Wall time per call (eager launches included) and, as ``*_gpu_us``, the GPU time of its kernels (what a
CUDA graph replays); then a CUDA profile of ``rms_rope_attention``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_attention import timed  # noqa: E402


def gpu_us(fn, calls: int = 5) -> float:
    """Microseconds of GPU kernel time per call of ``fn`` (a CUDA profile of ``calls`` calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return round(sum(e.self_device_time_total for e in prof.key_averages()) / calls, 1)


def statistics_sweep(ks, wk, vs, cos, sin) -> list[dict]:
    """The keys' and values' statistics pass (``fa3_fp8._part_statistics``) in each launch configuration: tokens a
    program reads, tokens a chunk, warps. GPU microseconds a call and TB/s of the parts' bytes (read once); the keys
    also as ``quantise_keys`` reads them for their mean (each ``key_mean_every``-th token: ``keys_sampled_us``)."""
    from shardgen.speed import fa3_fp8

    saved = fa3_fp8.STATS_TOKENS, fa3_fp8.STATS_CHUNK, fa3_fp8.STATS_WARPS
    moved = sum(x.numel() * x.element_size() for x in ks)
    ways = []
    for tokens, chunk, warps in [(16, 4, 4), (32, 4, 4), (32, 8, 4), (32, 4, 8), (64, 4, 4), (64, 8, 8), (128, 4, 4),
                                 (128, 16, 8)]:
        fa3_fp8.STATS_TOKENS, fa3_fp8.STATS_CHUNK, fa3_fp8.STATS_WARPS = tokens, chunk, warps
        keys = gpu_us(lambda: fa3_fp8._part_statistics(ks, wk, cos, sin, 1e-6))
        every = fa3_fp8.key_mean_every(sum(x.shape[1] for x in ks))
        sampled = gpu_us(lambda: fa3_fp8._part_statistics(ks, wk, cos, sin, 1e-6, every))
        values = gpu_us(lambda: fa3_fp8._part_statistics(vs, None, cos, cos, 0.0))
        way = {"tokens": tokens, "chunk": chunk, "warps": warps, "keys_us": keys, "keys_sampled_us": sampled,
               "every": every, "values_us": values,
               "keys_tb_s": round(moved / keys / 1e6, 2), "values_tb_s": round(moved / values / 1e6, 2),
               "today": (tokens, chunk, warps) == saved}
        ways.append(way)
        print("statistics", way, flush=True)
    fa3_fp8.STATS_TOKENS, fa3_fp8.STATS_CHUNK, fa3_fp8.STATS_WARPS = saved
    return ways


def float8_pass_sweep(qs, wq, vs, cos, sin) -> list[dict]:
    """The float8 pass (``fa3_fp8._write_parts``) of the queries (RMSNorm + RoPE on their static scale) and of the
    values (as they are, on a given scale) in each launch configuration: tokens a program, warps. GPU microseconds a
    call and TB/s (bf16 read once, float8 written)."""
    from shardgen.speed import fa3_fp8

    saved = fa3_fp8.PARTS_TOKENS, fa3_fp8.PARTS_WARPS
    b, _, heads, d = qs[0].shape
    q_scale = fa3_fp8.query_scale(wq, b, heads, d)
    v_scale = torch.ones(b, heads, device="cuda")
    moved = sum(x.numel() for x in qs) * 3
    ways = []
    for tokens, warps in [(4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (32, 8), (32, 16)]:
        fa3_fp8.PARTS_TOKENS, fa3_fp8.PARTS_WARPS = tokens, warps
        queries = gpu_us(lambda: fa3_fp8._write_parts(qs, wq, cos, sin, 1e-6, None, q_scale))
        values = gpu_us(lambda: fa3_fp8._write_parts(vs, None, cos, cos, 0.0, None, v_scale))
        way = {"tokens": tokens, "warps": warps, "queries_us": queries, "values_us": values,
               "queries_tb_s": round(moved / queries / 1e6, 2), "values_tb_s": round(moved / values / 1e6, 2),
               "today": (tokens, warps) == saved}
        ways.append(way)
        print("float8 pass", way, flush=True)
    fa3_fp8.PARTS_TOKENS, fa3_fp8.PARTS_WARPS = saved
    return ways


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="probe_fa3_parts.json")
    a = ap.parse_args()
    from shardgen.speed import fa3_fp8
    from shardgen.speed.fused_kernels import rms_rope

    b, h, d, cuts = 4, 24, 128, (512, 4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    proj = [torch.randn(b, n, 3 * h * d, device="cuda", dtype=torch.bfloat16, generator=g) for n in cuts]
    qs, ks, vs = ([p[..., i * h * d:(i + 1) * h * d].unflatten(-1, (h, d)) for p in proj] for i in range(3))
    wq, wk = ([torch.rand(d, device="cuda", generator=g).bfloat16() + 0.5 for _ in cuts] for _ in range(2))
    ang = torch.rand(sum(cuts), d // 2, device="cuda", generator=g) * 6
    cos, sin = ang.cos().repeat_interleave(2, -1).contiguous(), ang.sin().repeat_interleave(2, -1).contiguous()
    row: dict = {}

    def t(name, fn):
        row[name] = round(timed(fn, a.iters, warm=3), 4)
        row[f"{name}_gpu_us"] = gpu_us(fn)
        print(name, row[name], "ms;", row[f"{name}_gpu_us"], "us of kernels", flush=True)

    t("queries_one_pass", lambda: fa3_fp8.quantise_queries(qs, wq, cos, sin, 1e-6))
    t("queries_rms_rope_then_quantise", lambda: fa3_fp8.quantise(rms_rope(qs, wq, cos, sin, 1e-6)))
    t("keys", lambda: fa3_fp8.quantise(rms_rope(ks, wk, cos, sin, 1e-6), smooth=True))
    t("keys_two_passes", lambda: fa3_fp8.quantise_keys(ks, wk, cos, sin, 1e-6))
    t("values", lambda: fa3_fp8.quantise(torch.cat(vs, 1).transpose(1, 2)))
    t("values_two_passes", lambda: fa3_fp8.quantise_values(vs, cos))
    t("rms_rope", lambda: rms_rope(qs, wq, cos, sin, 1e-6))
    t("attention_from_projections", lambda: fa3_fp8.rms_rope_attention(qs, ks, vs, wq, wk, cos, sin, 1e-6))
    t("attention_rms_rope_then_fa3_fp8", lambda: fa3_fp8.attention(
        rms_rope(qs, wq, cos, sin, 1e-6), rms_rope(ks, wk, cos, sin, 1e-6), torch.cat(vs, 1).transpose(1, 2)))
    row["statistics"] = statistics_sweep(ks, wk, vs, cos, sin)
    row["float8_pass"] = float8_pass_sweep(qs, wq, vs, cos, sin)
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fa3_fp8.rms_rope_attention(qs, ks, vs, wq, wk, cos, sin, 1e-6)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        print(table)
        row["profile"] = table
    except Exception as e:  # noqa: BLE001 - the timings above stand without it
        print("profile failed", e)
    Path(a.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
