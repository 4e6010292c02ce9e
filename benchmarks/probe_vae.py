"""Time each model's VAE decode at its default size, eager against cuDNN autotuning, channels-last layouts and a
compiled decode.

    python benchmarks/probe_vae.py [--models flux_dev,flux2_dev,qwen_image,sd35_large] [--batch 4] [--iters 5]

Builds the VAE alone (``shardgen.models.dummy``: the real architecture, random bf16 weights), decodes a batch of
1024x1024 latents per variant and prints ms per image and the largest difference to the eager decode. Variants:
``eager`` (as the pipelines decode), ``benchmark`` (``torch.backends.cudnn.benchmark``), ``channels_last`` (the
module and its input in channels-last: ``channels_last_3d`` for a video VAE), ``both``. Results go to
``$OUT/probe_vae.json``. ``fused``: ``fused_decode`` as the job installs it (shardgen/speed/fused_decode.py: the
decoder channels-last, its GroupNorm + SiLU pairs in Triton), with the PSNR of its images against the eager ones
(8-bit pixels, as the job writes them); ``--variants`` picks the rows. ``--compiled`` adds ``compiled``
(``torch.compile`` of ``vae.decode``, default mode, contiguous layout; the seconds its first call takes beyond a
timed one as ``first_call_extra_s``: the compilation).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardgen.quality.metrics import psnr  # noqa: E402
from shardgen.speed import fused_decode  # noqa: E402


def build_vae(model: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from shardgen.models.dummy import construct_meta, dummy_architecture, materialize_random

    spec = dummy_architecture(model)["vae"]
    vae = materialize_random(construct_meta(spec), device, dtype, torch.Generator(device).manual_seed(0))
    return vae.eval()


def latents(vae: torch.nn.Module, batch: int, size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    cfg = vae.config
    channels = cfg.get("latent_channels") or cfg.get("z_dim")
    side = size // 8
    shape = (batch, channels, 1, side, side) if "z_dim" in cfg else (batch, channels, side, side)
    return torch.randn(*shape, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(1))


def time_decode(decode, z, iters: int) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        out = decode(z, return_dict=False)[0]
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            decode(z, return_dict=False)[0]
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times), out


def psnr_8bit(out: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The lowest PSNR over the batch's images as the job saves them (8-bit, [-1, 1] mapped to [0, 255]);
    None where they are equal."""
    def pixels(x):
        return ((x.clamp(-1, 1) + 1) * 127.5).round().flatten(1).cpu().numpy()

    values = [psnr(a, b) for a, b in zip(pixels(out), pixels(ref))]
    finite = [v for v in values if v != float("inf")]
    return round(min(finite), 2) if finite else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="flux_dev,flux2_dev,qwen_image,sd35_large")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--compiled", action="store_true", help="also a compiled decode (first call: the compilation)")
    ap.add_argument("--variants", default="eager,benchmark,channels_last,both,fused",
                    help="the rows, in order (eager first: the others are compared with it)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "batch": args.batch, "models": {}}
    for model in args.models.split(","):
        vae = build_vae(model, dev, dt)
        z = latents(vae, args.batch, args.size, dev, dt)
        layout = torch.channels_last_3d if z.dim() == 5 else torch.channels_last
        rows, ref = {}, None
        for name in args.variants.split(",") + (["compiled"] if args.compiled else []):
            torch.backends.cudnn.benchmark = name in ("benchmark", "both")
            last = name in ("channels_last", "both")
            decode = torch.compile(vae.decode) if name == "compiled" else vae.decode
            try:  # a video VAE's 2-D convs (rank-4 weights) take no channels_last_3d: an error row
                vae.to(memory_format=layout if last else torch.contiguous_format)
                if name == "fused" and not fused_decode.install(vae):
                    raise ValueError("fused_decode does not take this VAE")
                zz = z.contiguous(memory_format=layout) if last else z.contiguous()
                t0 = time.perf_counter()
                ms, out = time_decode(decode, zz, args.iters)
                first_s = time.perf_counter() - t0 - ms * (args.iters + 1) / 1000
            except Exception as e:
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                vae.to(memory_format=torch.contiguous_format)
                continue
            finally:
                fused_decode.uninstall(vae)
            out = out.float()
            ref = out if ref is None else ref
            rows[name] = {"ms_per_image": round(ms / args.batch, 2), "first_call_extra_s": round(first_s, 2),
                          "finite": bool(out.isfinite().all()),
                          "max_abs_diff": float(torch.nan_to_num(out - ref).abs().max()),
                          "psnr_vs_eager_db": psnr_8bit(out, ref)}
            print(model, name, json.dumps(rows[name]), flush=True)
        torch.backends.cudnn.benchmark = False
        res["models"][model] = rows
        del vae, z, ref, decode
        gc.collect()
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_vae.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
