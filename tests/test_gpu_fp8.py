"""fp8 on a CUDA GPU: the Triton row quantisation gives the torch ops' float8 values and scales, the eager layer
(bias in the GEMM's epilogue) the torch path's output, and converting frees each bf16 layer as it goes."""

from __future__ import annotations

import pytest
import torch

from shardgen.speed import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("rows, cols", [(1, 64), (4608 * 2, 3072), (77, 15360), (300, 18432), (5, 1040)])
def test_triton_row_quantisation_matches_the_torch_ops(rows, cols):
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = torch.randn(rows, cols, device="cuda", generator=g, dtype=torch.float32)
    x = (x * torch.logspace(-3, 3, rows, device="cuda").unsqueeze(1)).to(torch.bfloat16)  # rows of every range
    x[0, : cols // 2] = 0  # a row half zero
    q, s = fp8.quantize_rows(x)
    q_ref, s_ref = fp8.quantize_rows_reference(x)
    assert torch.equal(s, s_ref)
    differ = (q.float() != q_ref.float()).sum().item()
    assert differ <= rows * cols * 1e-5, f"{differ} float8 values differ"  # a last-bit tie at most


def test_eager_float8_linear_matches_the_torch_path_with_bias_fused():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3072, 12288, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 4608, 3072, device="cuda", dtype=torch.bfloat16)
    ref = lin(x).float()
    q = fp8.Float8Linear(lin)
    out = q(x)
    xq, scale = fp8.quantize_rows_reference(x.reshape(-1, 3072))
    torch_path = (torch._scaled_mm(xq, q.weight_fp8.t(), scale_a=scale, scale_b=q.weight_scale,
                                   out_dtype=torch.bfloat16) + q.bias).reshape(out.shape)
    assert out.dtype == torch.bfloat16
    assert (out.float() - torch_path.float()).abs().max() <= 0.02 * torch_path.float().abs().max()
    assert (out.float() - ref).norm() / ref.norm() < 0.05  # e4m3 against bf16


def test_converting_frees_each_bf16_layer_as_it_goes():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8192, 8192, device="cuda", dtype=torch.bfloat16)

    class Toy(torch.nn.Module):
        _repeated_blocks = ["Block"]

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(8)])  # 1 GiB of bf16 weights

    toy = Toy()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert fp8.enable_fp8(toy) == 8
    torch.cuda.synchronize()
    after, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    assert after < 0.55 * before  # float8 weights: half the bf16 bytes
    assert peak - before < 0.3 * 2 ** 30  # never a second whole copy: one layer's temporaries at most
