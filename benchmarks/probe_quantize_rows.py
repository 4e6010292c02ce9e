"""The float8 row quantisation (``fp8.quantize_rows``: each activation row on its own absolute maximum, the MLP's GELU
optionally computed in the same pass) at the shapes a FLUX.1-dev fp8 call at batch 4 quantises, in the launch
configurations its kernel has: the whole row in registers (one read) or two passes over it in blocks (two reads,
the second mostly from L2), and its warps. GPU time per call and the rate in TB/s of bytes moved (bf16 in, float8
out); the row marked ``*`` is what ``quantize_rows`` launches today (the GELU's tanh: ``approx`` the
GPU's tanh.approx.f32, else from exp); then the rows ``joined_rows`` writes in one pass (the single blocks' output
projection input of FLUX.1 and FLUX.2, FLUX.2's feed-forward SwiGLU); then the LayerNorm + modulation pass.

    python benchmarks/probe_quantize_rows.py [--only rows,joined,ln] [--out probe_quantize_rows.json]

A FLUX.1-dev fp8 call at batch 4 spends ~30 ms in this kernel (152 calls: an H200's profile in
benchmarks/results/2026-12-06-h200-kv-passes-4fe03a2), ~2.5-3 TB/s against the card's 4.8.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_fp8_step import cuda_ms  # noqa: E402 (a sibling script: CUDA events around repeated calls)

SHAPES = [  # (what, rows, cols, gelu)
    ("attention output -> to_out / a single block's proj_out part", 4 * 4608, 3072, False),
    ("double block MLP down-projection input (GELU)", 4 * 4096, 12288, True),
    ("single block MLP part of proj_out (GELU)", 4 * 4608, 12288, True),
    ("text tokens -> to_add_out", 4 * 512, 3072, False),
]


def configurations(cols: int) -> list[tuple[bool, int, int]]:
    """(one pass, block, warps) to try for rows of ``cols``: the whole row at 4 to 32 warps, or blocks of 1024 to
    8192 columns at 4 or 8 warps."""
    import triton

    width = triton.next_power_of_2(cols)
    one = [(True, width, w) for w in (4, 8, 16, 32) if width // (32 * w) >= 4]
    two = [(False, block, w) for block in (1024, 2048, 4096, 8192) if block <= width for w in (4, 8)]
    return one + two


def _timed(launch, moved: int) -> dict:
    us = cuda_ms(launch, iters=20) * 1e3
    return {"us": round(us, 1), "tb_per_s": round(moved / us / 1e6, 2)}


def _say(what: str, way: dict) -> None:
    print(f"{what} {way['us']:8.1f} us {way['tb_per_s']:5.2f} TB/s same={way.get('same_bytes', '-')}"
          f"{' *' if way.get('today') else ''}", flush=True)


JOINED = [  # (what, rows, attention part's columns, the activation part's output columns, activation)
    ("FLUX.1 single block proj_out input", 4 * 4608, 3072, 12288, "gelu"),
    ("FLUX.2 single block proj_out input", 4 * 4608, 6144, 18432, "swiglu"),
    ("FLUX.2 feed-forward down-projection input", 4 * 4096, 0, 18432, "swiglu"),
]


def _joined_before(a: torch.Tensor | None, b: torch.Tensor, act: str):
    """What the fp8 blocks launched before ``joined_rows`` took these rows: FLUX.1's one power-of-two block a part
    at 16 warps; FLUX.2's bf16 SwiGLU, then each part's ``quantize_rows``."""
    from shardgen.families.flux2.fused import swiglu
    from shardgen.speed import fp8

    if act == "gelu":
        rows, cols_a, cols_b = b.shape[0], a.shape[1], b.shape[1]
        q = torch.empty(rows, cols_a + cols_b, device="cuda", dtype=torch.float8_e4m3fn)
        scale = torch.empty(rows, 1, device="cuda", dtype=torch.float32)
        return lambda: fp8._quantize_parts_kernel[(rows,)](
            a, b, q, scale, cols_a, cols_b, a.stride(0), b.stride(0), 4096, 0, 16384, 0, ACT=1, QMAX=fp8.FP8_MAX,
            APPROX=fp8.APPROX_TANH, num_warps=16)

    def parts():
        if a is not None:
            fp8.quantize_rows(a)
        fp8.quantize_rows(swiglu(b))
    return parts


def joined_ways() -> list[dict]:
    """The rows ``fp8.joined_rows`` writes at a batch-4 call's shapes (FLUX.1's single blocks' ``proj_out`` input;
    FLUX.2's, its SwiGLU read from a slice of the fused projection; FLUX.2's feed-forward SwiGLU alone): its launch
    (the parts' register chunks) at 4 to 32 warps, and ``_quantize_parts_chunked_kernel`` (the row read twice, in
    chunks of 1024 to 4096 columns, at 2 to 8 warps), each checked against the launch ``joined_rows`` makes, and what
    the fp8 blocks did before it (``_joined_before``; FLUX.2's then also summed two GEMMs' outputs, not timed)."""
    from shardgen.speed import fp8

    ways = []
    for what, rows, cols_a, cols_b, act in JOINED:
        width_b = 2 * cols_b if act == "swiglu" else cols_b
        wide = torch.randn(rows, 3 * cols_a + width_b, device="cuda", dtype=torch.bfloat16) * 3
        b = wide[:, 3 * cols_a:]  # FLUX.2's SwiGLU input lies in the fused projection's output
        a = torch.randn(rows, cols_a, device="cuda", dtype=torch.bfloat16) if cols_a else None
        ref = fp8.joined_rows(a, b, act)
        *chunks, today = fp8._joined_launch(cols_a, cols_b)
        q = torch.empty(rows, cols_a + cols_b, device="cuda", dtype=torch.float8_e4m3fn)
        scale = torch.empty(rows, 1, device="cuda", dtype=torch.float32)
        moved = rows * (cols_a * 3 + (width_b * 2 + cols_b))  # bf16 read once, float8 written
        for warps in (4, 8, 16, 32):
            def launch(warps=warps):
                fp8._quantize_parts_kernel[(rows,)](a if a is not None else b, b, q, scale, cols_a, cols_b,
                                                    cols_a if a is None else a.stride(0), b.stride(0), *chunks,
                                                    ACT=fp8.ACTIVATIONS[act], QMAX=fp8.FP8_MAX,
                                                    APPROX=fp8.APPROX_TANH, num_warps=warps)
            launch()
            same = torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)
            way = {"what": what, "chunks": chunks, "warps": warps, **_timed(launch, moved), "same_bytes": same,
                   "today": warps == today}
            ways.append(way)
            _say(f"{what[:40]:40s} {rows}x{cols_a}+{cols_b} {chunks}: warps={warps:2d}", way)
        for chunk, warps in itertools.product((1024, 2048, 4096), (2, 4, 8)):
            def chunked(chunk=chunk, warps=warps):
                fp8._quantize_parts_chunked_kernel[(rows,)](
                    a if a is not None else b, b, q, scale, cols_a if a is None else a.stride(0), b.stride(0),
                    COLS_A=cols_a, COLS_B=cols_b, CHUNK=chunk, ACT=fp8.ACTIVATIONS[act], QMAX=fp8.FP8_MAX,
                    APPROX=fp8.APPROX_TANH, num_warps=warps)
            chunked()
            same = torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)
            way = {"what": what, "chunk": chunk, "warps": warps, **_timed(chunked, moved), "same_bytes": same}
            ways.append(way)
            _say(f"{what[:40]:40s} {rows}x{cols_a}+{cols_b} read twice, chunks of {chunk}: warps={warps:2d}", way)
        way = {"what": what, "before": True, **_timed(_joined_before(a, b, act), moved)}
        ways.append(way)
        _say(f"{what[:40]:40s} {rows}x{cols_a}+{cols_b}: as before", way)
    return ways


def ln_modulate_ways() -> list[dict]:
    """The LayerNorm + modulation pass (``fused_kernels.ln_modulate_for``) at a single block's input at batch 4,
    writing float8 rows (fp8=true) and bf16, at 2 to 16 warps a row (``LN_WARPS``)."""
    from shardgen.speed import fp8, fused_kernels

    b, tokens, dim = 4, 4608, 3072
    x = torch.randn(b, tokens, dim, device="cuda", dtype=torch.bfloat16)
    shift, scale = (torch.randn(b, 1, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    layer = fp8.Float8Linear(torch.nn.Linear(dim, 64, device="cuda", dtype=torch.bfloat16))
    saved, ways = fused_kernels.LN_WARPS, []
    for warps in (2, 4, 8, 16):
        fused_kernels.LN_WARPS = warps
        for out, moved, fn in (("float8", b * tokens * dim * 3,
                                lambda: fused_kernels.ln_modulate_for([layer], x, shift, scale, 1e-6)),
                               ("bf16", b * tokens * dim * 4,
                                lambda: fused_kernels.ln_modulate(x, shift, scale, 1e-6))):
            way = {"out": out, "warps": warps, **_timed(fn, moved), "today": warps == saved}
            ways.append(way)
            _say(f"{'LayerNorm + modulation -> ' + out:40s} {b * tokens}x{dim}: warps={warps:2d}", way)
    fused_kernels.LN_WARPS = saved
    return ways


def main() -> None:
    from shardgen.speed import fp8

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="rows,joined,ln", help="which sweeps: rows (quantize_rows), joined "
                    "(joined_rows), ln (the LayerNorm + modulation pass)")
    ap.add_argument("--out", default="probe_quantize_rows.json")
    a = ap.parse_args()
    only = a.only.split(",")
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    for what, rows, cols, gelu in SHAPES if "rows" in only else []:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(rows, cols, device="cuda", dtype=torch.float8_e4m3fn)
        scale = torch.empty(rows, 1, device="cuda", dtype=torch.float32)
        ref_q, ref_s = fp8.quantize_rows(x, gelu=gelu)
        today = (*fp8.row_launch(cols), fp8.APPROX_TANH)
        moved = rows * cols * 3  # bytes: bf16 read once, float8 written
        shape = {"what": what, "rows": rows, "cols": cols, "gelu": gelu, "ways": []}
        for (one_pass, block, warps), approx in itertools.product(configurations(cols),
                                                                   (True, False) if gelu else (True,)):
            def launch(one_pass=one_pass, block=block, warps=warps, approx=approx):
                fp8._quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), rows, 0, BLOCK=block,
                                                   QMAX=fp8.FP8_MAX, GELU=gelu, ONE_PASS=one_pass, APPROX=approx,
                                                   num_warps=warps)
            launch()
            same = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)
            way = {"one_pass": one_pass, "block": block, "warps": warps, "approx_tanh": approx,
                   **_timed(launch, moved), "same_bytes": same}
            way["today"] = (one_pass, block, warps, approx) == today
            shape["ways"].append(way)
            _say(f"{what[:40]:40s} {rows}x{cols} gelu={gelu}: one_pass={one_pass!s:5s} block={block:5d} "
                 f"warps={warps:2d} approx={approx!s:5s}", way)
        res["shapes"].append(shape)
    if "joined" in only:
        res["joined"] = joined_ways()
    if "ln" in only:
        res["ln_modulate"] = ln_modulate_ways()
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
