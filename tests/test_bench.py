"""jobs.bench on the CPU (the tiny model) and the acceleration options of shardgen/speed/accel.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import pytest
import torch

from shardgen.speed import accel
from jobs.bench import main as bench_main
from jobs.generate import run
from tests.conftest import compose_cfg, start_module
from tests.test_generate import shard_images

FAST = ("height=32", "width=32", "steps=2", "progress=false", "prompts.limit=6", "batch_size=4")


@pytest.mark.slow  # whole jobs / bench runs
def test_quick_bench_prints_every_figure_and_exits_0(tmp_path):
    """``python -m jobs.bench`` as a user runs it: every figure printed, bench.json written, exit status 0."""
    proc = start_module("jobs.bench", ["--quick", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                        tmp_path / "bench.log")
    assert proc.wait(timeout=600) == 0, proc.output[-2000:]
    for needle in ("matmul rate (measured", "FLOPs per image-step", "baseline (diffusers loop)",
                   "shardgen (jobs.generate)", "images/hour", "denoise MFU", "e2e MFU", "speed-up shardgen / baseline",
                   "PSNR shardgen vs baseline", "GPU idle in steady state", "peak memory"):
        assert needle in proc.output, needle
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    s = data["summary"]
    assert s["baseline_images_per_hour"] > 0 and s["shardgen_images_per_hour"] > 0 and s["speedup"] > 0
    assert s["psnr_first"] > 40  # float64 on a CPU: the same pixels up to the odd rounding
    assert data["shardgen"]["ok"] == 4


def test_the_offloaded_baseline_is_asked_for_alone_and_on_a_gpu(tmp_path, capsys):
    """``--baseline-offload`` (diffusers' enable_model_cpu_offload) is the diffusers loop's alone and needs a CUDA
    GPU: each misuse is one line saying what to change, before anything is built."""
    from jobs.bench import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--quick", "--baseline-offload"])
    assert e.value.code == 2 and "--baseline-offload measures the diffusers loop alone: add --baseline-only" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit, match="--baseline-offload moves each component to a CUDA GPU for its call; the "
                                         "device here is cpu: leave --baseline-offload out"):
        bench_main(["--quick", "--baseline-only", "--baseline-offload", "--workdir", str(tmp_path / "work"),
                    "--out", str(tmp_path / "out")])


def test_quick_video_bench_compares_the_seed_loop_in_videos_per_hour(tmp_path, capsys):
    """A video model: the seed loop's ``pipe(prompt).frames[0]`` encoded with the job's own mp4 encoder against the
    job; the same frames on both sides (float64 on a CPU), so the decoded videos are identical."""
    data = bench_main(["--quick", "--model", "tiny_video", "--size", "32x48", "--set", "num_frames=5",
                       "--workdir", str(tmp_path / "work"), "--keep"])
    out = capsys.readouterr().out
    assert "32x48, 5 frames" in out and "videos/hour" in out and "s/video" in out and "first video inf dB" in out
    assert len(list((tmp_path / "work" / "baseline").glob("*.mp4"))) == 4
    s = data["summary"]
    assert s["baseline_images_per_hour"] > 0 and s["shardgen_images_per_hour"] > 0
    assert s["psnr_min"] == float("inf")


@pytest.mark.slow  # whole jobs / bench runs
def test_diagnostic_runs_split_the_difference_to_the_baseline(tmp_path, capsys):
    data = bench_main(["--quick", "--accel", "eager,batch1", "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert "diagnostic eager:" in out and "diagnostic batch1:" in out and "vs baseline" in out
    acc = data["summary"]
    # float64 on a CPU: neither the batch nor compilation moves a pixel
    assert acc["accel_eager"]["psnr_vs_baseline"] > 40 and acc["accel_batch1"]["psnr_vs_baseline"] > 40
    assert data["accel"]["batch1"]["ok"] == 4


@pytest.mark.slow  # whole jobs / bench runs
def test_accel_flags_off_give_identical_bytes_and_touch_nothing(tmp_path, monkeypatch):
    plain = compose_cfg(f"run_dir={tmp_path / 'plain'}", *FAST)
    explicit = compose_cfg(f"run_dir={tmp_path / 'explicit'}", "compile=false", "fp8=false", "first_block_cache=0",
                           "sdpa_backend=auto", *FAST)
    run(plain)
    seen = []
    orig = accel.prepare

    def spy(pipe, opts):
        done = orig(pipe, opts)
        tr = pipe.transformer
        seen.append((done, accel.fp8_enabled(tr), tr.is_cache_enabled,
                     any("_shardgen_eager_forward" in b.__dict__ for b in accel.repeated_blocks(tr))))
        return done

    monkeypatch.setattr(accel, "prepare", spy)
    run(explicit)
    assert seen and all(set(done) <= {"prepare_s"} and not fp8 and not cache and not compiled
                        for done, fp8, cache, compiled in seen)
    a, b = shard_images(tmp_path / "plain"), shard_images(tmp_path / "explicit")
    assert len(a) == 6 and a == b


@pytest.mark.slow  # whole jobs / bench runs
def test_lossy_options_run_and_are_recorded(tmp_path):
    from shardgen.tools.verify import read_shard_members

    cfg = compose_cfg(f"run_dir={tmp_path / 'lossy'}", "first_block_cache=0.5", "fp8=true", *FAST)
    result = run(cfg)
    assert result.ok == 6
    metas = [json.loads(m["json"]) for tar in (tmp_path / "lossy" / "shards").glob("*.tar")
             for m in read_shard_members(tar).values()]
    assert metas and all(m["lossy"] == {"first_block_cache": 0.5, "fp8": True} for m in metas)


def test_float8_linear_is_close_to_linear_and_reversible_only_when_asked():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    x = torch.randn(5, 7, 64)
    ref = block(x)
    q = torch.nn.Sequential(accel.Float8Linear(block[0], keep_original=True), block[1], accel.Float8Linear(block[2]))
    out = q(x)
    assert out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < 0.08  # e4m3: 3 mantissa bits, row-wise scales
    assert q[0].restore() is block[0]
    with pytest.raises(accel.AccelError, match="fp8=false"):
        q[2].restore()
    # the kept layer goes where it is sent (on a GPU: to the CPU) without taking the float8 layer's bias with it
    block[0].to(torch.float16)
    assert q[0].bias.dtype == torch.float32 and torch.equal(q(x), out)


def test_weights_are_quantised_a_slice_at_a_time_with_per_channel_scales(monkeypatch):
    from shardgen.speed import fp8

    torch.manual_seed(1)
    w = torch.randn(10, 32) * torch.arange(1, 11).unsqueeze(1)  # rows of very different ranges
    original = w.clone()
    whole = fp8.quantize_weight(w)
    assert torch.equal(w, original)  # the layer's own weight is left as it was
    monkeypatch.setattr(fp8, "QUANTIZE_ROWS_AT_ONCE", 3)  # 4 slices, the last one short
    sliced = fp8.quantize_weight(w)
    assert torch.equal(whole[0].float(), sliced[0].float()) and torch.equal(whole[1], sliced[1])
    assert whole[1].shape == (1, 10)
    assert torch.allclose(whole[1][0], w.abs().amax(dim=1) / fp8.FP8_MAX)
    assert whole[0].float().abs().amax(dim=1).eq(fp8.FP8_MAX).all()  # each row's largest value maps to the top


def test_enable_fp8_frees_each_bf16_layer_and_refuses_to_switch_back():
    import gc
    import weakref

    from shardgen.speed import fp8

    tr = _two_block_transformer()
    linears = [weakref.ref(m) for m in tr.modules() if isinstance(m, torch.nn.Linear)]
    assert fp8.enable_fp8(tr) == len(linears) == 4
    gc.collect()
    assert all(ref() is None for ref in linears)  # nothing holds the bf16 layers: their memory is free
    with pytest.raises(accel.AccelError, match="fp8=false"):
        fp8.disable_fp8(tr)

    kept = _two_block_transformer()
    fp8.make_reversible(kept)
    fp8.enable_fp8(kept)
    assert fp8.disable_fp8(kept) == 4 and not fp8.fp8_enabled(kept)


def _two_block_transformer() -> torch.nn.Module:
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.down(self.up(x).relu())

    class Toy(torch.nn.Module):
        _repeated_blocks = ["Block"]

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    return Toy()


@pytest.mark.parametrize("opts, msg", [
    (accel.AccelOptions(sdpa="fastest"), "sdpa_backend"),
    (accel.AccelOptions(first_block_cache=1.5), "first_block_cache"),
    (accel.AccelOptions(compile=True, compile_mode="fast"), "compile_mode"),
])
def test_invalid_accel_options_are_refused(opts, msg):
    with pytest.raises(accel.AccelError, match=msg):
        accel.validate(opts, "cpu")


def test_compile_mode_is_passed_to_torch_compile_and_default_passes_none(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)

    class Block(torch.nn.Module):
        def forward(self, x):
            return x

    class Tr(torch.nn.Module):
        _repeated_blocks = ("Block",)

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    tr = Tr()
    assert accel.compile_blocks(tr) == 2
    assert calls == [{"fullgraph": True, "dynamic": False}] * 2  # default: exactly as before
    accel.uncompile_blocks(tr)
    calls.clear()
    accel.compile_blocks(tr, "max-autotune-no-cudagraphs")
    assert calls == [{"fullgraph": True, "dynamic": False, "mode": "max-autotune-no-cudagraphs"}] * 2
    cfg = {"compile": True, "compile_mode": "max-autotune"}
    assert accel.AccelOptions.from_cfg(cfg).compile_mode == "max-autotune"
    assert accel.AccelOptions.from_cfg({"compile": True}).compile_mode == "default"


@pytest.mark.parametrize("strategy,ran,device,on", [
    ("dp", None, "cuda", True),        # the default on a GPU: compiled
    ("dp", None, "cpu", False),        # CPU: never (compilation costs more than it saves on the tiny model)
    ("tp", None, "cuda", False),       # model-parallel replicas: not what compile=auto was measured on
    ("auto", "dp", "cuda", True),      # strategy=auto resolved to dp at run time: compiled like dp
    ("auto", "tp", "cuda", False),
])
def test_compile_auto_follows_the_strategy_that_runs(strategy, ran, device, on):
    from shardgen.run.generation import GenSettings

    overrides = [f"strategy={strategy}", f"device={device}"] + (["tp_degree=2"] if strategy == "tp" else [])
    cfg = compose_cfg(*overrides)
    settings = GenSettings.from_cfg(cfg, ran)
    assert settings.accel.compile is on and settings.strategy == (ran or strategy)


@pytest.mark.parametrize("pipeline, model, extra", [
    ("FluxPipeline", "flux_dev", ()), ("Flux2Pipeline", "flux2_dev", ()),
    ("QwenImagePipeline", "qwen_image", ("model.true_cfg_scale=4.0", "model.negative_prompt=blurry"))])
def test_the_seed_loop_and_the_jobs_batch_do_equal_work(pipeline, model, extra):
    """The benchmark's seed loop (one prompt, one generator, PIL output) and the job's batch of mixed-length
    prompts give the same pixels for each model's own settings (true CFG and its negative prompt included), on a
    scaled-down model in float64 (where batching cannot move a bit): the speed-ups compare equal work. On the GPU
    the two differ only by bf16 rounding (FLUX.2-dev's random weights amplify it most: ~26 dB on an H200)."""
    from shardgen.bench.ways import baseline_kwargs
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.run.generation import GenSettings, pipeline_kwargs, to_pixels
    from tests.test_dummy_models import SMALL

    pipe = build_dummy_pipeline(pipeline, "cpu", torch.float64, overrides=SMALL[pipeline])
    cfg = compose_cfg(f"model={model}", "height=64", "width=64", "steps=2", *extra)
    prompts = ["a cat", "an astronaut riding a horse on the moon, digital art, a dog on the beach at sunset", "x"]
    _, batch = to_pixels(pipe(**pipeline_kwargs(pipe, GenSettings.from_cfg(cfg), prompts, [5, 6, 7])).images)
    for i, prompt in enumerate(prompts):
        alone = np.asarray(pipe(**baseline_kwargs(pipe, cfg, prompt, 5 + i)).images[0])
        np.testing.assert_array_equal(batch[i], alone)


def test_a_flux_step_counts_the_flops_the_architecture_implies():
    """benchmarks/step_flops.py: FLUX.1-dev at 1024x1024 (4096 image + 512 text tokens) is ~74 TFLOP an image-step
    (12B parameters, but the adaLN modulation is per sample and a dual-stream block's text side sees 512 tokens);
    FLUX.2-dev's 32B transformer ~283."""
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("step_flops", ROOT / "benchmarks" / "step_flops.py")
    step_flops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_flops)
    linear, attention = step_flops.step_flops("flux_dev", 4096, 512)
    assert attention == 4 * 4608 ** 2 * 24 * 128 * 57
    assert (linear + attention) / 1e12 == pytest.approx(74.4, abs=0.1)
    linear, attention = step_flops.step_flops("flux2_dev", 4096, 512)
    assert (linear + attention) / 1e12 == pytest.approx(282.5, abs=0.1)


def _lossy_runs():
    """benchmarks/lossy_runs.py as a module (it puts benchmarks/ on the path for its sibling real_runs.py)."""
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("lossy_runs", ROOT / "benchmarks" / "lossy_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_earlier_seed_loop_is_projected_to_this_call_s_prompts_or_refused_in_one_line(tmp_path):
    """benchmarks/lossy_runs.py --seed-from: the seed loop of a 24-prompt call (8 prompts made in 52.8 s at 751.4
    images/hour) stands for a 96-prompt call as 52.8 s + 88 prompts at its rate; a summary without one, of another
    model or steps, or unreadable, stops the call with what to do."""
    import json

    lossy_runs = _lossy_runs()
    summary = tmp_path / "summary.json"
    seed = {"rc": 0, "process_s": 52.8, "images_per_hour": 751.4, "n": 8, "seed_whole_s": 129.5}
    summary.write_text(json.dumps({"model": "flux2_dev", "steps": 8, "n": 24, "seed": seed}))
    got = lossy_runs.earlier_seed(summary, "flux2_dev", 8, 96)
    assert got["seed_whole_s"] == pytest.approx(52.8 + 88 * 3600 / 751.4) and got["images_per_hour"] == 751.4
    for body, model, steps, says in ((json.dumps({"model": "flux2_dev", "steps": 8}), "flux2_dev", 8, "--seed-n 8"),
                                     (summary.read_text(), "flux_dev", 28, "flux2_dev at 8 steps"),
                                     ('{"seed": ', "flux2_dev", 8, "not a readable summary.json")):
        summary.write_text(body)
        with pytest.raises(SystemExit, match=says):
            lossy_runs.earlier_seed(summary, model, steps, 96)


def test_a_model_too_large_for_the_device_is_one_line_before_the_bench_builds_it(tmp_path):
    """``jobs.bench --model tiny --weights dummy`` on the CPU: FLUX.1-dev's architecture in float64 (~126 GiB) is
    refused by the job's own memory check, in one line, exit 2, instead of the kernel killing the process half-way
    through building it."""
    from parallel.memory import GiB, available_bytes

    available, _ = available_bytes("cpu", 1)
    if available is None or available > 120 * GiB:
        pytest.skip("needs a machine with less than 120 GiB of RAM available (the model must not fit)")
    import resource

    def capped():  # were the check gone, the build fails on this cap, not by the kernel's out-of-memory killer
        resource.setrlimit(resource.RLIMIT_AS, (16 * GiB, 16 * GiB))

    done = subprocess.run([sys.executable, "-m", "jobs.bench", "--model", "tiny", "--weights", "dummy", "--device",
                           "cpu", "--steps", "1", "--n", "4", "--skip-baseline", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                          preexec_fn=capped)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("jobs.bench: model=tiny (weights=dummy, dtype=float64) needs ~125.7 GiB")
    assert "model.weights=pretrained" in lines[-1] and "Traceback" not in done.stderr
    # what the report holds so far (the environment, the matmul rate), no pipeline built
    assert "build_s" not in json.loads((tmp_path / "bench.json").read_text())


def test_a_lossy_set_is_said_and_the_opt_in_run_it_repeats_is_left_out(tmp_path):
    """``--set fp8=true`` makes the measured run itself lossy: the bench records it, and its ``fp8`` opt-in run (the
    same settings again, compared with itself) is left out while ``fbc`` stays."""
    from jobs.bench import parse_args
    from shardgen.bench.main import Bench

    b = Bench(parse_args(["--quick", "--set", "fp8=True", "--accel", "fp8,fbc", "--workdir", str(tmp_path),
                          "--out", str(tmp_path / "out")]))
    assert b.lossy == {"fp8": True} and b.accels == ["fbc"] and b.repeats == ["fp8"]
    assert b.env()["lossy"] == {"fp8": True}
    exact = Bench(parse_args(["--quick", "--accel", "fp8", "--workdir", str(tmp_path / "2"), "--out", str(tmp_path)]))
    assert exact.lossy == {} and exact.accels == ["fp8"]
