"""The float8 attention kernels (``sdpa_backend=fp8``) compiled for a GPU without one: what each tile size asks of the
chip, before a device call times it.

    pip install --target /tmp/triton triton          # Triton with its NVIDIA backend; no GPU, no CUDA build of torch
    PYTHONPATH=/tmp/triton:. python benchmarks/aot_fp8_attention.py --arch 90,89 [--grid] [--out aot.json]

For each compute capability and tile size (``fp8_attention.TILES``; with ``--grid`` those of
``probe_fp8_attention.TILE_GRID`` too) it prints the tensor-core instructions the products compile to (``wgmma`` on
Hopper, ``mma.sync`` on Ada; an 8-bit kernel shows ``s8`` and ``e4m3`` kinds), the shared memory per block, how many
loads are asynchronous copies (the key/value loop software-pipelined; 0 means each tile waits for its load) and how
many tile loads are not (the queries' one, the part-filled last key tile's two), and the registers and spills
``ptxas -v`` reports. Pointers and the padded token counts are compiled as 16-byte aligned,
as Triton's launcher specialises them at run time for torch's tensors (without that hint the loads are neither
vectorised nor pipelined). The figures are the compiler's; only a GPU says how fast (probe_fp8_attention.py).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the signature of fp8_attention._attention; the arguments Triton would find 16-byte aligned in a run
SIGNATURE = dict(Q="*i8", QS="*fp32", K="*i8", KS="*fp32", Vt="*fp8e4nv", VS="*fp32", O="*bf16", n_q="i32",
                 n_k="i32", nq_pad="i32", nk_pad="i32", heads="i32", sob="i32", son="i32", soh="i32",
                 D="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr", LOG2_P="constexpr")
ALIGNED = ("nq_pad", "nk_pad", "sob", "son", "soh")  # multiples of 128 (padding) or of the head size


def compile_attention(arch: int, dim: int, tiles: dict):
    """The compiled ``_attention`` kernel for compute capability ``arch`` (e.g. 90), head size ``dim``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shardgen.speed import fp8_attention as fa

    aligned = [i for i, (name, kind) in enumerate(SIGNATURE.items()) if kind.startswith("*") or name in ALIGNED]
    src = ASTSource(fn=fa._attention, signature=SIGNATURE,
                    constexprs=dict(D=dim, BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"], LOG2_P=fa.LOG2_P_SCALE),
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]))


def ptxas_report(ptx: str, arch: int) -> dict:
    """Registers and spill bytes from ``ptxas -v`` (the newest ptxas Triton ships that reads this PTX); {} if none
    does."""
    import triton

    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for ptxas in sorted(bins.glob("ptxas*"), reverse=True):  # ptxas-blackwell (newer) first
            done = subprocess.run([str(ptxas), f"-arch=sm_{arch}{'a' if arch == 90 else ''}", "-v", str(src),
                                   "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
            if done.returncode == 0:
                text = done.stdout + done.stderr
                regs = re.search(r"Used (\d+) registers", text)
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
                return dict(registers=int(regs.group(1)) if regs else None,
                            spill_bytes=int(spill.group(1)) + int(spill.group(2)) if spill else None)
    return {}


def describe(arch: int, dim: int, tiles: dict) -> dict:
    """What ``compile_attention`` made: tensor-core instruction kinds, shared memory, pipelined loads, registers."""
    kernel = compile_attention(arch, dim, tiles)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    mma = sorted({m.group(0) for m in re.finditer(r"(wgmma\.mma_async|mma\.sync|tcgen05\.mma)[\w.]*", ptx)})
    return dict(arch=arch, head_dim=dim, **tiles, shared_bytes=kernel.metadata.shared, tensor_core=mma,
                async_loads=ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy"),
                sync_tile_loads=len(re.findall(r"tt\.load .*tensor<\d+x\d+x!tt\.ptr<(i8|f8E4M3FN)>", ttgir)),
                **ptxas_report(ptx, arch))


def main() -> int:
    from shardgen.speed import fp8_attention as fa

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90,89", help="compute capabilities, comma-separated (90: H100/H200)")
    ap.add_argument("--grid", action="store_true", help="also every tile size probe_fp8_attention.py --tiles times")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    if fa.triton is None:
        print("Triton is not importable: pip install --target /tmp/triton triton, then PYTHONPATH=/tmp/triton:.",
              file=sys.stderr)
        return 2
    grid = []
    for t in fa.TILES.values():
        grid += [dict(t)] if t not in grid else []
    if args.grid:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from probe_fp8_attention import TILE_GRID

        grid += [t for t in TILE_GRID if t not in grid]
    rows = []
    for arch in (int(a) for a in args.arch.split(",")):
        for dim in fa.HEAD_DIMS:
            for tiles in grid:
                try:
                    row = describe(arch, dim, tiles)
                except Exception as e:  # a tile size this chip cannot hold: say so, go on
                    row = dict(arch=arch, head_dim=dim, **tiles, error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
