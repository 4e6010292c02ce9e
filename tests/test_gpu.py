"""On a CUDA GPU: the real FLUX.1-dev architecture (dummy weights) through the whole job, per strategy
that fits one GPU. Skipped, saying why, without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import verify_run
from jobs.generate import run
from tests.conftest import compose_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SMALL = ("model=flux_dev", "model.weights=dummy", "height=256", "width=256", "steps=2", "prompts.limit=4",
         "batch_size=2", "progress=false")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean dynamo state: compiled code, guards and recompile counts of an earlier
    test's model are not this one's (the Qwen recompile test failed after the FLUX tests in one process)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    from shardgen.speed import fa4

    fa4.restore()  # a test that chose FlashAttention-4 switched the process's flash kernel
    gc.collect()  # the earlier test's pipeline, then its cached GPU blocks: the next model's memory check sees them free
    torch.cuda.empty_cache()


@pytest.mark.parametrize("strategy", [("strategy=dp",), ("strategy=device_map", "strategy.gpus_per_replica=1"),
                                      ("strategy=auto",)])
def test_flux_dev_dummy_runs_on_one_gpu(tmp_path, strategy):
    r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", *SMALL, *strategy))
    assert (r.ok, r.failed, r.complete) == (4, 0, True)
    rep = verify_run(load_plan(RunDir(tmp_path / "run")))
    assert rep.ok, rep.defects


def test_device_map_streams_an_encoder_that_does_not_fit_and_makes_the_same_pixels(tmp_path, monkeypatch):
    """strategy=device_map with no room left to move the text encoders in (the free memory made 0): both are streamed
    layer by layer for the encoding from a packed pinned copy, and every sample equals the run whose encoders were
    moved in whole."""
    import parallel.device_map as device_map
    from shardgen.quality.compare import compare_runs

    # a 26 GiB cap leaves no room for the encoders beside the 22 GiB transformer: both offloaded, moved in per batch
    common = (*SMALL, "strategy=device_map", "strategy.gpus_per_replica=1", "strategy.max_memory=26GiB")
    whole = run(compose_cfg(f"run_dir={tmp_path / 'whole'}", *common))
    assert (whole.ok, whole.complete) == (4, True)
    built: list = []
    real = device_map.StagedPipeline.__post_init__
    monkeypatch.setattr(device_map.StagedPipeline, "__post_init__", lambda self: (built.append(self), real(self))[1])
    monkeypatch.setattr(device_map, "room_to_encode", lambda device, reserve: 0)
    streamed = run(compose_cfg(f"run_dir={tmp_path / 'streamed'}", *common))
    assert (streamed.ok, streamed.failed, streamed.complete) == (4, 0, True)
    assert sorted(built[0].streamed) == ["text_encoder", "text_encoder_2"]
    t5 = built[0].pipe.text_encoder_2  # between batches its weights are the packed pinned copy, ~its own size
    assert all(p.device.type == "cpu" and p.is_pinned() for p in t5.parameters())
    assert len({p.untyped_storage().data_ptr() for p in t5.parameters()}) <= -(-sum(
        p.numel() * p.element_size() for p in t5.parameters()) // (1 << 30)) + 1
    s = compare_runs(RunDir(tmp_path / "streamed"), RunDir(tmp_path / "whole")).summary()
    assert s["compared"] == 4 and s["psnr_db"]["worst"] == float("inf"), s


def test_the_offloaded_seed_loop_makes_the_seed_loop_s_images(tmp_path):
    """``jobs.bench --baseline-offload``: the diffusers loop under enable_model_cpu_offload (the pipeline in RAM, each
    component moved in for its call) makes the plain loop's images, pixel for pixel."""
    import numpy as np

    from jobs.bench import main as bench_main
    from shardgen.bench import measure as M

    common = ["--model", "flux_dev", "--weights", "dummy", "--size", "256", "--steps", "2", "--n", "2",
              "--baseline-only", "--accel", "none"]
    for way, extra in (("plain", []), ("offload", ["--baseline-offload"])):
        bench_main([*common, *extra, "--workdir", str(tmp_path / way), "--out", str(tmp_path / f"out-{way}")])
    plain, offload = (M.read_outputs(tmp_path / way / "baseline", 2) for way in ("plain", "offload"))
    assert all(np.array_equal(plain[i], offload[i]) for i in range(2))


@pytest.mark.parametrize("tokens_major", [False, True])
@pytest.mark.parametrize("heads, dim, parts", [(24, 128, (512, 4096)), (6, 64, (7, 93)), (3, 128, (37,))])
def test_rms_rope_kernel_matches_eager_diffusers(heads, dim, parts, tokens_major):
    """The Triton q/k RMSNorm+RoPE kernel against diffusers' eager ops, in bf16, at FLUX's shapes and at
    token counts that are not multiples of its tile (masked edges)."""
    from shardgen.speed import fused_kernels as flux_fused

    g = torch.Generator("cuda").manual_seed(0)
    xs = [(torch.randn(2, n, heads * dim, device="cuda", generator=g) * 2).bfloat16().unflatten(-1, (heads, dim))
          for n in parts]
    ws = [(torch.rand(dim, device="cuda", generator=g) + 0.5).bfloat16() for _ in parts]
    ang = torch.rand(sum(parts), dim // 2, device="cuda", generator=g) * 6
    cos, sin = ang.cos().repeat_interleave(2, -1).contiguous(), ang.sin().repeat_interleave(2, -1).contiguous()
    ref = flux_fused.rms_rope_reference(xs, ws, cos, sin, 1e-6)
    out = flux_fused.rms_rope(xs, ws, cos, sin, 1e-6, tokens_major)
    assert out.shape == ref.shape and (out.transpose(1, 2) if tokens_major else out).is_contiguous()
    assert (out == ref).float().mean() > 0.999  # the rest: one bf16 step (fp32 sum order, FMA)
    assert (out.float() - ref.float()).abs().max() <= 2 * 2 ** -7 * ref.float().abs().max()


@pytest.mark.parametrize("tokens, dim", [(4608, 3072), (37, 6144), (5, 100)])
def test_the_gated_residual_kernel_makes_addcmul_s_bytes(tokens, dim):
    """The gated residual's Triton kernel (``fused_kernels.gated``) against torch's ``addcmul`` with the gate
    broadcast from a strided row of the modulation output, as the blocks call it: x + gate * y in float32 rounded
    once, so the same bf16 values but for rare one-step roundings (FMA contraction), at FLUX.1's and FLUX.2's widths
    and at sizes that are not multiples of its tile; and it is timed against addcmul (printed)."""
    from shardgen.speed import fused_kernels

    g = torch.Generator("cuda").manual_seed(0)
    x, y = (torch.randn(4, tokens, dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    mods = (torch.randn(4, 6 * dim, device="cuda", generator=g) * 0.3).bfloat16()
    gate = mods.chunk(6, dim=1)[2][:, None]  # (batch, 1, dim), batch stride 6 * dim
    assert fused_kernels._gated_kernel_ok(x, gate, y)
    out, ref = fused_kernels.gated(x, gate, y), torch.addcmul(x, gate, y)
    assert out.shape == ref.shape and (out == ref).float().mean().item() > 0.9999
    # a step of bf16, or where x and gate * y cancel, float32's rounding of the product (FMA or not) scaled up
    slack = 2 ** -7 * ref.float().abs() + 2 ** -20 * (x.float().abs() + (gate.float() * y.float()).abs())
    assert ((out.float() - ref.float()).abs() <= slack).all()
    from torch.utils.benchmark import Timer

    us = {name: Timer(stmt, globals={"fused_kernels": fused_kernels, "torch": torch, "x": x, "gate": gate, "y": y})
          .blocked_autorange(min_run_time=0.2).median * 1e6
          for name, stmt in (("triton", "fused_kernels.gated(x, gate, y)"), ("addcmul", "torch.addcmul(x, gate, y)"))}
    print(f"gated 4x{tokens}x{dim}: triton {us['triton']:.1f} us, addcmul {us['addcmul']:.1f} us")


@pytest.mark.parametrize("tokens, dim", [(4608, 3072), (211, 3072), (37, 6144)])
def test_the_gated_residual_and_the_next_norm_in_one_pass_match_the_two_passes(tokens, dim):
    """``gated_ln_modulate_for`` (a block's gated residual and the next adaLN LayerNorm + modulation in one pass)
    against ``gated`` then ``ln_modulate_for``, as the FLUX blocks called them: the residual the same bf16 values,
    the norm's bf16 values and float8 rows the same but for rare one-step roundings (the row sums' order); and timed
    against the two passes (printed: the one-pass kernel saves the norm's read of the residual stream)."""
    from shardgen.speed import fp8, fused_kernels

    g = torch.Generator("cuda").manual_seed(4)
    x, y = (torch.randn(4, tokens, dim, device="cuda", generator=g).bfloat16() for _ in range(2))
    mods = (torch.randn(4, 6 * dim, device="cuda", generator=g) * 0.3).bfloat16().chunk(6, dim=1)
    gate, shift, scale = (m[:, None] for m in mods[2:5])
    layer = fp8.Float8Linear(torch.nn.Linear(dim, 64, device="cuda", dtype=torch.bfloat16))
    for layers in ([], [layer]):
        h, normed = fused_kernels.gated_ln_modulate_for(layers, x, gate, y, shift, scale, 1e-6)
        h_ref = fused_kernels.gated(x, gate, y)
        ref = fused_kernels.ln_modulate_for(layers, h_ref, shift, scale, 1e-6)
        assert (h == h_ref).float().mean().item() > 0.9999
        if layers:
            assert isinstance(normed, fp8.Fp8Rows) and normed.shape == (4, tokens, dim)
            assert (normed.scale == ref.scale).float().mean().item() > 0.999
            assert (normed.data.float() != ref.data.float()).float().mean().item() < 1e-3
        else:
            assert normed.shape == ref.shape and (normed == ref).float().mean().item() > 0.999
    from torch.utils.benchmark import Timer

    env = {"k": fused_kernels, "x": x, "gate": gate, "y": y, "shift": shift, "scale": scale, "layer": layer}
    us = {name: Timer(stmt, globals=env).blocked_autorange(min_run_time=0.2).median * 1e6 for name, stmt in (
        ("one pass", "k.gated_ln_modulate_for([layer], x, gate, y, shift, scale, 1e-6)"),
        ("two passes", "k.ln_modulate_for([layer], k.gated(x, gate, y), shift, scale, 1e-6)"))}
    print(f"gated + norm to float8 rows, 4x{tokens}x{dim}: one pass {us['one pass']:.1f} us, "
          f"two passes {us['two passes']:.1f} us")


@pytest.mark.parametrize("tokens, dim", [(4608, 6144), (37, 6144), (5, 100)])
def test_flux2_fused_kernels_match_eager_diffusers(tokens, dim):
    """FLUX.2's LayerNorm+modulation and SwiGLU Triton kernels against diffusers' eager ops in bf16, at FLUX.2-dev's
    width and at sizes that are not multiples of their tiles (the SwiGLU input a strided view, as in the single
    blocks). SwiGLU: equal but for rare one-step roundings (H200: none differed at 4608 x 6144). LayerNorm +
    modulation: the norm alone equals torch's but for rare one-step roundings (H200: 2e-6 of the elements), the
    modulated output is within a few bf16 steps of eager's (H200: ~29% of the elements differ, by 1-2 steps: the
    kernel does not reproduce eager's intermediate roundings exactly)."""
    from shardgen.families.flux2 import fused as f2
    from shardgen.speed import fused_kernels as flux_fused

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(2, tokens, dim, device="cuda", generator=g).bfloat16()
    zero = torch.zeros(2, 1, dim, device="cuda", dtype=torch.bfloat16)
    normed = torch.nn.functional.layer_norm(x, (dim,), eps=1e-6)
    assert (f2.ln_modulate(x, zero, zero, 1e-6) == normed).float().mean() > 0.999
    shift, scale, _ = (torch.randn(2, 1, 3 * dim, device="cuda", generator=g) * 0.3).bfloat16().chunk(3, dim=-1)
    out, ref = f2.ln_modulate(x, shift, scale, 1e-6), flux_fused.ln_modulate_reference(x, shift, scale, 1e-6)
    bound = 2 ** -5 * (((1 + scale.float()) * normed.float()).abs() + shift.float().abs()) + 2 ** -10
    assert ((out.float() - ref.float()).abs() <= bound).all(), (out.float() - ref.float()).abs().max()
    wide = torch.randn(2, tokens, 3 * dim + 4 * dim, device="cuda", generator=g).bfloat16()
    view = wide[..., 3 * dim:]
    out, ref = f2.swiglu(view), torch.nn.functional.silu(view[..., :2 * dim]) * view[..., 2 * dim:]
    assert (out == ref).float().mean() > 0.999


def _fused_and_stock_bf16_errors(tr, kw: dict) -> tuple[float, float]:
    """A small transformer (random weights) run in float32, then in bf16 with diffusers' blocks, then in bf16 with
    its family's fused blocks eagerly: the relative RMS error of the fused and of the stock output against float32."""
    from shardgen.speed import accel

    with torch.no_grad():
        for p in tr.parameters():
            p.normal_(0, 0.02) if p.ndim > 1 else p.normal_(1, 0.1)
    bf = {k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and not k.endswith("ids") else v
          for k, v in kw.items()}

    def err(a, b):
        return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()

    with torch.no_grad():
        ref = tr(**kw)[0]
        tr.bfloat16()
        stock = tr(**bf)[0]
        assert accel.fuse_blocks_eager(tr) == 4  # two blocks of each kind
        fused = tr(**bf)[0]
    return err(fused, ref), err(stock, ref)


def test_flux2_fused_blocks_on_cuda_stay_at_the_stock_blocks_bf16_error():
    """A FLUX.2 transformer (head_dim 128, two blocks of each kind) with the fused blocks eagerly: its error against
    a float32 run of diffusers' blocks is the stock bf16 blocks' error, within 10%."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    tr = Flux2Transformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                 attention_head_dim=128, num_attention_heads=4, joint_attention_dim=256,
                                 timestep_guidance_channels=64, axes_dims_rope=(32, 32, 32, 32),
                                 guidance_embeds=True).cuda().eval()
    g = torch.Generator("cuda").manual_seed(1)
    ar = torch.arange(32, device="cuda", dtype=torch.float32)
    z = torch.zeros(1, device="cuda")
    kw = dict(hidden_states=torch.randn(2, 1024, 64, device="cuda", generator=g),
              encoder_hidden_states=torch.randn(2, 77, 256, device="cuda", generator=g),
              timestep=torch.tensor([0.3, 0.8], device="cuda"), guidance=torch.full((2,), 4.0, device="cuda"),
              img_ids=torch.stack(torch.meshgrid(z, ar, ar, z, indexing="ij"), -1).reshape(-1, 4),
              txt_ids=torch.zeros(77, 4, device="cuda"), return_dict=False)
    fused, stock = _fused_and_stock_bf16_errors(tr, kw)
    assert fused <= 1.1 * stock + 1e-3, (fused, stock)


def test_flux_fused_blocks_on_cuda_stay_at_the_stock_blocks_bf16_error(monkeypatch):
    """A FLUX.1 transformer (head_dim 128, two blocks of each kind) with the fused blocks eagerly (one-pass
    LayerNorm + modulation, addcmul residuals, the split proj_out accumulating in place): its error against a
    float32 run of diffusers' blocks is the stock bf16 blocks' error, within 10%."""
    from diffusers import FluxTransformer2DModel

    from shardgen.families.flux import fused as flux_fused

    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                attention_head_dim=128, num_attention_heads=4, joint_attention_dim=256,
                                pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56)).cuda().eval()
    g = torch.Generator("cuda").manual_seed(1)
    ar = torch.arange(32, device="cuda", dtype=torch.float32)
    z = torch.zeros(1, device="cuda")
    kw = dict(hidden_states=torch.randn(2, 1024, 64, device="cuda", generator=g),
              encoder_hidden_states=torch.randn(2, 77, 256, device="cuda", generator=g),
              pooled_projections=torch.randn(2, 64, device="cuda", generator=g),
              timestep=torch.tensor([0.3, 0.8], device="cuda"), guidance=torch.full((2,), 3.5, device="cuda"),
              img_ids=torch.stack(torch.meshgrid(z, ar, ar, indexing="ij"), -1).reshape(-1, 3),
              txt_ids=torch.zeros(77, 3, device="cuda"), return_dict=False)
    bodies = []
    for name in ("_double_block_eager", "_single_block_eager"):
        body = getattr(flux_fused, name)
        monkeypatch.setattr(flux_fused, name, lambda *a, _body=body, **k: bodies.append(_body) or _body(*a, **k))
    fused, stock = _fused_and_stock_bf16_errors(tr, kw)
    assert len(bodies) == 4  # the eager CUDA bodies ran in every block
    assert fused <= 1.1 * stock + 1e-3, (fused, stock)


def test_tokens_major_queries_give_a_tokens_major_attention_output_and_the_same_blocks(monkeypatch):
    """``fused_kernels.SDPA_TOKENS_MAJOR``: SDPA (cuDNN, as ``sdpa_backend=auto`` picks at FLUX.1's shape) writes its
    output in the queries' (batch, tokens, heads, head_dim) memory, so the blocks' (batch, tokens, heads * head_dim)
    view of it is no copy; and a FLUX.1 transformer's fused blocks make the same output either way (to bf16
    noise: the printed fraction of equal values says whether cuDNN's arithmetic moved with the layout)."""
    from diffusers import FluxTransformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shardgen.families.flux import fused as flux_fused
    from shardgen.speed import fused_kernels

    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4608, 24, 128, device="cuda", generator=g).bfloat16().transpose(1, 2)
               for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous(), out.stride()
    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                attention_head_dim=128, num_attention_heads=4, joint_attention_dim=256,
                                pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    tr = tr.cuda().to(torch.bfloat16).eval()
    ar = torch.arange(32, device="cuda", dtype=torch.float32)
    z = torch.zeros(1, device="cuda")
    kw = dict(hidden_states=torch.randn(2, 1024, 64, device="cuda", generator=g).bfloat16(),
              encoder_hidden_states=torch.randn(2, 77, 256, device="cuda", generator=g).bfloat16(),
              pooled_projections=torch.randn(2, 64, device="cuda", generator=g).bfloat16(),
              timestep=torch.tensor([0.3, 0.8], device="cuda"), guidance=torch.full((2,), 3.5, device="cuda"),
              img_ids=torch.stack(torch.meshgrid(z, ar, ar, indexing="ij"), -1).reshape(-1, 3),
              txt_ids=torch.zeros(77, 3, device="cuda"), return_dict=False)
    flux_fused.enable(tr)
    calls = []
    monkeypatch.setattr(flux_fused, "rope_attention",
                        lambda *a, _f=flux_fused.rope_attention: calls.append(1) or _f(*a))
    outs = []
    with torch.no_grad():
        for tokens_major in (False, True):
            monkeypatch.setattr(fused_kernels, "SDPA_TOKENS_MAJOR", tokens_major)
            outs.append(tr(**kw)[0].float())
    assert len(calls) == 8  # the fused processor's attention in each of the four blocks, both ways
    equal = (outs[0] == outs[1]).float().mean().item()
    print(f"tokens-major attention: {equal:.4f} of the output values equal")
    assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 1e-2


def _model_inputs(model: str, batch: int, g: torch.Generator, size: int = 1024, text: int = 512) -> dict:
    """A transformer call's arguments as the model's pipeline passes them (bf16, ``size`` pixels square)."""
    side, bf = size // 16, torch.bfloat16
    ar = torch.arange(side, device="cuda", dtype=torch.float32)
    z = torch.zeros(1, device="cuda")
    if model == "flux_dev":
        return dict(hidden_states=torch.randn(batch, side * side, 64, device="cuda", generator=g).to(bf),
                    encoder_hidden_states=torch.randn(batch, text, 4096, device="cuda", generator=g).to(bf),
                    pooled_projections=torch.randn(batch, 768, device="cuda", generator=g).to(bf),
                    timestep=torch.rand(batch, device="cuda", generator=g).to(bf),
                    guidance=torch.full((batch,), 3.5, device="cuda"),
                    img_ids=torch.stack(torch.meshgrid(z, ar, ar, indexing="ij"), -1).reshape(-1, 3),
                    txt_ids=torch.zeros(text, 3, device="cuda"), joint_attention_kwargs=None, return_dict=False)
    txt_ids = torch.zeros(text, 4, device="cuda")
    txt_ids[:, 3] = torch.arange(text, device="cuda")
    return dict(hidden_states=torch.randn(batch, side * side, 128, device="cuda", generator=g).to(bf),
                encoder_hidden_states=torch.randn(batch, text, 15360, device="cuda", generator=g).to(bf),
                timestep=torch.rand(batch, device="cuda", generator=g).to(bf),
                guidance=torch.full((batch,), 4.0, device="cuda", dtype=bf),
                img_ids=torch.stack(torch.meshgrid(z, ar, ar, z, indexing="ij"), -1).reshape(-1, 4),
                txt_ids=txt_ids, joint_attention_kwargs=None, return_dict=False)


@pytest.mark.parametrize("model", ["flux_dev", "flux2_dev"])
def test_replayed_cuda_graphs_give_the_eager_calls_bits(model):
    """The model's transformer at full width (two double and four single blocks, fused eager blocks, 1024x1024):
    calls of batch 4 and a short batch of 2, each at new random inputs, return through ``GraphedForward`` (a
    CUDA graph per shape, captured at its second call) exactly what the same calls return eagerly."""
    from shardgen.models.dummy import construct_meta, dummy_architecture, materialize_random
    from shardgen.speed import accel
    from shardgen.speed.cuda_graphs import GraphedForward

    spec = dummy_architecture(model, {"transformer": {"num_layers": 2, "num_single_layers": 4}})["transformer"]
    tr = materialize_random(construct_meta(spec), torch.device("cuda"), torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(0)).eval()
    assert accel.fuse_blocks_eager(tr) == 6
    g = torch.Generator("cuda").manual_seed(1)
    calls = [_model_inputs(model, batch, g) for batch in (4, 4, 4, 2, 2, 4, 2)]
    graphed = GraphedForward(tr.forward)
    with torch.no_grad():
        eager = [tr(**kw)[0] for kw in calls]
        replayed = [graphed(**kw)[0] for kw in calls]
    assert graphed.counts == {"eager": 2, "captured": 2, "replayed": 5}
    for i, (a, b) in enumerate(zip(eager, replayed)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


def test_sdpa_auto_times_a_long_video_one_sample_at_a_time_within_its_memory():
    """sdpa_backend=auto at a 720p Wan 14B batch of 4 (75,600 tokens x 40 heads: 3.1 GB a tensor at batch 4) times
    the kernels on one sample: every kernel measured and agreeing, at a peak of one sample's tensors (the batch's
    would be four times that)."""
    from shardgen.speed import sdpa

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    timings = sdpa.measure_sdpa(torch.device("cuda"), torch.bfloat16, 4, 40, 75600, 128, iters=1)
    peak = torch.cuda.max_memory_allocated() - base
    measured = {n: t for n, t in timings.items() if "ms" in t}
    assert {"flash", "cudnn"} <= set(measured), timings
    assert all(t["max_abs_diff"] < 0.05 for t in measured.values()), timings
    one_sample = 40 * 75600 * 128 * 2
    assert peak < 8 * one_sample, (peak / 1e9, timings)  # q, k, v, two outputs and workspaces of one sample


def test_compiled_fused_job_stays_within_the_bf16_noise_floor(tmp_path):
    """compile=true (fused FLUX blocks, tuned kernels) through the whole job moves the pixels no more than
    swapping one exact attention kernel for another does in the eager job (random weights amplify bf16
    rounding a lot at 2 big steps: on an H200 eager flash vs eager cuDNN gave 16.8-42.6 dB per image
    here, and compiled vs eager 16.8-45.1)."""
    from shardgen.bench.measure import psnr, shard_images

    runs = {"eager": ("compile=false", "sdpa_backend=cudnn"), "flash": ("compile=false", "sdpa_backend=flash"),
            "compiled": ("compile=true", "sdpa_backend=cudnn")}
    for name, extra in runs.items():
        r = run(compose_cfg(f"run_dir={tmp_path / name}", *SMALL, "strategy=dp", *extra))
        assert (r.ok, r.failed) == (4, 0)
    eager, flash, compiled = (shard_images(tmp_path / name) for name in runs)
    assert sorted(eager) == sorted(compiled) == [0, 1, 2, 3]
    for i in eager:
        assert psnr(compiled[i], eager[i]) >= min(psnr(flash[i], eager[i]), 60.0) - 3, i


def test_qwen_image_compiled_job_never_recompiles_after_its_first_batch(tmp_path):
    """Qwen-Image trims its text to each batch's longest prompt; with the text-length buckets marked dynamic,
    prompts of 1 to 160 words (two buckets) in batches of 2 compile once, in the first batch (torch._dynamo's
    counters)."""
    from shardgen.bench.main import bench_prompts
    from shardgen.bench.measure import compiled_graphs
    from shardgen.run.runner import run_rank

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in bench_prompts(8)), encoding="utf-8")
    graphs = []
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", "model=qwen_image", "model.weights=dummy", "height=256",
                      "width=256", "steps=2", "batch_size=2", "progress=false", "prompts=txt", f"prompts.path={prompts}",
                      "compile=true", "compile_tuning=false")
    r = run_rank(cfg, on_batch=lambda event, worker: event == "end" and graphs.append(compiled_graphs()))
    assert (r.ok, r.failed) == (8, 0)
    assert len(graphs) == 4 and graphs[-1] == graphs[0], f"graphs compiled after each batch: {graphs}"


@pytest.mark.parametrize("valid", [[17, 45, 90, 128], [4, 4, 4, 4]])
def test_prefix_attention_matches_the_masked_sdpa_in_bf16(valid):
    """Qwen-Image's joint attention at 1024x1024 (4096 image + 128 text tokens, 24 heads of 128) without the mask
    (shardgen/speed/prefix_attention.py) against SDPA with diffusers' boolean key-padding mask, under cuDNN first:
    image rows within bf16 rounding of each other (H200: both 0.0023 relative RMS from a float32 reference)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shardgen.speed.prefix_attention import prefix_attention

    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 4224, 24, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    k_it, v_it = (torch.cat([t[:, 128:], t[:, :128]], 1) for t in (k, v))  # [image, text] key order
    keep_it = torch.arange(4224, device="cuda")[None, :] < torch.tensor(valid, device="cuda")[:, None] + 4096
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k_it.transpose(1, 2), v_it.transpose(1, 2), attn_mask=keep_it[:, None, None, :]).transpose(1, 2)
        got = prefix_attention(q, k_it, v_it, torch.tensor(valid), 4096)
    rel = (got[:, 128:].float() - want[:, 128:].float()).pow(2).mean().sqrt() / want[:, 128:].float().pow(2).mean().sqrt()
    assert rel < 5e-3


def test_row_adapter_switching_compiles_nothing_after_the_first_batch(tmp_path):
    """Rows naming their own LoRA sets (FLUX.1-dev shapes, rank-16 adapters) under compile=true: every batch after
    the first switches the fused set, and no batch compiles a graph the first did not (torch._dynamo's counters)."""
    import json

    from shardgen.bench.measure import compiled_graphs
    from shardgen.models.dummy import save_random_lora
    from shardgen.run.runner import run_rank

    for i, name in enumerate("ab"):
        save_random_lora("flux_dev", tmp_path / f"{name}.safetensors", rank=16, seed=i)
    sets = ([], ["a.safetensors"], ["b.safetensors"], ["a.safetensors", "b.safetensors:0.5"])
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps(dict(prompt=f"a photo of thing {i}", loras=sets[i % 4])) + "\n")
    graphs = []
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", "model=flux_dev", "model.weights=dummy", "height=256", "width=256",
                      "steps=2", "batch_size=2", "samples_per_shard=8", "progress=false", "prompts=jsonl",
                      f"prompts.path={tmp_path / 'rows.jsonl'}",
                      "prompts.row_settings=[loras]", "compile=true", "compile_tuning=false")
    r = run_rank(cfg, on_batch=lambda event, worker: event == "end" and graphs.append(compiled_graphs()))
    assert (r.ok, r.failed) == (8, 0)
    assert len(graphs) == 4 and graphs[-1] == graphs[0], f"graphs compiled after each batch: {graphs}"


@pytest.mark.parametrize("model,extra", [
    ("flux_dev_img2img", ("prompts.row_settings=[image,strength]",)),
    ("flux_kontext_dev", ("prompts.row_settings=[image]",)),
    ("flux2_dev", ("prompts.row_settings=[image]",)),
    ("qwen_image_edit", ("prompts.row_settings=[image]",)),
    ("wan21_i2v_14b", ("prompts.row_settings=[image]", "num_frames=9")),
])
def test_each_image_family_makes_every_row_from_its_input_image(tmp_path, model, extra):
    """The input-image families' real architectures (dummy bf16 weights) through the default job on the GPU: every
    row of examples/images.jsonl made, the json naming its input image, jobs.verify clean."""
    from tests.conftest import ROOT
    from tests.test_condition import jsons

    r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"model={model}", "model.weights=dummy", "height=256",
                        "width=256", "steps=2", "batch_size=2", "progress=false", "prompts=jsonl",
                        f"prompts.path={ROOT / 'examples' / 'images.jsonl'}", *extra))
    assert (r.ok, r.failed, r.complete) == (3, 0, True)
    assert sorted(m["input_image"]["path"] for m in jsons(tmp_path / "run").values()) == \
        ["images/meadow.png", "images/meadow.png", "images/night_beach.png"]
    rep = verify_run(load_plan(RunDir(tmp_path / "run")))
    assert rep.ok, rep.defects


def _fa4_missing() -> str | None:
    from shardgen.speed import fa4

    return fa4.unavailable_reason("cuda")


@pytest.mark.parametrize("heads, tokens, dim", [(24, 4608, 128), (38, 4429, 64), (12, 1031, 72), (2, 77, 64)])
def test_fa4_through_sdpa_matches_cudnn_on_every_head_size(heads, tokens, dim):
    """With FA4 active, SDPA's flash calls agree with cuDNN's to bf16 rounding, also for a head size FA4 may have
    no kernel for (72: torch's memory-efficient kernel runs it instead of an error)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shardgen.speed import fa4

    if _fa4_missing():
        pytest.skip(_fa4_missing())
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, tokens, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v)
    fa4.activate()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == ref.shape and out.stride() == ref.stride()
    assert (out.float() - ref.float()).abs().max() < 2e-2


def test_fa4_through_the_whole_job_eager_and_compiled_stays_within_the_kernel_noise_floor(tmp_path):
    """sdpa_backend=fa4, eager and compile=true, moves FLUX.1's pixels no more than flash vs cuDNN does."""
    from shardgen.bench.measure import psnr, shard_images

    if _fa4_missing():
        pytest.skip(_fa4_missing())
    runs = {"eager": ("compile=false", "sdpa_backend=cudnn"), "flash": ("compile=false", "sdpa_backend=flash"),
            "fa4": ("compile=false", "sdpa_backend=fa4"), "fa4_compiled": ("compile=true", "sdpa_backend=fa4")}
    for name, extra in runs.items():
        r = run(compose_cfg(f"run_dir={tmp_path / name}", *SMALL, "strategy=dp", *extra))
        assert (r.ok, r.failed) == (4, 0), name
    eager, flash, fa4_eager, fa4_compiled = (shard_images(tmp_path / name) for name in runs)
    for i in eager:
        floor = min(psnr(flash[i], eager[i]), 60.0) - 3
        assert psnr(fa4_eager[i], eager[i]) >= floor, i
        assert psnr(fa4_compiled[i], eager[i]) >= floor - 3, i  # compiled rounding on top of the kernel's



@pytest.mark.parametrize("model,speedup", [("flux_dev", 1.3), ("flux2_dev", 1.3), ("qwen_image", 1.1)])
def test_the_fused_decoder_makes_the_eager_decoder_s_images_faster(model, speedup):
    """fused_decode on the real decoders (random bf16 weights, batch 2 at 1024x1024): the 8-bit images within bf16
    noise of the stock decoder's (PSNR >= 40 dB each), in the usual layout, and the decode faster (FLUX's norms
    fused channels-last, Qwen-Image's frame with 2-D convolutions; benchmarks/probe_vae.py)."""
    from benchmarks.probe_vae import build_vae, latents, psnr_8bit, time_decode
    from shardgen.speed import fused_decode

    vae = build_vae(model, torch.device("cuda"), torch.bfloat16)
    z = latents(vae, 2, 1024, torch.device("cuda"), torch.bfloat16)
    eager_ms, want = time_decode(vae.decode, z, 3)
    assert fused_decode.install(vae) > 20  # GroupNorms or causal convolutions
    fused_ms, got = time_decode(vae.decode, z, 3)
    assert got.is_contiguous() and got.shape == want.shape
    assert psnr_8bit(got.float(), want.float()) >= 40.0
    assert fused_ms * speedup <= eager_ms, (fused_ms, eager_ms)
    assert fused_decode.uninstall(vae)


@pytest.mark.parametrize("heads,tokens,dim", [(24, 4608, 128), (48, 4608, 128), (38, 4429, 64), (2, 300, 96)])
def test_fa3_matches_cudnn_attention_on_every_head_size(heads, tokens, dim):
    """FlashAttention-3's bf16 kernel (``sdpa_backend=fa3``, a candidate of auto where fa3-fwd is installed) against
    cuDNN's on tokens-major inputs, as the processors hand them: within bf16 rounding of each other, in SDPA's
    layout. Skipped where fa3-fwd is not installed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shardgen.speed import fa3

    if why := fa3.unavailable_reason("cuda"):
        pytest.skip(why)
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    got = fa3.attention(q, k, v)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.01


def test_fa3_and_the_fused_decode_through_the_whole_job_stay_within_the_kernel_noise_floor(tmp_path):
    """sdpa_backend=fa3 (eager and compile=true) and fused_decode (on by default) against cuDNN and the stock
    decoder: FLUX.1's pixels move no more than flash vs cuDNN moves them. Skipped where fa3-fwd is not installed."""
    from shardgen.bench.measure import psnr, shard_images
    from shardgen.speed import fa3

    if why := fa3.unavailable_reason("cuda"):
        pytest.skip(why)
    stock = ("compile=false", "fused_decode=false")
    runs = {"cudnn": (*stock, "sdpa_backend=cudnn"), "flash": (*stock, "sdpa_backend=flash"),
            "fa3": (*stock, "sdpa_backend=fa3"), "fa3_compiled": ("compile=true", "sdpa_backend=fa3"),
            "fused_decode": ("compile=false", "sdpa_backend=cudnn")}
    for name, extra in runs.items():
        r = run(compose_cfg(f"run_dir={tmp_path / name}", *SMALL, "strategy=dp", *extra))
        assert (r.ok, r.failed) == (4, 0), name
    cudnn, flash, fa3_eager, fa3_compiled, decoded = (shard_images(tmp_path / name) for name in runs)
    for i in cudnn:
        floor = min(psnr(flash[i], cudnn[i]), 60.0) - 3
        assert psnr(fa3_eager[i], cudnn[i]) >= floor, i
        assert psnr(fa3_compiled[i], cudnn[i]) >= floor - 3, i  # compiled rounding on top of the kernel's
        assert psnr(decoded[i], cudnn[i]) >= 40.0, i
