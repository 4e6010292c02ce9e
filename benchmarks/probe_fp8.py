"""One transformer call in bf16 and with fp8=true's float8 layers, eagerly on one GPU: the relative RMS error of the
fp8 output against bf16 (what one call costs, before the sampler compounds it over the steps) and the time per call.

    python benchmarks/probe_fp8.py [--models flux_dev,flux2_dev] [--batch 2] [--out $OUT/probe_fp8.json]

The dummy transformer of the job (``model.weights=dummy``: the real widths and depths, random bf16 weights) on one
1024x1024 step (4096 image + 512 text tokens), diffusers' stock blocks (no fused forwards, no CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_flux2  # noqa: E402 (a sibling script: its inputs, timer and error measure)
from probe_flux2 import rel_rms, timed  # noqa: E402

PIPELINES = {"flux_dev": "FluxPipeline", "flux2_dev": "Flux2Pipeline", "qwen_image": "QwenImagePipeline"}


def build(model: str, device, dtype):
    from shardgen.models.dummy import construct_meta, dummy_architecture, materialize_random

    spec = dummy_architecture(PIPELINES[model])["transformer"]
    g = torch.Generator(device).manual_seed(0)
    return materialize_random(construct_meta(spec), device, dtype, generator=g).eval()


def inputs(model: str, batch: int, device, dtype):
    import probe_transformer

    if model == "qwen_image":
        return qwen_inputs(batch, device, dtype)
    return (probe_transformer if model == "flux_dev" else probe_flux2).inputs(batch, device, dtype)


def qwen_inputs(batch, device, dtype, size=1024, text=96):
    """One 1024x1024 Qwen-Image step: 4,096 image tokens, a caption of ``text`` tokens (its text encoder's width)."""
    g = torch.Generator(device).manual_seed(1)
    return dict(
        hidden_states=torch.randn(batch, (size // 16) ** 2, 64, device=device, dtype=dtype, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 3584, device=device, dtype=dtype, generator=g),
        encoder_hidden_states_mask=torch.ones(batch, text, device=device, dtype=torch.long),
        timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
        img_shapes=[[(1, size // 16, size // 16)]] * batch, return_dict=False)


def main() -> None:
    from shardgen.speed import accel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="flux_dev,flux2_dev")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default="probe_fp8.json")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {}
    for model in a.models.split(","):
        tr = build(model, dev, dt)
        kw = inputs(model, a.batch, dev, dt)
        ms_bf16, ref = timed(tr, kw, 5)
        accel.enable_fp8(tr)
        ms_fp8, out = timed(tr, kw, 5)
        res[model] = {"bf16_ms": round(ms_bf16, 1), "fp8_ms": round(ms_fp8, 1), "x": round(ms_bf16 / ms_fp8, 3),
                      "rel_rms_fp8_vs_bf16": rel_rms(out, ref), "out_rms": ref.float().pow(2).mean().sqrt().item()}
        print(model, res[model], flush=True)
        del tr, ref, out
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
