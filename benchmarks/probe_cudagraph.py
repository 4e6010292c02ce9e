"""What CUDA graphs would give the fused eager blocks: one batch-4 transformer call eagerly against the same call
captured once in a CUDA graph and replayed.

    python benchmarks/probe_cudagraph.py [--model flux|flux2] [--batch 4] [--iters 7]

Builds the transformer alone (FLUX.1-dev: ``probe_transformer.build``, the whole model; FLUX.2-dev:
``probe_flux2.build``, 2 double + 8 single blocks; dummy bf16 weights, 1024x1024, 512 text tokens), runs its fused
eager blocks (``fuse_blocks_eager``), times a call eagerly and as a graph replay (CUDA events, median) and checks
that the replay's output equals the eager call's. Results go to ``$OUT/probe_cudagraph_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from probe_attention import timed
    from probe_transformer import call

    from shardgen.speed import accel

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("flux", "flux2"), default="flux")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    if args.model == "flux":
        from probe_transformer import build, inputs
        tr = build(dev, dt)
    else:
        from probe_flux2 import build, inputs
        tr = build(2, 8, dev, dt)
    kw = inputs(args.batch, dev, dt)
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "model": args.model,
           "batch": args.batch, "fused_blocks": accel.fuse_blocks_eager(tr)}
    ref = call(tr, kw)
    res["eager_ms"] = round(timed(lambda: call(tr, kw), args.iters, warm=0), 2)
    print("eager", res["eager_ms"], flush=True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
            for _ in range(2):
                call(tr, kw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(tr, kw)
        graph.replay()
        torch.cuda.synchronize()
        res["replay_equal"] = bool(torch.equal(out, ref))
        res["replay_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
        res["graph_ms"] = round(timed(graph.replay, args.iters, warm=0), 2)
        res["graph_pool_GiB"] = round(torch.cuda.memory_reserved() / 2 ** 30, 1)
    except Exception as e:  # something in the forward that a graph cannot capture (a host sync)
        res["graph_error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    print(json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"probe_cudagraph_{args.model}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
