"""``fused_decode`` (on by default): on CUDA, the VAE's image decoder runs channels-last with each GroupNorm and the
SiLU after it in two Triton passes; a causal video VAE decodes a single frame with 2-D convolutions.

Decoding a batch was ~4% of a FLUX.1-dev or FLUX.2-dev fp8 batch (86 ms an image on an H100 at 1024x1024), and
most of it was not the convolutions' arithmetic: eager GroupNorm + SiLU read and write each activation five times,
and cuDNN's bf16 convolutions run fastest on channels-last activations. But torch's GroupNorm is slow on a
channels-last tensor (the decode then takes 107 ms an image), so the GroupNorms here are a kernel of their own: one pass for each block of
pixels' per-group mean and spread, merged per (sample, group) with Chan's formula (exact for any offset, unlike a sum
of squares), and one pass that normalises, scales, shifts and applies the SiLU. Exact up to bf16 rounding (the SiLU
reads the normalised value before it is rounded to bf16, as a compiled decoder does).

Where it applies: diffusers' ``vae.Decoder`` (AutoencoderKL: FLUX.1, SD3; AutoencoderKLFlux2: FLUX.2), whose
ResnetBlock2D pairs a GroupNorm with a SiLU and whose attention has a GroupNorm of its own. Off the GPU, and for a
layout or channel count the kernel does not take, each norm runs torch's own ops on the same modules' weights.

The causal video VAEs (Qwen-Image's, Wan's) decode an image, or a video's first latent frame, as one frame with
nothing cached: each causal 3-D convolution pads it with zero frames in front, so of its temporal taps only the last
meets the frame. There each such convolution runs as a 2-D one with that tap (``one_frame_forward``): a third of the
multiply-adds of a 3x3x3 kernel, on cuDNN's 2-D kernels; the skipped products are exact zeros, so only the order of
the sums changes. Frames with a cache (a video's later ones) keep the 3-D convolution.

On an H100 (batch 4, 1024x1024): FLUX's decoder 85.8 -> 34.1 ms an image (a compiled one: 38.8, after 24 s of
compilation), Qwen-Image's 76.0 -> 41.2 (benchmarks/results/2026-12-06-h100-decode-fa3-9554c34/).
``fused_decode=false`` restores the decoder as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardgen.pick import pick
from shardgen.speed.techniques import Step, Technique, register_technique

try:  # Triton ships with CUDA builds of torch; CPU builds have none (torch's ops run there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = tl = None

_ORIGINAL = "_shardgen_fused_decode"
TILE = 8192
"""Elements a program reads per pass (pixels x channels): 64 pixels of 128 channels, 16 of 512."""
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter: the kernels on CPU tensors (tests)


@dataclass(frozen=True)
class FusedDecodeOptions:
    """The options this technique reads."""

    fused_decode: bool = True


if triton is not None:

    @triton.jit
    def _group_stats_kernel(x_ptr, mean_ptr, m2_ptr, pixels, C: tl.constexpr, G: tl.constexpr,
                            BLOCK_P: tl.constexpr):
        """Per group, the mean and the sum of squared deviations of ``BLOCK_P`` pixels of one sample of x
        ((batch, pixels, C) contiguous) -> mean/m2[sample, block, group]."""
        block, sample = tl.program_id(0), tl.program_id(1)
        p = block * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.arange(0, C)
        live = tl.broadcast_to((p < pixels)[:, None], (BLOCK_P, C))
        src = x_ptr + sample.to(tl.int64) * pixels * C + p[:, None].to(tl.int64) * C + c[None, :]
        x = tl.reshape(tl.load(src, mask=live, other=0.0).to(tl.float32), (BLOCK_P, G, C // G))
        live = tl.reshape(live, (BLOCK_P, G, C // G))
        count = tl.minimum(pixels - block * BLOCK_P, BLOCK_P) * (C // G)
        mean = tl.sum(tl.sum(x, axis=2), axis=0) / count
        dev = tl.where(live, x - mean[None, :, None], 0.0)
        m2 = tl.sum(tl.sum(dev * dev, axis=2), axis=0)
        out = (sample * tl.num_programs(0) + block) * G + tl.arange(0, G)
        tl.store(mean_ptr + out, mean)
        tl.store(m2_ptr + out, m2)

    @triton.jit
    def _group_apply_kernel(x_ptr, y_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, pixels, C: tl.constexpr,
                            G: tl.constexpr, BLOCK_P: tl.constexpr, SILU: tl.constexpr):
        """y = (x - mean[group]) * rstd[group] * w + b, then SiLU (``SILU``), for ``BLOCK_P`` pixels of one sample."""
        block, sample = tl.program_id(0), tl.program_id(1)
        p = block * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.arange(0, C)
        live = (p < pixels)[:, None]
        at = sample.to(tl.int64) * pixels * C + p[:, None].to(tl.int64) * C + c[None, :]
        x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        group = sample * G + c // (C // G)
        scale = tl.load(rstd_ptr + group) * tl.load(w_ptr + c).to(tl.float32)
        # x - mean first: folding the mean into the shift would cancel catastrophically far from zero
        y = (x - tl.load(mean_ptr + group)[None, :]) * scale[None, :] + tl.load(b_ptr + c).to(tl.float32)[None, :]
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=live)


def kernel_takes(x: torch.Tensor, norm: torch.nn.GroupNorm) -> bool:
    """Whether the fused kernel normalises ``x`` for ``norm``: Triton present, a CUDA tensor (or the interpreter's),
    channels last in memory (dimension 1 innermost, the others as one row-major block of pixels), a power-of-two
    channel count of at most 1,024 split in a power-of-two number of groups, weights and biases present."""
    if triton is None or not (x.is_cuda or _INTERPRET) or x.dim() < 3 or not norm.affine:
        return False
    c, g = x.shape[1], norm.num_groups
    if c > 1024 or c & (c - 1) or g & (g - 1) or c % g or c != norm.num_channels:
        return False
    return x.movedim(1, -1).is_contiguous()


def group_norm_silu(x: torch.Tensor, norm: torch.nn.GroupNorm, silu: bool) -> torch.Tensor:
    """``norm(x)``, then SiLU when ``silu``, for a tensor ``kernel_takes`` (the output in x's layout and dtype)."""
    rows = x.movedim(1, -1)
    samples, channels, groups = x.shape[0], x.shape[1], norm.num_groups
    pixels = rows[0].numel() // channels
    block_p = max(1, TILE // channels)
    blocks = triton.cdiv(pixels, block_p)
    means = torch.empty(samples, blocks, groups, device=x.device, dtype=torch.float32)
    m2s = torch.empty_like(means)
    _group_stats_kernel[(blocks, samples)](rows, means, m2s, pixels, C=channels, G=groups, BLOCK_P=block_p)
    # Chan's merge of the blocks' (count, mean, m2): exact whatever the activations' offset
    first = torch.arange(blocks, device=x.device) * block_p  # in int64: float32 counts stop being exact at 2^24
    counts = ((pixels - first).clamp(max=block_p) * (channels // groups)).float()[None, :, None]
    total = pixels * (channels // groups)
    mean = (means * counts).sum(1) / total
    m2 = m2s.sum(1) + (counts * (means - mean[:, None]) ** 2).sum(1)
    rstd = torch.rsqrt(m2 / total + norm.eps)
    out = torch.empty_like(rows)
    _group_apply_kernel[(blocks, samples)](rows, out, mean.contiguous(), rstd.contiguous(), norm.weight, norm.bias,
                                           pixels, C=channels, G=groups, BLOCK_P=block_p, SILU=silu)
    return out.movedim(-1, 1)


class FusedGroupNorm(torch.nn.GroupNorm):
    """A GroupNorm (and the SiLU after it, ``silu``) in the fused kernel where it takes the input, else torch's ops.
    ``install`` turns the decoder's own GroupNorms into this class in place: the same parameters under the same
    names (a state dict, a weight fingerprint or a LoRA loader sees nothing changed)."""

    silu: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_takes(x, self):
            return group_norm_silu(x, self, self.silu)
        y = super().forward(x)
        return F.silu(y) if self.silu else y


def fusable_decoder(vae: torch.nn.Module | None) -> torch.nn.Module | None:
    """``vae``'s decoder when it is diffusers' ``vae.Decoder`` (the image VAEs of FLUX.1, FLUX.2, SD3), else None."""
    try:
        from diffusers.models.autoencoders.vae import Decoder
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return None
    decoder = getattr(vae, "decoder", None)
    return decoder if isinstance(decoder, Decoder) else None


def _plain_norm(module) -> bool:
    return type(module) is torch.nn.GroupNorm


def _fusions(decoder: torch.nn.Module) -> tuple[list[tuple[torch.nn.GroupNorm, bool]],
                                                list[tuple[torch.nn.Module, str]]]:
    """(each GroupNorm of the decoder with whether the SiLU after it joins it, each SiLU that then becomes an
    identity as (owner, attribute)): a ResnetBlock2D's two norms with its shared ``nonlinearity``, the decoder's last
    norm with ``conv_act``, the attention's norm alone."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    norms, silus = [], []
    for module in decoder.modules():
        if isinstance(module, ResnetBlock2D) and isinstance(module.nonlinearity, torch.nn.SiLU) \
                and module.time_emb_proj is None and _plain_norm(module.norm1) and _plain_norm(module.norm2):
            norms += [(module.norm1, True), (module.norm2, True)]
            silus.append((module, "nonlinearity"))
        elif isinstance(module, Attention) and _plain_norm(module.group_norm):
            norms.append((module.group_norm, False))
    if _plain_norm(decoder.conv_norm_out) and isinstance(decoder.conv_act, torch.nn.SiLU):
        norms.append((decoder.conv_norm_out, True))
        silus.append((decoder, "conv_act"))
    return norms, silus


def one_frame_forward(conv: torch.nn.Conv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """A diffusers causal 3-D convolution (``_padding``: (w, w, h, h, time in front, 0), applied before the
    convolution) of ``x``: for one frame with nothing cached and a front padding that leaves exactly one output
    frame, the 2-D convolution with the kernel's last temporal tap; otherwise the module's own forward."""
    pad = conv._padding
    if x.shape[2] != 1 or cache_x is not None or pad[4] != conv.kernel_size[0] - 1 or conv.stride[0] != 1 \
            or conv.dilation[0] != 1 or pad[5] != 0 or pad[0] != pad[1] or pad[2] != pad[3]:
        return type(conv).forward(conv, x, cache_x)
    out = F.conv2d(x[:, :, 0], conv.weight[:, :, -1], conv.bias, stride=conv.stride[1:], padding=(pad[2], pad[0]),
                   dilation=conv.dilation[1:])
    return out.unsqueeze(2)


def causal_convs(vae: torch.nn.Module | None) -> list[torch.nn.Conv3d]:
    """The causal 3-D convolutions a decode runs (``vae``'s decoder and its ``post_quant_conv``; Qwen-Image's and
    Wan's VAEs: a ``_padding`` attribute and a ``forward(x, cache_x=None)``), [] for any other VAE."""
    decoder = getattr(vae, "decoder", None)
    if decoder is None:
        return []
    modules = [*decoder.modules(), getattr(vae, "post_quant_conv", None)]
    return [m for m in modules if isinstance(m, torch.nn.Conv3d) and type(m).__name__.endswith("CausalConv3d")
            and len(getattr(m, "_padding", ())) == 6]


def _install_one_frame(vae: torch.nn.Module) -> int:
    """Route each causal convolution's one-frame calls to ``one_frame_forward``; how many there are."""
    import types

    convs = causal_convs(vae)
    if not convs:
        return 0
    for conv in convs:
        conv.forward = types.MethodType(one_frame_forward, conv)
    # cuDNN may hand a 2-D convolution's output back channels-last: the frames leave in the usual layout
    setattr(vae.decoder, _ORIGINAL, ("one_frame", (convs, vae.decoder.register_forward_hook(_contiguous_out))))
    return len(convs)


def _channels_last_in(module, args, kwargs):
    """The decoder's input latents channels-last (the layout its weights now have)."""
    sample = args[0] if args else kwargs["sample"]
    sample = sample.contiguous(memory_format=torch.channels_last)
    return ((sample, *args[1:]), kwargs) if args else (args, {**kwargs, "sample": sample})


def _contiguous_out(module, args, output):
    """The decoded images back in the usual layout: what a pipeline's post-processing and a caller expect."""
    return output.contiguous()


def install(vae: torch.nn.Module) -> int:
    """Fuse ``vae``'s decoder in place (idempotent); the number of GroupNorms fused, or of causal convolutions
    routed to ``one_frame_forward`` (0: not a decoder it takes)."""
    decoder = fusable_decoder(vae)
    state = getattr(getattr(vae, "decoder", None), _ORIGINAL, None)
    if state is not None:
        return len(state[1][0])
    if decoder is None:
        return _install_one_frame(vae)
    norms, silus = _fusions(decoder)
    for norm, silu in norms:
        norm.__class__, norm.silu = FusedGroupNorm, silu
    originals = [(owner, name, getattr(owner, name)) for owner, name in silus]
    for owner, name in silus:
        setattr(owner, name, torch.nn.Identity())
    decoder.to(memory_format=torch.channels_last)
    hooks = [decoder.register_forward_pre_hook(_channels_last_in, with_kwargs=True),
             decoder.register_forward_hook(_contiguous_out)]
    setattr(decoder, _ORIGINAL, ("norms", ([norm for norm, _ in norms], originals, hooks)))
    return len(norms)


def uninstall(vae: torch.nn.Module) -> bool:
    """Put ``vae``'s decoder back as it was; whether it had been fused."""
    decoder = getattr(vae, "decoder", None)
    state = getattr(decoder, _ORIGINAL, None)
    if state is None:
        return False
    setattr(decoder, _ORIGINAL, None)
    kind, parts = state
    if kind == "one_frame":
        convs, hook = parts
        for conv in convs:
            del conv.forward
        hook.remove()
        return True
    norms, originals, hooks = parts
    for norm in norms:
        norm.__class__ = torch.nn.GroupNorm
        del norm.silu
    for owner, name, original in originals:
        setattr(owner, name, original)
    for hook in hooks:
        hook.remove()
    decoder.to(memory_format=torch.contiguous_format)
    return True


def apply(step: Step) -> dict:
    """Fuse the pipeline's VAE decoder on CUDA when asked (and Triton is there), else put it back."""
    opts = pick(FusedDecodeOptions, step.opts)
    vae = getattr(step.pipe, "vae", None)
    cuda = step.device is not None and torch.device(step.device).type == "cuda"
    if vae is None or not (opts.fused_decode and cuda and triton is not None):
        return {"fused_decode": 0} if vae is not None and uninstall(vae) else {}
    fused = install(vae)
    return {"fused_decode": fused} if fused else {}


register_technique(Technique("fused_decode", 55, apply))
