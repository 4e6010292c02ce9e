"""fp8 on a CUDA GPU: the Triton row quantisation gives the torch ops' float8 values and scales, the eager layer
(bias in the GEMM's epilogue) the torch path's output, and converting frees each bf16 layer as it goes; the 8-bit
attention kernels stay within their bounds; every fp8 path of each model makes every sample within its bound."""

from __future__ import annotations

import pytest
import torch

from shardgen.speed import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def run_job(cfg):
    """``jobs.generate.run(cfg)``; a job that raises fails the test with its one-line error, its traceback dropped: the
    frames it holds keep the job's pipeline on the GPU, and the next tests of this process (a model each) would find
    an 80 GB card full and fail its memory check instead of testing their own path. Each job's pipeline is collected
    once it ends, so the next job's memory check sees its memory free."""
    import gc

    from jobs.generate import run

    try:
        return run(cfg)
    except Exception as e:  # noqa: BLE001 - reported below, without the frames
        message = f"{type(e).__name__}: {e}"
    finally:  # a finished job's pipeline too: reference cycles keep it (Qwen-Image's: 54 GiB) until a collection
        gc.collect()
        torch.cuda.empty_cache()
    pytest.fail(message, pytrace=False)


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


@pytest.mark.parametrize("rows, cols", [(4608 * 2, 12288), (77, 12288), (3, 1040)])
def test_triton_gelu_quantisation_matches_gelu_then_quantise(rows, cols):
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(torch.bfloat16)
    q, s = fp8.quantize_rows(h, gelu=True)
    q_ref, s_ref = fp8.quantize_rows_reference(torch.nn.functional.gelu(h, approximate="tanh"))
    assert torch.allclose(s, s_ref, rtol=1e-2)  # a row's maximum one bf16 step apart at most
    differ = ((q.float() * s) - (q_ref.float() * s_ref)).abs() > 0.07 * (s_ref * fp8.FP8_MAX)
    assert differ.sum().item() <= rows * cols * 1e-4, f"{differ.sum().item()} values differ by more than a step"
    rows_in = fp8.gelu_rows(h.reshape(2, rows // 2, cols) if rows % 2 == 0 else h.unsqueeze(0))
    assert isinstance(rows_in, fp8.Fp8Rows) and torch.equal(rows_in.data.reshape(q.shape).float(), q.float())


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``Flux2SwiGLU`` in bf16."""
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


@pytest.mark.parametrize("model, tokens, mlp_range", [("flux_dev", 4608, 4.0), ("flux_dev", 211, 0.05),
                                                      ("flux2_dev", 4608, 4.0), ("flux2_dev", 211, 0.05)])
def test_the_single_block_s_proj_out_input_is_quantised_in_one_pass(model, tokens, mlp_range):
    """``joined_rows`` at the single blocks' widths (FLUX.1-dev: attention 3072 beside the GELU of 12288; FLUX.2-dev:
    6144 beside the SwiGLU of a 36864-wide slice of the fused projection), whichever part holds a row's maximum,
    against the torch ops' quantisation of the concatenation; the float8 layer over it against bf16's output
    projection of the concatenation."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    dim, hidden = (3072, 12288) if model == "flux_dev" else (6144, 18432)
    attn = torch.randn(2, tokens, dim, device="cuda", generator=g).to(torch.bfloat16)
    if model == "flux_dev":
        mlp = (torch.randn(2, tokens, hidden, device="cuda", generator=g) * mlp_range).to(torch.bfloat16)
        joined = torch.cat([attn, torch.nn.functional.gelu(mlp, approximate="tanh")], -1)
        rows = fp8.joined_rows(attn, mlp, "gelu")
    else:  # the SwiGLU's input read where it lies in the fused q, k, v and MLP projection
        proj = (torch.randn(2, tokens, 3 * dim + 2 * hidden, device="cuda", generator=g) * mlp_range).to(torch.bfloat16)
        joined = torch.cat([attn, _swiglu(proj[..., 3 * dim:])], -1)
        rows = fp8.joined_rows(attn, proj[..., 3 * dim:], "swiglu")
    q_ref, s_ref = fp8.quantize_rows_reference(joined.reshape(-1, dim + hidden))
    assert isinstance(rows, fp8.Fp8Rows) and rows.shape == (2, tokens, dim + hidden)
    assert torch.allclose(rows.scale, s_ref, rtol=1e-2)  # a row's maximum one bf16 step apart at most
    off = ((rows.data.float() * rows.scale) - (q_ref.float() * s_ref)).abs() > 0.07 * (s_ref * fp8.FP8_MAX)
    assert off.sum().item() <= q_ref.numel() * 1e-4, f"{off.sum().item()} values differ by more than a step"
    lin = torch.nn.Linear(dim + hidden, dim, device="cuda", dtype=torch.bfloat16)
    ref = lin(joined).float()
    out = fp8.Float8Linear(lin)(rows).float()
    assert out.shape == ref.shape and ((out - ref).norm() / ref.norm()).item() < 0.05


@pytest.mark.parametrize("chunk, warps", [(1024, 4), (2048, 8), (4096, 2)])
def test_the_joined_rows_read_twice_in_chunks_are_the_bytes_of_the_row_held_whole(monkeypatch, chunk, warps):
    """Each row read twice, in chunks (``fp8.READ_TWICE_ROW_BYTES``; FLUX.1-dev's single blocks by default) at
    FLUX.1-dev's and FLUX.2-dev's single-block and feed-forward widths: the same float8 bytes and scales as the row
    held whole in registers."""
    g = torch.Generator(device="cuda").manual_seed(chunk)
    attn1, mlp = (torch.randn(2, 300, n, device="cuda", generator=g).to(torch.bfloat16) for n in (3072, 12288))
    attn2 = torch.randn(2, 300, 6144, device="cuda", generator=g).to(torch.bfloat16)
    proj = (torch.randn(2, 300, 3 * 6144 + 2 * 18432, device="cuda", generator=g) * 3).to(torch.bfloat16)
    cases = [(attn1, mlp, "gelu"), (attn2, proj[..., 3 * 6144:], "swiglu"), (None, proj[..., 3 * 6144:], "swiglu")]
    monkeypatch.setattr(fp8, "READ_TWICE_ROW_BYTES", 0)
    whole = [fp8.joined_rows(*case) for case in cases]
    monkeypatch.setattr(fp8, "READ_TWICE_ROW_BYTES", 1 << 20)
    monkeypatch.setattr(fp8, "READ_TWICE_CHUNK", chunk)
    monkeypatch.setattr(fp8, "READ_TWICE_WARPS", warps)
    for case, once in zip(cases, whole):
        twice = fp8.joined_rows(*case)
        assert torch.equal(twice.data.view(torch.uint8), once.data.view(torch.uint8))
        assert torch.equal(twice.scale, once.scale)


def test_flux2_s_feed_forward_takes_its_swiglu_as_float8_rows():
    """FLUX.2-dev's feed-forward down-projection input (the SwiGLU of 36864 columns, 18432 wide: two register
    chunks) quantised in the SwiGLU's pass: the float8 rows the torch ops make of the bf16 SwiGLU."""
    g = torch.Generator(device="cuda").manual_seed(5)
    h = (torch.randn(2, 4096, 36864, device="cuda", generator=g) * 2).to(torch.bfloat16)
    rows = fp8.joined_rows(None, h, "swiglu")
    q_ref, s_ref = fp8.quantize_rows_reference(_swiglu(h).reshape(-1, 18432))
    assert isinstance(rows, fp8.Fp8Rows) and rows.shape == (2, 4096, 18432)
    assert torch.allclose(rows.scale, s_ref, rtol=1e-2)
    off = ((rows.data.float() * rows.scale) - (q_ref.float() * s_ref)).abs() > 0.07 * (s_ref * fp8.FP8_MAX)
    assert off.sum().item() <= q_ref.numel() * 1e-4, f"{off.sum().item()} values differ by more than a step"


def test_triton_row_quantisation_reads_an_attention_output_s_halves_in_place():
    """The image and text halves of a joint attention output (strided views) quantised where they are: the bytes of
    their contiguous copies' quantisation."""
    g = torch.Generator(device="cuda").manual_seed(2)
    joint = (torch.randn(4, 4608, 3072, device="cuda", generator=g) * 3).to(torch.bfloat16)
    for view in (joint[:, 512:], joint[:, :512]):
        q, s = fp8.quantize_rows(view)
        q_ref, s_ref = fp8.quantize_rows(view.contiguous().reshape(-1, 3072))
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("tokens", [4608, 211])
def test_the_norm_pass_writes_the_float8_rows_in_place_of_its_bf16_output(tokens):
    """``ln_modulate_for`` with float8 readers: the LayerNorm + modulation pass quantises its rows itself, on the
    scales ``quantize_rows`` finds for its bf16 output and with its float8 values but for rare roundings (H100:
    under 1e-4 of the values at 4608 tokens differed, by one or two e4m3 steps; none at 211)."""
    from shardgen.speed import fused_kernels

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(4, tokens, 3072, device="cuda", generator=g) * 2 + 1).to(torch.bfloat16)
    shift, scale = (torch.randn(4, 1, 3072, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    layer = fp8.Float8Linear(torch.nn.Linear(3072, 64, device="cuda", dtype=torch.bfloat16))
    rows = fused_kernels.ln_modulate_for([layer], x, shift, scale, 1e-6)
    q_ref, s_ref = fp8.quantize_rows(fused_kernels.ln_modulate(x, shift, scale, 1e-6).reshape(-1, 3072))
    assert isinstance(rows, fp8.Fp8Rows) and rows.shape == (4, tokens, 3072)
    assert torch.equal(rows.scale, s_ref)
    assert (rows.data.float() != q_ref.float()).float().mean().item() < 1e-4
    ref = q_ref.float() * s_ref
    assert ((rows.data.float() * rows.scale - ref).norm() / ref.norm()).item() < 3e-3


def test_fused_single_block_output_projection_takes_its_parts_on_the_gpu():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3072 + 12288, 3072, device="cuda", dtype=torch.bfloat16)
    attn, mlp = (torch.randn(2, 4608, 3072, device="cuda", dtype=torch.bfloat16),
                 torch.randn(2, 4608, 12288, device="cuda", dtype=torch.bfloat16) * 4)
    ref = lin(torch.cat([attn, mlp], -1)).float()
    q = fp8.Float8Linear(lin)
    out = q.forward_parts([attn, fp8.gelu_rows(mlp)]).float()
    ref_gelu = lin(torch.cat([attn, torch.nn.functional.gelu(mlp, approximate="tanh")], -1)).float()
    assert out.shape == ref.shape
    assert (out - ref_gelu).norm() / ref_gelu.norm() < 0.05


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


@pytest.mark.parametrize("tokens", [37, 211, 512])
def test_a_float8_linear_takes_any_token_count(tokens):
    """Qwen-Image's text stream has the prompt's token count as rows; ``_scaled_mm`` is specified for sizes divisible
    by 16."""
    torch.manual_seed(tokens)
    lin = torch.nn.Linear(3072, 3072, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, tokens, 3072, device="cuda", dtype=torch.bfloat16)
    ref = lin(x).float()
    out = fp8.Float8Linear(lin)(x)
    assert out.shape == (3, tokens, 3072)
    assert (out.float() - ref).norm() / ref.norm() < 0.05


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
    layer = 8192 * 8192 * 2
    # never a second whole copy (1 GiB here): one layer's temporaries at most (its float8 copy, a float32 slice, the
    # slice's absolute values and its float8 rounding: 320 MiB measured on an H200)
    assert peak - before < 3 * layer


@pytest.mark.parametrize("heads, tokens, dim", [(24, 4608, 128), (48, 4608, 128), (24, 4096 + 77, 64)])
def test_sage_attention_is_close_to_torchs_kernel(heads, tokens, dim):
    from shardgen.speed import sage

    if sage.unavailable_reason("cuda"):
        pytest.skip(sage.unavailable_reason("cuda"))
    g = torch.Generator(device="cuda").manual_seed(tokens)
    q, k, v = (torch.randn(2, heads, tokens, dim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    k = k + 3.0  # keys with a common offset: what the smoothing takes out
    keys = k.clone()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
    with sage.context():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
    assert torch.equal(k, keys)
    assert ((out - ref).norm() / ref.norm()).item() < 0.05  # INT8 QK, fp16 PV


# each 8-bit kernel's bound against exact attention on these inputs: shardgen's float8 kernel does Q K^T in INT8,
# FA3's in e4m3 (docs/lossy.md)
KERNEL_VS_EXACT = {"fp8": 0.06, "fa3_fp8": 0.07}
# with a single key the output is that key's value row, as each kernel stores it: exact for fp8 (a scale per
# channel fits a lone row), e4m3's rounding (~2.5% on an H100) for fa3_fp8 (one scale per head)
ONE_KEY_VS_EXACT = {"fp8": 0.01, "fa3_fp8": 0.04}


@pytest.mark.parametrize("batch, heads, q_tokens, k_tokens, dim", [
    (2, 24, 4096 + 512, 4096 + 512, 128),  # FLUX.1-dev's joint attention: whole tiles
    (1, 3, 4096 + 211, 4096 + 211, 128),  # Qwen-Image's text length: the last tile part-filled
    (2, 5, 1000, 77, 64),  # cross-attention to 77 text tokens, head size 64
    (1, 2, 1, 1, 128),  # a single token
])
@pytest.mark.parametrize("kernel", sorted(KERNEL_VS_EXACT))
def test_8bit_attention_kernel_matches_its_reference(kernel, batch, heads, q_tokens, k_tokens, dim):
    """shardgen's float8 kernel (sdpa_backend=fp8) and FA3's (fa3_fp8) against their arithmetic in torch ops (each
    module's ``reference``), and both against exact attention; inputs in the processors' (batch, tokens, heads, dim)
    memory as well as SDPA's."""
    from shardgen.speed import sdpa

    module = sdpa.eight_bit_kernel(kernel)
    if why := module.unavailable_reason("cuda"):
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(q_tokens)
    q = torch.randn(batch, q_tokens, heads, dim, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(batch, heads, k_tokens, dim, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    k = k + 3.0 * torch.randn(1, 1, 1, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    keys = k.clone()
    assert module.takes(q, k, v)
    out = module.attention(q, k, v)
    assert torch.equal(k, keys) and out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # the processors' layout: their transpose and flatten copy nothing
    exact = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = lambda x, ref: ((x.float() - ref.float()).norm() / ref.float().norm()).item()  # noqa: E731
    # a kernel scales each tile's probabilities by the running row maximum, the reference by the final one: their
    # float8 roundings differ (2.5% at FLUX's shape on an H100 for fp8), so each is held to exact attention as well
    reference = module.reference(q, k, v)
    print(f"{kernel} vs reference {err(out, reference):.4f}, vs exact {err(out, exact):.4f}, "
          f"reference vs exact {err(reference, exact):.4f}")
    assert err(out, reference) < 0.04
    assert err(out, exact) < (KERNEL_VS_EXACT[kernel] if k_tokens > 1 else ONE_KEY_VS_EXACT[kernel])
    with module.context():
        routed = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(routed, out)


def test_fa3_triton_quantisation_matches_the_torch_ops():
    """fa3_fp8's Triton pass (CUDA) against the same quantisation in torch ops (its CPU route), keys smoothed or not,
    from the processors' memory layout. Triton's float32 division is within 2 ulp, so a rare value may round the
    other way."""
    from shardgen.speed import fa3_fp8

    if why := fa3_fp8.unavailable_reason("cuda"):
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 4096 + 211, 3, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    for smooth in (False, True):
        y, s = fa3_fp8.quantise(x, smooth)
        ref_y, ref_s = fa3_fp8.quantise(x.cpu(), smooth)
        assert y.shape == (2, 4096 + 211, 3, 128) and y.is_contiguous()
        assert torch.allclose(s.cpu(), ref_s) and (y.cpu().float() != ref_y.float()).float().mean().item() < 1e-3


@pytest.mark.parametrize("heads, parts", [(24, (512, 4096)), (3, (37, 211))])
def test_fa3_attention_from_the_projections_matches_rms_rope_then_fa3(heads, parts):
    """fa3_fp8 straight from a fused processor's projections (``rms_rope_attention``: the queries RMSNorm-ed, RoPE-d
    and quantised on their static scale in one Triton pass, the keys and values in two, statistics then float8) at
    FLUX.1-dev's shape and at part-filled tiles: the queries' float8 values are ``rms_rope``'s output on that scale,
    the keys' its output less its mean (over each 9th token of each part at FLUX.1-dev's shape) on theirs, the
    values' what ``quantise`` makes of the joined values, but for
    rare one-step roundings; the output is as far from exact attention as ``attention``'s on the same inputs."""
    from shardgen.speed import fa3_fp8
    from shardgen.speed.fused_kernels import rms_rope

    if why := fa3_fp8.unavailable_reason("cuda"):
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(0)
    dim = 128
    proj = [(torch.randn(2, n, 3 * heads * dim, device="cuda", generator=g) * 2 + 0.5).bfloat16() for n in parts]
    qs, ks, vs = ([p[..., i * heads * dim:(i + 1) * heads * dim].unflatten(-1, (heads, dim)) for p in proj]
                  for i in range(3))
    wq, wk = ([(torch.rand(dim, device="cuda", generator=g) + 0.5).bfloat16() for _ in parts] for _ in range(2))
    ang = torch.rand(sum(parts), dim // 2, device="cuda", generator=g) * 6
    cos, sin = ang.cos().repeat_interleave(2, -1).contiguous(), ang.sin().repeat_interleave(2, -1).contiguous()
    assert fa3_fp8.takes_parts(qs, ks, vs, cos)
    q8, scale = fa3_fp8.quantise_queries(qs, wq, cos, sin, 1e-6)
    query = rms_rope(qs, wq, cos, sin, 1e-6)
    ref = (query.float() / scale[:, :, None, None]).to(torch.float8_e4m3fn).transpose(1, 2)
    assert q8.shape == ref.shape and (q8.float() != ref.float()).float().mean().item() < 1e-3
    key, value = rms_rope(ks, wk, cos, sin, 1e-6), torch.cat(vs, 1).transpose(1, 2)
    k8, k_scale = fa3_fp8.quantise_keys(ks, wk, cos, sin, 1e-6)  # the keys' two passes: mean, then float8
    read = fa3_fp8.key_mean_tokens(list(parts), fa3_fp8.key_mean_every(sum(parts))).cuda()  # the mean's tokens
    smoothed = key.float() - key.float().index_select(2, read).mean(dim=2, keepdim=True)
    k_ref = (smoothed / k_scale[:, :, None, None]).to(torch.float8_e4m3fn).transpose(1, 2)
    v8, v_scale = fa3_fp8.quantise_values(vs, cos)  # the values' two passes: largest magnitude, then float8
    v_ref, v_ref_scale = fa3_fp8.quantise(value)
    assert torch.equal(k_scale, fa3_fp8.key_scale(wk, 2, heads, dim)) and torch.allclose(v_scale, v_ref_scale)
    for x8, ref in ((k8, k_ref), (v8, v_ref)):
        assert x8.shape == ref.shape and (x8.float() != ref.float()).float().mean().item() < 1e-3
    out = fa3_fp8.rms_rope_attention(qs, ks, vs, wq, wk, cos, sin, 1e-6).transpose(1, 2)
    old = fa3_fp8.attention(query, key, value)
    one = (slice(0, 1), slice(0, 2))  # exact attention over the first sample's first two heads (bounded memory)
    exact = torch.nn.functional.scaled_dot_product_attention(query[one].float(), key[one].float(), value[one].float())
    err = lambda x, ref: ((x.float() - ref.float()).norm() / ref.float().norm()).item()  # noqa: E731
    print(f"from the projections vs exact {err(out[one], exact):.4f}, attention vs exact {err(old[one], exact):.4f}")
    assert err(out[one], exact) < KERNEL_VS_EXACT["fa3_fp8"] and err(out[one], exact) < 1.2 * err(old[one], exact)


# the worst calibration PSNR each model's fp8 reaches on its dummy (random) weights at 1024x1024 (measured on an
# H200, docs/performance.md, minus a margin): numerical error compounded by random weights, not image quality
FP8_FLOOR_DB = {"flux_dev": 28.0, "flux2_dev": 12.0, "qwen_image": 20.0}


@pytest.mark.parametrize("model", sorted(FP8_FLOOR_DB))
def test_fp8_job_with_its_calibration_on_each_model(tmp_path, model):
    import gc
    import json

    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.tools.verify import verify_run
    from tests.conftest import compose_cfg

    try:
        r = run_job(compose_cfg(f"run_dir={tmp_path / 'run'}", f"model={model}", "model.weights=dummy", "steps=4",
                                "prompts.limit=6", "batch_size=2", "progress=false", "fp8=true", "calibrate_samples=2",
                                f"calibrate_min_psnr={FP8_FLOOR_DB[model]}",
                                "strategy=auto"))  # FLUX.2-dev on an 80 GB card: device_map, staged
        assert (r.ok, r.failed, r.complete) == (6, 0, True)
        assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok
        record = json.loads((tmp_path / "run" / "calibration.json").read_text())
        assert record["passed"] and record["lossy"] == {"fp8": True}
        print(model, "calibration PSNR worst", record["psnr_db"]["worst"], "SSIM worst", record["ssim"]["worst"])
    finally:
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("model", sorted(FP8_FLOOR_DB))
def test_speed_fast_takes_the_8bit_attention_that_pays_on_each_model(tmp_path, model, monkeypatch):
    """``speed=fast``: fp8, and FA3's float8 attention where it pays (FLUX.1, FLUX.2) and this GPU runs it, pinned in
    attention.json; Qwen-Image keeps lossless attention. The calibration holds the model's bound, and the run commits
    its lossy samples (the first batch's rows) instead of making them again."""
    import gc
    import json

    from shardgen.run import shardrun
    from shardgen.speed import fa3_fp8
    from tests.conftest import compose_cfg

    kernel = "fa3_fp8" if model != "qwen_image" and fa3_fp8.unavailable_reason(torch.device("cuda")) is None \
        else "auto"
    made_by_the_run, real = [], shardrun.generate_batch

    def counted(pipe, s, rows, *args):
        made_by_the_run.extend(r.index for r in rows)
        return real(pipe, s, rows, *args)

    monkeypatch.setattr(shardrun, "generate_batch", counted)
    try:
        r = run_job(compose_cfg(f"run_dir={tmp_path / 'run'}", f"model={model}", "model.weights=dummy", "steps=4",
                                "prompts.limit=6", "batch_size=2", "progress=false", "speed=fast",
                                "calibrate_samples=2", f"calibrate_min_psnr={FP8_FLOOR_DB[model]}", "strategy=auto"))
        assert (r.ok, r.failed, r.complete) == (6, 0, True)
        assert json.loads((tmp_path / "run" / "attention.json").read_text())["sdpa_backend"] == kernel
        record = json.loads((tmp_path / "run" / "calibration.json").read_text())
        assert record["passed"] and record["lossy"] == {"fp8": True, **({"sdpa": kernel} if kernel != "auto" else {})}
        assert sorted(made_by_the_run) == [2, 3, 4, 5]  # rows 0 and 1: the calibration's lossy batch
        print(model, "speed=fast attention", kernel, "calibration PSNR worst", record["psnr_db"]["worst"])
    finally:
        gc.collect()
        torch.cuda.empty_cache()


# every fp8 path a run can take, per model, against the lossless run of the same prompts (256x256, 2 steps, dummy
# weights: numerical error, not image quality): the worst sample's PSNR must reach the model's bound
FP8_PATH_FLOOR_DB = {"flux_dev": 24.0, "flux2_dev": 10.0, "qwen_image": 18.0}
FP8_WAYS = {
    "eager": ("fp8=true", "compile=false"),
    "ungraphed": ("fp8=true", "compile=false", "cuda_graphs=false"),
    "compiled": ("fp8=true", "compile=true"),
    "sage": ("fp8=true", "compile=false", "sdpa_backend=sage"),
    "sage-compiled": ("fp8=true", "compile=true", "sdpa_backend=sage"),
    "attention8": ("fp8=true", "compile=false", "sdpa_backend=fp8"),
    "attention8-compiled": ("fp8=true", "compile=true", "sdpa_backend=fp8"),
    "fa3": ("fp8=true", "compile=false", "sdpa_backend=fa3_fp8"),
    "fa3-compiled": ("fp8=true", "compile=true", "sdpa_backend=fa3_fp8"),
}


@pytest.fixture(scope="module")
def lossless_runs(tmp_path_factory):
    """{model: the lossless run of the matrix's prompts}, each made once."""
    return {"dir": tmp_path_factory.mktemp("lossless"), "made": set()}


@pytest.mark.parametrize("way", list(FP8_WAYS))
@pytest.mark.parametrize("model", sorted(FP8_PATH_FLOOR_DB))
def test_every_fp8_path_makes_every_sample_within_its_bound(tmp_path, lossless_runs, model, way):
    import gc

    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.quality.compare import compare_runs
    from shardgen.tools.verify import verify_run
    from tests.conftest import compose_cfg

    if way.startswith(("sage", "fa3")):
        from shardgen.speed import fa3_fp8, sage

        if why := (sage if way.startswith("sage") else fa3_fp8).unavailable_reason("cuda"):
            pytest.skip(why)
    common = (f"model={model}", "model.weights=dummy", "height=256", "width=256", "steps=2", "prompts.limit=6",
              "batch_size=2", "progress=false", "strategy=auto")  # FLUX.2-dev on an 80 GB card: device_map, staged
    reference = lossless_runs["dir"] / model
    try:
        if model not in lossless_runs["made"]:
            assert run_job(compose_cfg(f"run_dir={reference}", *common, "compile=false")).ok == 6
            lossless_runs["made"].add(model)
        r = run_job(compose_cfg(f"run_dir={tmp_path / 'run'}", *common, *FP8_WAYS[way]))
        assert (r.ok, r.failed, r.complete) == (6, 0, True)
        assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok
        s = compare_runs(RunDir(tmp_path / "run"), RunDir(reference)).summary()
        print(model, way, "PSNR median/worst", s["psnr_db"]["median"], s["psnr_db"]["worst"],
              "SSIM worst", s["ssim"]["worst"])
        assert s["compared"] == 6 and s["psnr_db"]["worst"] >= FP8_PATH_FLOOR_DB[model]
    finally:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_under_tensor_parallel_makes_what_one_gpu_s_fp8_makes(tmp_path, compiled):
    """strategy=tp tp_degree=2 fp8=true over NCCL: each rank's float8 shard, a row shard's products summed over the
    pair; against one GPU's fp8 run of the same prompts (its own float8 rounding of whole rows differs, so a bound,
    not the bytes)."""
    from jobs.generate import run
    from shardgen.quality.compare import compare_runs
    from shardgen.dataio.rundir.layout import RunDir
    from tests.conftest import compose_cfg

    common = ("model=flux_dev", "model.weights=dummy", "height=256", "width=256", "steps=2", "prompts.limit=6",
              "batch_size=2", "progress=false", "fp8=true", f"compile={str(compiled).lower()}")
    one = tmp_path / "one"
    assert run(compose_cfg(f"run_dir={one}", *common)).ok == 6
    r = run(compose_cfg(f"run_dir={tmp_path / 'tp'}", *common, "strategy=tp", "tp_degree=2", "launcher=local",
                        "launcher.nprocs=2"))
    assert (r.ok, r.complete) == (6, True)
    s = compare_runs(RunDir(tmp_path / "tp"), RunDir(one)).summary()
    print("tp2 fp8 vs one GPU fp8: PSNR median/worst", s["psnr_db"]["median"], s["psnr_db"]["worst"])
    assert s["compared"] == 6 and s["psnr_db"]["worst"] >= FP8_PATH_FLOOR_DB["flux_dev"]
