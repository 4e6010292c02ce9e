"""``fused_decode``: the VAE decoder channels-last with its GroupNorm + SiLU pairs in the fused kernel
(shardgen/speed/fused_decode.py). The kernel runs on CPU tensors under Triton's interpreter (``interpreted``); the
GPU test walks the real decoders (tests/test_gpu.py)."""

from __future__ import annotations

import json

import torch

from shardgen.speed import fused_decode
from tests.test_fp8_attention import interpreted


def small_vae():
    """An AutoencoderKL with FLUX.1's decoder layout (4 up blocks, GroupNorms of 32 groups, mid-block attention),
    narrow enough for the interpreter."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                         norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False).eval()


def test_the_kernels_equal_torch_group_norm_and_silu_for_any_pixel_count_offset_and_layout(tmp_path):
    """Channels-last images whose pixel count is not a multiple of a block, activations far from zero (a sum of
    squares would lose their spread in float32; Chan's merge does not), a (batch, channels, tokens) view as the
    decoder's attention passes it, float32 and bf16: the kernel's output is torch's GroupNorm (+ SiLU) in float64
    to rounding."""
    code = """
import json, torch, torch.nn.functional as F
from shardgen.speed.fused_decode import group_norm_silu, kernel_takes
torch.manual_seed(0)
out = []
for channels, groups, shape, offset, dtype, silu in [
        (64, 32, (2, 64, 9, 13), 0.0, torch.float32, True), (128, 32, (1, 128, 5, 7), 300.0, torch.float32, True),
        (32, 8, (2, 32, 11), 0.0, torch.float32, False), (64, 32, (2, 64, 6, 6), 0.0, torch.bfloat16, True)]:
    norm = torch.nn.GroupNorm(groups, channels, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5); norm.bias.uniform_(-0.5, 0.5)
    x = (torch.randn(shape) * 0.05 + offset).to(dtype)
    last = torch.channels_last
    x = x.contiguous(memory_format=last) if x.dim() == 4 else x.transpose(1, 2).contiguous().transpose(1, 2)
    norm = norm.to(dtype)
    with torch.no_grad():
        want = F.group_norm(x.double(), groups, norm.weight.double(), norm.bias.double(), norm.eps)
        want = F.silu(want) if silu else want
        got = group_norm_silu(x, norm, silu)
    out.append(dict(takes=kernel_takes(x, norm), same_layout=got.stride() == x.stride(), dtype=str(got.dtype),
                    err=(got.double() - want).abs().max().item(), scale=want.abs().max().item()))
print(json.dumps(out))
"""
    rows = json.loads(interpreted(code, tmp_path).splitlines()[-1])
    assert all(r["takes"] and r["same_layout"] for r in rows), rows
    assert [r["dtype"] for r in rows] == ["torch.float32"] * 3 + ["torch.bfloat16"]
    for row in rows[0], rows[2]:
        assert row["err"] < 1e-4 * max(1.0, row["scale"]), row
    # 6,000 spreads from zero: float32 holds the mean to ~1e-3 of a spread (a sum of squares would hold nothing)
    assert rows[1]["err"] < 5e-3 * rows[1]["scale"], rows[1]
    assert rows[3]["err"] < 0.02 * rows[3]["scale"], rows[3]  # bf16 rounding of the output


def test_a_fused_decoder_decodes_the_same_images_and_comes_back_as_it_was(tmp_path):
    """install swaps every GroupNorm of the decoder (resnets, attention, the last norm) and keeps the layout
    change inside it: the decoded images equal the stock decoder's to float32 rounding, in the usual layout;
    uninstall gives back the same modules and bytes."""
    code = """
import json, torch
from tests.test_fused_decode import small_vae
from shardgen.speed import fused_decode
vae = small_vae()
z = torch.randn(2, 4, 12, 10, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    want = vae.decode(z).sample
    fused = fused_decode.install(vae)
    again = fused_decode.install(vae)
    got = vae.decode(z).sample
    layout = vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    restored = fused_decode.uninstall(vae)
    back = vae.decode(z).sample
print(json.dumps(dict(fused=fused, again=again, err=(got - want).abs().max().item(), contiguous=got.is_contiguous(),
                      layout=layout, restored=restored, exact=torch.equal(back, want),
                      norms=sorted({type(m).__name__ for m in vae.decoder.modules() if 'Norm' in type(m).__name__}),
                      weights=vae.decoder.conv_in.weight.is_contiguous())))
"""
    row = json.loads(interpreted(code, tmp_path).splitlines()[-1])
    # 2 resnets x 2 norms in the mid block, its attention's norm, 2 up blocks x 2 resnets x 2 norms, the last norm
    assert row["fused"] == row["again"] == 2 * 2 + 1 + 2 * 2 * 2 + 1, row
    assert row["err"] < 1e-4 and row["contiguous"] and row["layout"], row
    assert row["restored"] and row["exact"] and row["weights"] and row["norms"] == ["GroupNorm"], row


def test_off_the_gpu_and_when_switched_off_the_decoder_is_left_as_diffusers_built_it():
    """A CPU run keeps the stock decoder (nothing channels-last, no swapped module); fused_decode=false on a fused
    decoder puts it back; a video VAE (no diffusers ``vae.Decoder``) is not touched."""
    from shardgen.speed.techniques import AccelOptions, Step

    vae = small_vae()
    pipe = type("Pipe", (), {"vae": vae})()
    assert fused_decode.apply(Step(pipe, None, torch.device("cpu"), AccelOptions(), AccelOptions())) == {}
    assert not any(isinstance(m, fused_decode.FusedGroupNorm) for m in vae.modules())
    keys = list(vae.state_dict())
    fused_decode.install(vae)
    assert list(vae.state_dict()) == keys  # the same parameters under the same names
    off = AccelOptions(fused_decode=False)
    assert fused_decode.apply(Step(pipe, None, torch.device("cuda"), AccelOptions(), off)) == {"fused_decode": 0}
    assert not any(isinstance(m, fused_decode.FusedGroupNorm) for m in vae.modules())
    assert vae.decoder.conv_in.weight.is_contiguous()
    assert fused_decode.install(torch.nn.Module()) == 0 and not fused_decode.uninstall(torch.nn.Module())


def test_a_norm_the_kernel_cannot_take_runs_torch_ops_on_the_same_weights():
    """Channels-first input, a channel count that is not a power of two, a CPU tensor: torch's GroupNorm + SiLU,
    the same numbers as the module it wraps."""
    norm = torch.nn.GroupNorm(4, 12)
    x = torch.randn(2, 12, 5, 5)
    want = torch.nn.functional.silu(norm(x))
    norm.__class__, norm.silu = fused_decode.FusedGroupNorm, True
    assert not fused_decode.kernel_takes(x, norm)
    with torch.no_grad():
        assert torch.equal(norm(x), want)


def test_a_causal_video_vae_decodes_a_frame_with_2d_convolutions_and_the_same_images():
    """Qwen-Image's VAE (an image: one latent frame) and Wan's (a video: its first frame without a cache, the later
    ones with one): every causal 3-D convolution routed, the decoded images those of the 3-D convolutions to float32
    rounding, and uninstall gives back the very same bytes."""
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

    shape = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
                 temperal_downsample=[False, True])
    torch.manual_seed(0)
    for cls, frames in ((AutoencoderKLQwenImage, 1), (AutoencoderKLWan, 3)):
        vae = cls(**shape).eval()
        z = torch.randn(2, 4, frames, 8, 6, generator=torch.Generator().manual_seed(1))
        calls = []
        with torch.no_grad():
            want = vae.decode(z).sample
            assert fused_decode.install(vae) == len(fused_decode.causal_convs(vae)) > 10
            original = torch.nn.functional.conv3d
            torch.nn.functional.conv3d = lambda *a, **k: calls.append(1) or original(*a, **k)
            try:
                got = vae.decode(z).sample
            finally:
                torch.nn.functional.conv3d = original
            assert fused_decode.uninstall(vae)
            back = vae.decode(z).sample
        assert got.shape == want.shape and (got - want).abs().max() < 1e-5, cls.__name__
        assert torch.equal(back, want)
        # an image runs no 3-D convolution at all; a video's later frames (cached) still do
        assert (len(calls) == 0) == (frames == 1), (cls.__name__, len(calls))
