"""shardgen's float8 attention kernel (``sdpa_backend=fp8``) against torch's kernels at each model's attention shape:
time per call, its tile sizes, and its error.

    python benchmarks/probe_fp8_attention.py [--iters 20] [--tiles] [--out probe_fp8_attention.json]

Per shape (batch 4, 1024x1024 unless named): cuDNN's and flash's bf16 SDPA, SageAttention and FlashAttention-3 bf16
and float8 (``sdpa_backend=fa3_fp8``; each when installed), and the float8 kernel with its default tiles (with
``--tiles``, every tile size in ``TILE_GRID`` too, on ``--tile-shapes``): ms per whole call (quantisation
included; the three quantisations alone are ``quantise_ms``, FA3's ``fa3_quantise_ms``) and TFLOP/s
(4 * B * H * Nq * Nk * D / time). Errors, relative RMS over the first sample's first two heads: against exact
float32 attention, against cuDNN, and against ``fp8_attention.reference`` (the same arithmetic in torch ops: the
kernel's own error). Random inputs, the keys offset by a common vector (what the smoothing removes).
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

SHAPES = {  # (batch, heads, query tokens, key tokens, head_dim)
    "flux_dev": (4, 24, 4096 + 512, 4096 + 512, 128),
    "flux2_dev": (4, 48, 4096 + 512, 4096 + 512, 128),
    "qwen_image": (4, 24, 4096 + 211, 4096 + 211, 128),  # text of 211 tokens: a tile not full
    "sd35_large": (4, 38, 4096 + 256, 4096 + 256, 64),
    "wan_480p_81f": (1, 12, 32760, 32760, 128),
}
# 128-query tiles on 4 warps are left out: compiled for sm_90 they spill (64-2,904 bytes a thread at head size 128,
# benchmarks/results/2026-12-05-aot-fp8-attention/NOTES.md)
TILE_GRID = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
             for m, w in ((128, 8), (64, 4)) for n in (64, 128) for s in (2, 3, 4)]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return round(((x - ref).norm() / ref.norm()).item(), 5)


def sdpa_with(kernel):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kernel]

    def call(q, k, v):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return call


def _fa3_ways() -> dict:
    """FlashAttention-3 (the fa3-fwd package, Hopper) where it runs: bf16, and float8 with shardgen's
    quantisation (sdpa_backend=fa3_fp8; ``fa3_fp8_kernel``: the kernel alone on inputs quantised once)."""
    from shardgen.speed import fa3_fp8

    if why := fa3_fp8.unavailable_reason("cuda"):
        print("FA3:", why, flush=True)
        return {}
    forward = fa3_fp8.fa3_forward()
    pre: dict = {}

    def kernel_only(q, k, v):
        if not pre:
            pre.update(q=fa3_fp8.quantise(q), k=fa3_fp8.quantise(k, smooth=True), v=fa3_fp8.quantise(v))
        (q8, qs), (k8, ks), (v8, vs) = pre["q"], pre["k"], pre["v"]
        return forward(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)[0].transpose(1, 2)

    return {"fa3": lambda q, k, v: forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[0]
            .transpose(1, 2), "fa3_fp8": fa3_fp8.attention, "fa3_fp8_kernel": kernel_only}


TEXT_TOKENS = {"flux_dev": 512, "flux2_dev": 512, "qwen_image": 211, "sd35_large": 256}


def projection_ways(name: str, iters: int) -> dict:
    """From a fused processor's projections (text and image parts, (batch, tokens, heads, dim) each, as FLUX's
    q/k/v linears give them) to the attention output, ms per call: ``rms_rope`` + the joined values + cuDNN (the
    lossless path) or + ``fa3_fp8.attention``, and ``fa3_fp8.rms_rope_attention`` (the queries in one pass on their
    static scale); and that pass alone (``quantise_queries``)."""
    from shardgen.speed import fa3_fp8
    from shardgen.speed.fused_kernels import rms_rope

    b, h, n, _, d = SHAPES[name]
    if name not in TEXT_TOKENS or fa3_fp8.unavailable_reason("cuda"):
        return {}
    g = torch.Generator(device="cuda").manual_seed(0)
    cuts = (TEXT_TOKENS[name], n - TEXT_TOKENS[name])
    qs, ks, vs = ([torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for t in cuts]
                  for _ in range(3))
    ks = [k + 0.5 for k in ks]
    wq, wk = ([torch.rand(d, device="cuda", generator=g).bfloat16() + 0.5 for _ in cuts] for _ in range(2))
    ang = torch.rand(n, d // 2, device="cuda", generator=g) * 6
    cos, sin = ang.cos().repeat_interleave(2, -1).contiguous(), ang.sin().repeat_interleave(2, -1).contiguous()

    def via(attend):
        return lambda: attend(rms_rope(qs, wq, cos, sin, 1e-6), rms_rope(ks, wk, cos, sin, 1e-6),
                              torch.cat(vs, 1).transpose(1, 2))

    ways = {"rope_cudnn": via(sdpa_with("cudnn")), "rope_fa3_fp8": via(fa3_fp8.attention),
            "fa3_fp8_from_projections": lambda: fa3_fp8.rms_rope_attention(qs, ks, vs, wq, wk, cos, sin, 1e-6),
            "quantise_queries": lambda: fa3_fp8.quantise_queries(qs, wq, cos, sin, 1e-6)}
    row = {way: round(timed(fn, iters, warm=3), 3) for way, fn in ways.items()}
    print(name, "from the projections, ms per call", row, flush=True)
    return row


def measure(name: str, iters: int, tiles: bool) -> dict:
    """One shape's row: every way's time and errors."""
    from shardgen.speed import fp8_attention as F

    b, h, nq, nk, d = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for n in (nq, nk, nk))
    k = k + torch.randn(1, 1, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    flop = 4 * b * h * nq * nk * d
    row: dict = {"shape": [b, h, nq, nk, d], "ways": {}}
    one = (slice(0, 1), slice(0, 2))  # the errors over the first sample's first two heads (bounded memory)
    exact = torch.nn.functional.scaled_dot_product_attention(q[one].float(), k[one].float(), v[one].float())
    cudnn = sdpa_with("cudnn")(q, k, v)
    ways = {"cudnn": sdpa_with("cudnn"), "flash": sdpa_with("flash")}
    try:
        from shardgen.speed import sage

        if sage.unavailable_reason("cuda") is None:
            ways["sage"] = lambda q, k, v: sage.attention(q, k, v)
    except ImportError:
        pass
    ways["fp8"] = F.attention
    ways.update(_fa3_ways())
    if tiles:
        for t in TILE_GRID:
            tag = "fp8_m{BLOCK_M}_n{BLOCK_N}_w{num_warps}_s{num_stages}".format(**t)
            ways[tag] = lambda q, k, v, t=t: F.attention(q, k, v, tiles=t)
    for way, fn in ways.items():
        try:
            out = fn(q, k, v)
            ms = timed(lambda: fn(q, k, v), iters, warm=3)
        except Exception as e:  # noqa: BLE001 - a tile size that does not fit this GPU: recorded, the rest go on
            row["ways"][way] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(name, way, row["ways"][way], flush=True)
            continue
        row["ways"][way] = {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1),
                            "err_vs_exact": rel(out[one], exact), "err_vs_cudnn": rel(out, cudnn)}
        print(name, way, row["ways"][way], flush=True)
    if "fa3_fp8" in ways:
        from shardgen.speed import fa3_fp8

        row["ways"]["fa3_fp8"]["err_vs_reference"] = rel(fa3_fp8.attention(q[one], k[one], v[one]),
                                                         fa3_fp8.reference(q[one], k[one], v[one]))
        row["fa3_quantise_ms"] = round(timed(lambda: (fa3_fp8.quantise(q), fa3_fp8.quantise(k, smooth=True),
                                                        fa3_fp8.quantise(v)), iters, warm=3), 3)
        print(name, "fa3_fp8 vs its reference", row["ways"]["fa3_fp8"]["err_vs_reference"], "quantise ms",
              row["fa3_quantise_ms"], flush=True)
    emu = F.reference(q[one], k[one], v[one])
    row["ways"]["fp8"]["err_vs_reference"] = rel(F.attention(q[one], k[one], v[one]), emu)
    row["ways"]["reference_err_vs_exact"] = rel(emu, exact)
    row["quantise_ms"] = round(timed(lambda: (F.quantise(q, scale_mul=0.1), F.quantise(k, smooth=True),
                                                F.quantise_values(v)), iters, warm=3), 3)
    print(name, "fp8 vs its reference", row["ways"]["fp8"]["err_vs_reference"], "reference vs exact",
          row["ways"]["reference_err_vs_exact"], "quantise ms", row["quantise_ms"], flush=True)
    row["from_projections_ms"] = projection_ways(name, iters)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiles", action="store_true", help="time every tile size in TILE_GRID (on --tile-shapes)")
    ap.add_argument("--tile-shapes", default="flux_dev,sd35_large", help="the shapes --tiles sweeps")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default="probe_fp8_attention.json")
    a = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name in a.shapes.split(","):
        res["shapes"][name] = measure(name, a.iters, a.tiles and name in a.tile_shapes.split(","))
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
