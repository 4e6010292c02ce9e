"""Probe the dummy-weight pipelines on a GPU: build time per component, parameter counts, memory, step times.

    python benchmarks/probe_dummy.py [FluxPipeline [QwenImagePipeline [Flux2Pipeline]]] [--steps 4] [--size 1024]

Builds each pipeline with ``shardgen.models.dummy.build_dummy_pipeline`` on cuda in bfloat16, then runs one
warm-up and one measured generation (``--steps`` steps at ``--size`` x ``--size``), timing every
transformer / text-encoder / VAE-decode call with CUDA-synchronised hooks. Results are printed and,
when ``$OUT`` is set, written to ``$OUT/probe_dummy.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 1024 ** 3


def _timed(module, name, log, method="forward"):
    """Record the wall time (synchronised) of each call of ``module.<method>`` into ``log[name]``."""
    orig = getattr(module, method)

    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig(*args, **kwargs)
        torch.cuda.synchronize()
        log.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    setattr(module, method, wrapper)


def probe(name: str, steps: int, size: int) -> dict:
    from shardgen.models.dummy import build_dummy_pipeline

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    pipe = build_dummy_pipeline(name, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    res = {"pipeline": name, "build_s": round(time.perf_counter() - t0, 2),
           "build_s_per_component": {k: round(v, 2) for k, v in pipe.dummy_build_seconds.items()},
           "params_B": {}, "allocated_after_build_GiB": round(torch.cuda.memory_allocated() / GiB, 2),
           "peak_build_GiB": round(torch.cuda.max_memory_allocated() / GiB, 2)}
    for comp, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            res["params_B"][comp] = round(sum(p.numel() for p in module.parameters()) / 1e9, 3)
            dtypes = sorted({str(p.dtype) for p in module.parameters()})
            if dtypes != ["torch.bfloat16"]:
                res.setdefault("param_dtypes", {})[comp] = dtypes
    print(json.dumps(res), flush=True)

    log: dict[str, list[float]] = {}
    _timed(pipe.transformer, "transformer_ms", log)
    for comp in ("text_encoder", "text_encoder_2"):
        if getattr(pipe, comp, None) is not None:
            _timed(getattr(pipe, comp), f"{comp}_ms", log)
    _timed(pipe.vae, "vae_decode_ms", log, method="decode")

    kwargs = dict(prompt="a photo of a cat", num_inference_steps=steps, height=size, width=size, output_type="np")
    for phase in ("warmup", "measured"):
        log.clear()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        images = pipe(**kwargs, generator=torch.Generator(pipe._execution_device).manual_seed(0)).images
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        res[phase] = {
            "total_s": round(total, 3), "peak_GiB": round(torch.cuda.max_memory_allocated() / GiB, 2),
            "finite": bool(torch.isfinite(torch.as_tensor(images)).all()), "image_shape": list(images.shape),
            **{k: [round(x, 1) for x in v] for k, v in log.items()},
        }
        print(phase, json.dumps(res[phase]), flush=True)
    m = res["measured"]
    res["transformer_ms_per_step"] = round(sum(m["transformer_ms"]) / len(m["transformer_ms"]), 1)
    res["text_seq_len_note"] = {
        "FluxPipeline": "T5 512 + CLIP 77 (padded)", "Flux2Pipeline": "Mistral 512 (padded)",
        "QwenImagePipeline": "padded to the longest prompt (tiny tokenizer: ~10 tokens for this prompt)"}[name]
    del pipe, images
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("pipelines", nargs="*", default=["FluxPipeline"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    args = ap.parse_args()

    import diffusers
    import transformers

    transformers.logging.set_verbosity_error()
    env = {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
           "gpu": torch.cuda.get_device_name(),
           "total_GiB": round(torch.cuda.get_device_properties(0).total_memory / GiB, 1)}
    print(json.dumps(env), flush=True)
    results = {"env": env, "runs": []}
    out = os.environ.get("OUT")
    for name in args.pipelines:
        try:
            results["runs"].append(probe(name, args.steps, args.size))
        except Exception as e:  # report and go on with the next pipeline
            traceback.print_exc()
            results["runs"].append({"pipeline": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            gc.collect()
            torch.cuda.empty_cache()
        if out:
            Path(out, "probe_dummy.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
