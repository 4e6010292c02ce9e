"""jobs.bench on the CPU (the tiny model) and the acceleration options of shardgen/speed/accel.py."""

from __future__ import annotations

import json

import pytest
import torch

from shardgen.speed import accel
from jobs.bench import main as bench_main
from jobs.generate import run
from tests.conftest import compose_cfg
from tests.test_generate import shard_images

FAST = ("height=32", "width=32", "steps=2", "progress=false", "prompts.limit=6", "batch_size=4")


@pytest.mark.slow
def test_quick_bench_prints_every_figure(tmp_path, capsys):
    data = bench_main(["--quick", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    for needle in ("matmul rate (measured", "FLOPs per image-step", "baseline (diffusers loop)",
                   "shardgen (jobs.generate)", "images/hour", "denoise MFU", "e2e MFU", "speed-up shardgen / baseline",
                   "PSNR shardgen vs baseline", "GPU idle in steady state", "peak memory"):
        assert needle in out, needle
    s = data["summary"]
    assert s["baseline_images_per_hour"] > 0 and s["shardgen_images_per_hour"] > 0 and s["speedup"] > 0
    assert s["psnr_first"] > 40  # float64 on a CPU: the same pixels up to the odd rounding
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["shardgen"]["ok"] == 4


@pytest.mark.slow
def test_diagnostic_runs_split_the_difference_to_the_baseline(tmp_path, capsys):
    data = bench_main(["--quick", "--accel", "eager,batch1", "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert "diagnostic eager:" in out and "diagnostic batch1:" in out and "vs baseline" in out
    acc = data["summary"]
    # float64 on a CPU: neither the batch nor compilation moves a pixel
    assert acc["accel_eager"]["psnr_vs_baseline"] > 40 and acc["accel_batch1"]["psnr_vs_baseline"] > 40
    assert data["accel"]["batch1"]["ok"] == 4


@pytest.mark.slow
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


@pytest.mark.slow
def test_lossy_options_run_and_are_recorded(tmp_path):
    from shardgen.dataio.verify import read_shard_members

    cfg = compose_cfg(f"run_dir={tmp_path / 'lossy'}", "first_block_cache=0.5", "fp8=true", *FAST)
    result = run(cfg)
    assert result.ok == 6
    metas = [json.loads(m["json"]) for tar in (tmp_path / "lossy" / "shards").glob("*.tar")
             for m in read_shard_members(tar).values()]
    assert metas and all(m["lossy"] == {"first_block_cache": 0.5, "fp8": True} for m in metas)


def test_float8_linear_is_close_to_linear_and_reversible():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    x = torch.randn(5, 7, 64)
    ref = block(x)
    q = torch.nn.Sequential(accel.Float8Linear(block[0]), block[1], accel.Float8Linear(block[2]))
    out = q(x)
    assert out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < 0.08  # e4m3: 3 mantissa bits, row-wise scales
    assert q[0]._original is block[0]


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


def test_compile_auto_is_on_for_cuda_dp_only_and_off_on_this_cpu(tmp_path):
    from shardgen.config.validate import ConfigError, validate_config
    from shardgen.run.generation import GenSettings

    assert accel.resolve_compile("auto", "cuda", "dp") and accel.resolve_compile("auto", "cuda:1", "dp")
    assert not accel.resolve_compile("auto", "cpu", "dp")
    assert not accel.resolve_compile("auto", "cuda", "tp")  # model-parallel: only when asked for
    assert accel.resolve_compile(True, "cpu", "tp") and not accel.resolve_compile(False, "cuda", "dp")
    cfg = compose_cfg(f"run_dir={tmp_path}")
    assert cfg.compile == "auto" and cfg.cfg_batching is False
    assert GenSettings.from_cfg(cfg).accel.compile is (torch.cuda.is_available() and cfg.device != "cpu")
    with pytest.raises(ConfigError, match="compile='sometimes': use true, false or auto"):
        validate_config(compose_cfg(f"run_dir={tmp_path}", "compile=sometimes"))


def test_compile_cache_dir_defaults_under_shardgen_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("SHARDGEN_CACHE", str(tmp_path / "cache"))
    assert accel.compile_cache_dir() == str(tmp_path / "cache" / "inductor")
    assert (tmp_path / "cache" / "inductor").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert accel.compile_cache_dir() == str(tmp_path / "mine")  # the user's choice wins


@pytest.mark.parametrize("model, cls", [("flux_dev", "FluxPipeline"), ("flux2_dev", "Flux2Pipeline"),
                                        ("qwen_image", "QwenImagePipeline")])
def test_baseline_is_called_with_the_jobs_arguments_prompt_by_keyword(tmp_path, model, cls):
    """Equal work: the seed loop gets the job's generation arguments (true CFG included) and the prompt by
    keyword (Flux2Pipeline's first parameter is ``image``); every argument binds to the real signature."""
    import inspect

    import diffusers

    from shardgen.bench.ways import baseline_kwargs

    call = getattr(diffusers, cls).__call__
    pipe = type("Pipe", (), {"__call__": call})()
    cfg = compose_cfg(f"run_dir={tmp_path}", f"model={model}", "steps=3")
    kw = baseline_kwargs(pipe, cfg, "a cat", 7)
    inspect.signature(call).bind(pipe, **kw)  # raises on an argument the pipeline does not take
    assert kw["prompt"] == "a cat" and kw["num_inference_steps"] == 3 and "output_type" not in kw
    assert kw["generator"].initial_seed() == 7
    if cls == "QwenImagePipeline":  # true CFG: the job's scale and negative prompt, so both do the same work
        assert kw["true_cfg_scale"] == 4.0 and kw["negative_prompt"] == " "
    else:
        assert "negative_prompt" not in kw and kw["guidance_scale"] == cfg.guidance


def test_bench_prompts_span_one_to_seventy_words():
    from shardgen.bench.main import bench_prompts

    lengths = [len(p.split()) for p in bench_prompts(16)]
    assert min(lengths) == 1 and max(lengths) == 70 and len(set(lengths)) >= 6


@pytest.mark.slow
def test_run_rank_takes_a_pipeline_and_a_batch_hook(tmp_path):
    from shardgen.models.loader import load_pipeline, torch_dtype
    from shardgen.run.runner import run_rank

    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", *FAST)
    pipe = load_pipeline(cfg.model, torch_dtype(cfg.dtype), torch.device("cpu"))
    events = []
    result = run_rank(cfg, pipeline=pipe, on_batch=lambda event, worker: events.append((event, worker.pipe is pipe)))
    assert result.ok == 6
    assert events == [("start", True), ("end", True)] * 2  # 6 prompts in batches of 4: two batches
    assert shard_images(tmp_path / "run") == shard_images_of_plain_run(tmp_path)


def shard_images_of_plain_run(tmp_path):
    run(compose_cfg(f"run_dir={tmp_path / 'plain'}", *FAST))
    return shard_images(tmp_path / "plain")
