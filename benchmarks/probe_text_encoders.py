"""The text encoders' share of a batch on one GPU: each encoder built alone with random weights (the real
architecture), one forward of a batch's token ids as the pipeline calls it, median of 5 after two warm-ups (the VAE's
decode: benchmarks/probe_vae.py).

    python benchmarks/probe_text_encoders.py [--models flux_dev,flux2_dev,qwen_image] [--batch 4]
                                             [--out probe_text_encoders.json]

Lengths: the ones the pipeline pads to (FLUX.1-dev: CLIP 77, T5 512; FLUX.2-dev: Mistral 512 with every hidden
state, as ``Flux2Pipeline`` asks; Qwen-Image: Qwen2.5-VL over a 128-token caption), and FLUX.2-dev's Mistral as the
job runs it (shardgen/families/flux2/speed.py: cut after layer 30, the deepest whose hidden state the pipeline
reads).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_attention import timed as _timed  # noqa: E402 (a sibling script: median CUDA-event milliseconds)

TEXT = {"flux_dev": [("text_encoder", 77), ("text_encoder_2", 512)], "flux2_dev": [("text_encoder", 512)],
        "qwen_image": [("text_encoder", 128)]}


def timed(fn, iters=5) -> float:
    """Median milliseconds of ``fn()`` after two warm-ups, without autograd."""
    with torch.no_grad():
        return round(_timed(fn, iters=iters), 2)


def component(model: str, name: str, dev, dtype):
    from shardgen.models.dummy import construct_meta, dummy_architecture, materialize_random

    spec = dummy_architecture(model)[name]
    g = torch.Generator(dev).manual_seed(0)
    return materialize_random(construct_meta(spec), dev, dtype, generator=g).eval()


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
            from shardgen.families.flux2.speed import encoder_cut

            with encoder_cut(enc, (10, 20, 30)), torch.no_grad():
                cut = enc(**kw).hidden_states[30]
                out[name + "_cut_at_30"] = {"ms": timed(lambda: enc(**kw)), "equal": bool(torch.equal(cut, full))}
            print(model, name, "cut", json.dumps(out[name + "_cut_at_30"]), flush=True)
        enc = None  # freed before the next component is built
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="flux_dev,flux2_dev,qwen_image")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default="probe_text_encoders.json")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": a.batch}
    for model in a.models.split(","):
        res[model] = text_rows(model, a.batch, dev, dtype)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
