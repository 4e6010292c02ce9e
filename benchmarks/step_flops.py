"""How far a model's measured rate is from the GPU's bf16 limit: the FLOPs of one denoising step, counted from the
transformer's architecture (built on the meta device: no weights, no GPU).

    python benchmarks/step_flops.py --model flux2_dev --steps 8 --measured 3.73 --seed 4.78

Counts the repeated blocks' linear layers per token they see (a dual-stream block's image layers see the image
tokens, its text layers the text tokens; a single-stream block sees both) and attention's two matmuls over the
joint sequence. Per-sample layers (the adaLN modulation) are left out: they do not grow with the tokens.
``--peak`` is the sustained bf16 rate the GEMMs reach on the GPU (H200: ~790 TFLOP/s, ../shared/GPU.md).
"""

from __future__ import annotations

import argparse

import torch

from shardgen.models.dummy import construct_meta, dummy_architecture

TEXT_LAYERS = ("add_", "ff_context", "to_add_out", "context")  # diffusers' names of a dual-stream block's text side


def step_flops(model: str, image_tokens: int, text_tokens: int) -> tuple[float, float]:
    """(linear, attention) FLOPs of one transformer call for one sample."""
    tr = construct_meta(dummy_architecture(model)["transformer"])
    blocks = [m for m in tr.modules() if type(m).__name__ in tuple(tr._repeated_blocks)]
    linear = 0.0
    for block in blocks:
        single = "Single" in type(block).__name__
        for name, m in block.named_modules():
            if not isinstance(m, torch.nn.Linear) or ("norm" in name and "linear" in name):
                continue
            seen = image_tokens + text_tokens if single else (
                text_tokens if any(t in name for t in TEXT_LAYERS) else image_tokens)
            linear += 2 * m.in_features * m.out_features * seen
    heads, head_dim = tr.config.num_attention_heads, tr.config.attention_head_dim
    attention = 4.0 * (image_tokens + text_tokens) ** 2 * heads * head_dim * len(blocks)
    return linear, attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flux_dev", help="a dual/single-stream DiT in conf/model/ (flux_dev, flux2_dev)")
    ap.add_argument("--image-tokens", type=int, default=4096, help="1024x1024: 4096")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--peak", type=float, default=790.0, help="sustained bf16 TFLOP/s")
    ap.add_argument("--measured", type=float, help="measured s/image (the whole pipeline)")
    ap.add_argument("--seed", type=float, help="the seed loop's s/image, for the 1.5x target")
    ap.add_argument("--other", type=float, default=0.13,
                    help="s/image outside the transformer (H200, FLUX.1-dev: VAE decode 85 ms, the encoders less)")
    a = ap.parse_args()
    linear, attention = step_flops(a.model, a.image_tokens, a.text_tokens)
    limit = a.steps * (linear + attention) / (a.peak * 1e12)
    print(f"{a.model}: {linear / 1e12:.1f} TFLOP linear + {attention / 1e12:.1f} attention = "
          f"{(linear + attention) / 1e12:.1f} TFLOP per image-step; {a.steps} steps at {a.peak:.0f} TFLOP/s: "
          f"{limit:.2f} s/image in the transformer")
    if a.measured:
        print(f"  measured {a.measured:.2f} s/image: the transformer at {limit / (a.measured - a.other):.0%} of that rate")
    if a.seed:
        target = a.seed / 1.5
        print(f"  1.5x the seed loop ({a.seed:.2f} s/image) = {target:.2f} s/image: the transformer at "
              f"{limit / (target - a.other):.0%} of that rate")


if __name__ == "__main__":
    main()
