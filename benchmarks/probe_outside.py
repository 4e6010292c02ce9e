"""Where a batch's time goes outside the transformer on one GPU: the VAE's decode of a batch of latents and the text
encoders' forward, each component built alone with random weights (the real architecture, no transformer), timed
as the pipeline calls it, and the VAE also in channels-last memory.

    python benchmarks/probe_outside.py [--models flux_dev,flux2_dev,qwen_image] [--batch 4] [--size 1024]
                                       [--only vae|text] [--out probe_outside.json]

VAE: ``vae.decode`` of (batch, C, size/8, size/8) latents (Qwen-Image's: one frame), median of 5 calls after two
warm-ups, as built, with cuDNN's autotuner, with the VAE and its input in ``torch.channels_last`` (cuDNN's NHWC
convolutions) and compiled, with the largest difference from the first way's pixels. Text encoders: one forward of the batch's token ids at the length
the pipeline pads to (FLUX.1-dev: CLIP 77, T5 512; FLUX.2-dev: Mistral 512 with every hidden state, as
``Flux2Pipeline`` asks; Qwen-Image: Qwen2.5-VL over a 128-token caption), and FLUX.2-dev's Mistral cut after the
deepest layer whose hidden state the pipeline uses (30 of 40).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PIPELINES = {"flux_dev": "FluxPipeline", "flux2_dev": "Flux2Pipeline", "qwen_image": "QwenImagePipeline"}
TEXT = {"flux_dev": [("text_encoder", 77), ("text_encoder_2", 512)], "flux2_dev": [("text_encoder", 512)],
        "qwen_image": [("text_encoder", 128)]}


def timed(fn, iters=5) -> float:
    """Median milliseconds of ``fn()`` after two warm-ups."""
    ms = []
    with torch.no_grad():
        for _ in range(2):
            fn()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
    return round(statistics.median(ms), 2)


def component(model: str, name: str, dev, dtype):
    from shardgen.models.dummy import construct_meta, dummy_architecture, materialize_random

    spec = dummy_architecture(PIPELINES[model])[name]
    g = torch.Generator(dev).manual_seed(0)
    return materialize_random(construct_meta(spec), dev, dtype, generator=g).eval()


def vae_rows(model: str, batch: int, size: int, dev, dtype) -> dict:
    """``vae.decode`` of a batch: as built, with cuDNN's autotuner (``cudnn.benchmark``), in channels-last memory,
    and compiled (``torch.compile`` of ``vae.decode``, default mode; its first call's seconds as ``compile_s``)."""
    import time

    vae = component(model, "vae", dev, dtype)
    video = model == "qwen_image"
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    shape = (batch, channels, 1, size // 8, size // 8) if video else (batch, channels, size // 8, size // 8)
    z = torch.randn(shape, device=dev, dtype=dtype, generator=torch.Generator(dev).manual_seed(1))
    decode = vae.decode
    out, ref = {}, None
    for way in ("as_built", "cudnn_benchmark", "channels_last", "compiled"):
        torch.backends.cudnn.benchmark = way != "as_built"
        if way == "channels_last":
            if video:
                continue  # a video VAE's 5-D convolutions: channels_last_3d is another question
            vae.to(memory_format=torch.channels_last)
            z = z.contiguous(memory_format=torch.channels_last)
        if way == "compiled":
            vae.to(memory_format=torch.contiguous_format)
            z = z.contiguous()
            decode = torch.compile(vae.decode)
        t0 = time.perf_counter()
        with torch.no_grad():
            pixels = decode(z, return_dict=False)[0].float()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        ref = pixels if ref is None else ref
        out[way] = {"ms": timed(lambda: decode(z, return_dict=False)), "first_call_s": round(first_s, 2),
                    "max_abs_vs_as_built": round((pixels - ref).abs().max().item(), 5)}
        print(model, "vae", way, json.dumps(out[way]), flush=True)
    torch.backends.cudnn.benchmark = False
    vae = decode = None  # freed before the next component is built
    torch.cuda.empty_cache()
    return out


def text_rows(model: str, batch: int, dev, dtype) -> dict:
    out = {}
    for name, length in TEXT[model]:
        enc = component(model, name, dev, dtype)
        vocab = enc.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (batch, length), device=dev, generator=torch.Generator(dev).manual_seed(2))
        mask = torch.ones_like(ids)
        kw = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        if model != "flux_dev":
            kw["use_cache"] = False
        out[name] = {"tokens": [batch, length], "ms": timed(lambda: enc(**kw))}
        print(model, name, json.dumps(out[name]), flush=True)
        if model == "flux2_dev":  # the pipeline stacks hidden states 10, 20 and 30: layers 31-40 and the logits unused
            with torch.no_grad():
                full = enc(**kw).hidden_states[30]
            layers = enc.model.language_model.layers
            enc.model.language_model.layers = layers[:30]
            norm = enc.model.language_model.norm
            enc.model.language_model.norm = torch.nn.Identity()  # the last hidden state is recorded after it
            with torch.no_grad():
                cut = enc(**kw).hidden_states[30]
            out[name + "_cut_at_30"] = {"ms": timed(lambda: enc(**kw)), "equal": bool(torch.equal(cut, full))}
            enc.model.language_model.layers, enc.model.language_model.norm = layers, norm
            print(model, name, "cut", json.dumps(out[name + "_cut_at_30"]), flush=True)
        enc = None  # freed before the next component is built
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="flux_dev,flux2_dev,qwen_image")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--only", choices=("vae", "text"), default=None, help="the VAEs or the text encoders alone")
    ap.add_argument("--out", default="probe_outside.json")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": a.batch,
                 "size": a.size}
    for model in a.models.split(","):
        res[model] = {}
        if a.only != "text":
            res[model]["vae"] = vae_rows(model, a.batch, a.size, dev, dtype)
        if a.only != "vae":
            res[model]["text"] = text_rows(model, a.batch, dev, dtype)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
