"""fp8=true's float8 layers on the CPU (torch's ops; the Triton kernels are checked on a GPU in test_gpu_fp8.py):
an input read by several layers is quantised once, an input already quantised is taken as it is, and a layer over a
concatenation is computed from its parts."""

from __future__ import annotations

import copy

import pytest
import torch

from shardgen.speed import fp8


def linears(cols=64, out=32, seed=0, bias=True):
    """(a float32 nn.Linear, its fp8 layer)."""
    torch.manual_seed(seed)
    full = torch.nn.Linear(cols, out, bias=bias)
    return full, fp8.Float8Linear(copy.deepcopy(full))


def layer(cols=64, out=32, seed=0, bias=True):
    return linears(cols, out, seed, bias)[1]


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def test_layers_reading_one_input_quantise_it_once(monkeypatch):
    calls = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda x2, gelu=False: calls.append(x2.shape) or real(x2, gelu))
    q, k, v = layer(seed=1), layer(seed=2), layer(seed=3)
    x = torch.randn(2, 5, 64)
    outs = [m(x) for m in (q, k, v)]
    assert len(calls) == 1
    fp8._LAST.clear()
    assert all(torch.equal(a, m(x.clone())) for a, m in zip(outs, (q, k, v)))  # the same as each on its own
    assert len(calls) == 4


def test_an_input_changed_in_place_is_quantised_again():
    a = layer(seed=1)
    full, b = linears(seed=2)
    x = torch.randn(3, 64)
    a(x)
    x.mul_(100)  # same tensor, new values
    assert torch.equal(b(x), b(x.clone()))
    assert rel(b(x), full(x)) < 0.1


def test_a_quantised_input_is_taken_as_it_is():
    lin = layer()
    x = torch.randn(2, 7, 64)
    data, scale = fp8.quantize_rows(x.reshape(-1, 64))
    rows = fp8.Fp8Rows(data, scale, (2, 7), x.dtype)
    assert torch.equal(lin(rows), lin(x))
    assert lin(rows).shape == (2, 7, 32)


@pytest.mark.parametrize("tokens", [7, 16, 37])
def test_the_gemm_gets_whole_sixteens_of_rows_and_the_layer_its_own_rows_back(tokens, monkeypatch):
    """``_scaled_mm`` is specified for sizes divisible by 16; a layer's rows are a prompt's token count times the
    batch."""
    lin = layer()
    x = torch.randn(2, tokens, 64)
    data, scale = fp8.quantize_rows(x.reshape(-1, 64))
    direct = torch._scaled_mm(data, lin.weight_fp8.t(), scale_a=scale, scale_b=lin.weight_scale,
                              out_dtype=torch.float32) + lin.bias
    seen, real = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, *args, **kw: seen.append(a.shape[0]) or real(a, *args, **kw))
    out = lin(x)
    assert out.shape == (2, tokens, 32) and seen == [-(-2 * tokens // 16) * 16]
    assert torch.equal(out, direct.reshape(2, tokens, 32))


def test_a_shape_the_float8_gemm_refuses_is_computed_from_the_float8_values(monkeypatch, caplog):
    """cuBLASLt's row-wise float8 kernels do not cover every shape: such a layer says so once and still computes."""
    lin = layer()
    x, x80 = torch.randn(2, 9, 64), torch.randn(5, 16, 64)
    expected, expected80 = lin(x), lin(x80)
    calls, real = [], torch._scaled_mm

    def refuses(a, *args, **kw):
        calls.append(a.shape[0])
        if a.shape[0] in (32, 80):
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic(`")
        return real(a, *args, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    monkeypatch.setattr(fp8, "_REFUSED", set())
    with caplog.at_level("WARNING", logger="shardgen.accel"):
        first, second = lin(x), lin(x)
    assert calls == [32]  # tried once; the second call goes straight to the dequantised product
    assert rel(first, expected) < 1e-5 and torch.equal(first, second)
    assert [r.getMessage() for r in caplog.records] == [
        "fp8: the float8 GEMM refused 32 rows x 64 -> 32 on this GPU (CUDA error: CUBLAS_STATUS_NOT_SUPPORTED); "
        "products of the shapes it refuses are computed from the dequantised float8 values instead (the same values, "
        "at bf16 speed)"]
    assert lin(torch.randn(4, 8, 64)).shape == (4, 8, 32) and calls == [32]  # 32 rows again: not tried again
    assert lin(torch.randn(3, 16, 64)).shape == (3, 16, 32) and calls == [32, 48]  # another shape is tried
    with caplog.at_level("WARNING", logger="shardgen.accel"):
        # 80 rows: refused too, computed, not said again
        assert rel(lin(x80), expected80) < 1e-5 and calls == [32, 48, 80] and len(caplog.records) == 1


def test_a_float8_layer_compiles_in_one_graph_at_any_token_count():
    """Compiled blocks trace the layer whole (the padding and the GEMM; no refused-shape try block in the graph)."""
    lin = layer()
    x = torch.randn(2, 9, 64)
    compiled = torch.compile(lin, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), lin(x))
    assert compiled(torch.randn(3, 16, 64)).shape == (3, 16, 32)


def test_qwen_image_s_modulation_layers_stay_bf16():
    """Qwen-Image's img_mod/txt_mod (SiLU then Linear, one row per sample) like FLUX's norm1.linear: not converted."""
    from diffusers import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    assert fp8.enable_fp8(transformer) == 12
    block = transformer.transformer_blocks[0]
    assert type(block.img_mod[1]) is torch.nn.Linear and type(block.txt_mod[1]) is torch.nn.Linear
    assert isinstance(block.attn.to_q, fp8.Float8Linear) and isinstance(block.img_mlp.net[2], fp8.Float8Linear)


def test_gelu_rows_off_cuda_is_the_gelu():
    h = torch.randn(4, 48)
    assert torch.equal(fp8.gelu_rows(h), torch.nn.functional.gelu(h, approximate="tanh"))


@pytest.mark.parametrize("bias", [True, False])
def test_a_layer_over_a_concatenation_from_its_parts(bias):
    full, lin = linears(cols=96, out=40, bias=bias)
    a, b = torch.randn(2, 6, 32), torch.randn(2, 6, 64) * 50  # parts of very different ranges
    joined = torch.cat([a, b], dim=-1)
    out = lin.forward_parts([a, b])
    assert out.shape == (2, 6, 40)
    expected = 0
    for part, start in ((a, 0), (b, 32)):  # each part quantised with its own row scales, its block of columns
        xq, scale = fp8.quantize_rows_reference(part.reshape(-1, part.shape[-1]))
        expected = expected + torch._scaled_mm(xq, lin.weight_fp8[:, start:start + part.shape[-1]].t(), scale_a=scale,
                                               scale_b=lin.weight_scale, out_dtype=torch.float32)
    if bias:
        expected = expected + lin.bias
    assert torch.allclose(out.reshape(-1, 40), expected, rtol=1e-5, atol=1e-5)
    assert rel(out, full(joined)) < 0.1 and rel(lin(joined), full(joined)) < 0.1


def test_parts_that_do_not_fill_the_layer_are_refused():
    with pytest.raises(ValueError, match="32 wide in all, the layer takes 64"):
        layer().forward_parts([torch.randn(2, 32)])


def test_the_shared_quantisation_does_not_keep_an_activation_alive():
    import gc
    import weakref

    lin = layer()
    x = torch.randn(4, 64)
    lin(x)
    rows = weakref.ref(fp8._LAST.rows[0])
    del x
    gc.collect()
    assert fp8._LAST.rows is None and rows() is None  # the float8 copy went with its activation


def test_the_bytes_counted_for_the_memory_plan_are_those_a_conversion_leaves():
    """``converted_bytes`` (what strategy=auto plans with) against the tiny FLUX transformer's parameters after
    ``enable_fp8`` converted it."""
    from diffusers import FluxTransformer2DModel

    from shardgen.families.flux.tiny import TRANSFORMER_CONFIG

    transformer = FluxTransformer2DModel(**TRANSFORMER_CONFIG).to(torch.bfloat16)
    planned = fp8.converted_bytes(transformer, 2)
    before = sum(p.numel() * p.element_size() for p in transformer.parameters())
    assert fp8.enable_fp8(transformer) > 0
    after = sum(t.numel() * t.element_size() for m in transformer.modules()
                for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
    assert planned == after < before


_INTERPRETED_ROWS = '''
import torch
from shardgen.speed import fp8
fp8._kernel_ok = lambda x2: True  # CPU tensors, run by Triton's interpreter
g = torch.Generator().manual_seed(0)
joint = (torch.randn(2, 37, 96, generator=g) * 3).bfloat16()
for view in (joint[:, 11:], joint[:, :11], joint[1:, 5:30]):  # the image and text halves, a middle slice
    for gelu in (False, True):
        q, s = fp8.quantize_rows(view, gelu=gelu)
        q_ref, s_ref = fp8.quantize_rows(view.contiguous().reshape(-1, 96), gelu=gelu)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
# the LayerNorm + modulation pass writing float8 rows: the bytes of its bf16 output's row quantisation
from shardgen.speed import fused_kernels
fused_kernels.triton_ok = lambda *xs: True
layer = fp8.Float8Linear(torch.nn.Linear(96, 32).bfloat16())
x = (torch.randn(2, 37, 96, generator=g) * 2 + 1).bfloat16()
shift, scale = (torch.randn(2, 1, 96, generator=g).bfloat16() for _ in range(2))
rows = fused_kernels.ln_modulate_for([layer], x, shift, scale, 1e-6)
q_ref, s_ref = fp8.quantize_rows(fused_kernels.ln_modulate(x, shift, scale, 1e-6).reshape(-1, 96))
assert isinstance(rows, fp8.Fp8Rows) and rows.lead == (2, 37) and rows.shape == (2, 37, 96)
assert torch.equal(rows.scale, s_ref) and torch.equal(rows.data.view(torch.uint8), q_ref.view(torch.uint8))
print("ok")
'''


def test_the_row_quantisation_reads_a_slice_of_an_attention_output_where_it_is(tmp_path):
    """The Triton row quantisation (run by Triton's interpreter on the CPU) takes a (batch, tokens, cols) view, the
    text or image half of an attention output, and writes what it writes from that view's contiguous copy; the
    LayerNorm + modulation pass writes the float8 rows the row quantisation makes of its bf16 output."""
    from tests.test_fp8_attention import interpreted

    assert interpreted(_INTERPRETED_ROWS, tmp_path) == "ok"


_INTERPRETED_JOINED = '''
import torch
import torch.nn.functional as F
from shardgen.speed import fp8
fp8._kernel_ok = lambda x2: True  # CPU tensors, run by Triton's interpreter
fp8.READ_TWICE_ROW_BYTES = 0  # each row held whole in registers first
g = torch.Generator().manual_seed(1)


def swiglu(x):  # diffusers' Flux2SwiGLU in bf16: silu rounded, then the product rounded
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def check(rows, joined):
    q_ref, s_ref = fp8.quantize_rows_reference(joined.reshape(-1, joined.shape[-1]))
    assert isinstance(rows, fp8.Fp8Rows) and rows.shape == joined.shape and rows.data.shape == q_ref.shape
    # the interpreter truncates float32 to bf16 and float8 where the torch ops round: a row's maximum two bf16 steps
    # apart at most (the SwiGLU rounds twice), a tenth of the values a step or two apart; its float8 rounding also
    # drops a value that rounds up to a power of two to the power below (124.6 of 448 to 64, not 128): a value can
    # be off by a quarter of the row's range, the mean stays a step's fraction
    assert torch.allclose(rows.scale, s_ref, rtol=2 ** -6, atol=0)
    off = (rows.data.float() * rows.scale - q_ref.float() * s_ref).abs() / (s_ref * fp8.FP8_MAX)
    assert off.max() <= 0.3 and off.mean() < 0.005 and (rows.data.float() != q_ref.float()).float().mean() < 0.12


attn = (torch.randn(2, 37, 96, generator=g) * 0.5).bfloat16()
# the attention part's maximum the row's, one power-of-two block a part (128 + 256); then the activation's, past the
# lanes' limit: two blocks a part (64 + 32 + 128 + 32; a SwiGLU alone 128 + 32)
for mlp_range, fp8.REGISTER_COLS, alone_limit, chunked in ((0.1, 24576, 24576, False), (8.0, 320, 200, True)):
    mlp = (torch.randn(2, 37, 160, generator=g) * mlp_range).bfloat16()
    # FLUX.2: the SwiGLU's input a column slice of a wider projection, read where it is
    proj = (torch.randn(2, 37, 96 + 2 * 160, generator=g) * mlp_range).bfloat16()
    assert (fp8._joined_launch(96, 160)[1] > 0) == chunked
    check(fp8.joined_rows(attn, mlp, "gelu"), torch.cat([attn, F.gelu(mlp, approximate="tanh")], -1))
    check(fp8.joined_rows(attn, proj[..., 96:], "swiglu"), torch.cat([attn, swiglu(proj[..., 96:])], -1))
    fp8.REGISTER_COLS = alone_limit
    assert (fp8._joined_launch(0, 160)[3] > 0) == chunked
    check(fp8.joined_rows(None, proj[..., 96:], "swiglu"), swiglu(proj[..., 96:]))
fp8.REGISTER_COLS = 24576
# the row read twice in chunks (READ_TWICE_ROW_BYTES): the same bytes as the row held whole, also where the chunks do
# not divide a part; and a row past the registers' lanes is then taken, not left to the caller
once = [fp8.joined_rows(attn, mlp, "gelu"), fp8.joined_rows(attn, proj[..., 96:], "swiglu"),
        fp8.joined_rows(None, proj[..., 96:], "swiglu")]
fp8.READ_TWICE_ROW_BYTES, fp8.READ_TWICE_CHUNK = 1 << 20, 64
twice = [fp8.joined_rows(attn, mlp, "gelu"), fp8.joined_rows(attn, proj[..., 96:], "swiglu"),
         fp8.joined_rows(None, proj[..., 96:], "swiglu")]
for x, y in zip(once, twice):
    assert torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8)) and torch.equal(x.scale, y.scale)
fp8.REGISTER_COLS = 64
check(fp8.joined_rows(attn, mlp, "gelu"), torch.cat([attn, F.gelu(mlp, approximate="tanh")], -1))
print(fp8.joined_rows(attn, mlp.float(), "gelu"), fp8.joined_rows(attn, mlp[:, 1:], "gelu"),
      fp8.joined_rows(None, proj[..., 97:], "swiglu"), end=" ")
fp8.READ_TWICE_ROW_BYTES = 0
print(fp8.joined_rows(attn, mlp, "gelu"))
'''


def test_joined_rows_are_quantised_in_one_pass_with_the_activation(tmp_path):
    """``joined_rows`` (run by Triton's interpreter on the CPU): the float8 rows of the attention output beside
    the MLP's GELU (FLUX.1) or SwiGLU (FLUX.2), and of a SwiGLU alone, are those the torch ops make of the
    concatenation, whichever part holds the row's maximum, whether the row is held whole or read twice in chunks;
    parts it cannot take (float32, another token count, an odd SwiGLU input; a row past the registers when it is
    held whole) are left to the caller (None)."""
    from tests.test_fp8_attention import interpreted

    assert interpreted(_INTERPRETED_JOINED, tmp_path) == "None None None None"


def test_joined_rows_launch_whole_power_of_two_blocks_while_they_fit_the_registers():
    """FLUX.1's single blocks: one block a part (4096 + 16384 lanes for 3072 + 12288 columns), as an H100 timed it;
    FLUX.2's single blocks (6144 + 18432) and feed-forward SwiGLU (18432) past 24576 lanes: two blocks a part."""
    assert fp8._joined_launch(3072, 12288) == (4096, 0, 16384, 0, 16)
    assert fp8._joined_launch(6144, 18432) == (4096, 2048, 16384, 2048, 16)
    assert fp8._joined_launch(0, 18432) == (0, 0, 16384, 2048, 16)
    assert fp8._joined_launch(3072, 3072) == (4096, 0, 4096, 0, 8)
    assert fp8._joined_launch(6144, 36864) is None  # more than the registers hold: the parts one GEMM each


def test_the_concatenation_s_rows_are_left_to_the_parts_off_cuda():
    a, b = torch.randn(1, 4, 8).bfloat16(), torch.randn(1, 4, 16).bfloat16()
    assert fp8.joined_rows(a, b, "gelu") is None and fp8.joined_rows(None, b, "swiglu") is None


class _Launches:
    """Stands in for a Triton kernel: records which one ``joined_rows`` launched, and its warps."""

    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.seen.append((self.name, kwargs["num_warps"]))


def test_a_flux1_single_block_row_is_read_twice_and_flux2_s_wider_rows_are_held_whole(monkeypatch):
    """FLUX.1's single blocks' rows (3072 + 12288 columns, 30 KB of bf16) are read twice in chunks, the faster pass
    for them on an H100; FLUX.2's (6144 + a SwiGLU of 36864, 84 KB) and its feed-forward SwiGLU (72 KB) are held
    whole, where reading twice was a half slower."""
    seen: list = []
    monkeypatch.setattr(fp8, "_kernel_ok", lambda x2: True)
    monkeypatch.setattr(fp8, "_quantize_parts_kernel", _Launches("whole", seen), raising=False)
    monkeypatch.setattr(fp8, "_quantize_parts_chunked_kernel", _Launches("twice", seen), raising=False)
    bf16 = {"dtype": torch.bfloat16}
    assert fp8.joined_rows(torch.zeros(1, 2, 3072, **bf16), torch.zeros(1, 2, 12288, **bf16), "gelu").shape == (
        1, 2, 15360)
    fp8.joined_rows(torch.zeros(1, 2, 6144, **bf16), torch.zeros(1, 2, 36864, **bf16), "swiglu")
    fp8.joined_rows(None, torch.zeros(1, 2, 36864, **bf16), "swiglu")
    assert seen == [("twice", 8), ("whole", 16), ("whole", 16)]
