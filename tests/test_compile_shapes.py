"""One shape per batch and compile=auto's choice, on CPU: a padded short batch gives the bytes of
an unpadded one, Qwen-Image's compiled blocks serve every text length with one graph, and compile=auto
compiles only where the work left pays for the compilation, from recorded or prior figures."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from jobs.generate import run
from shardgen.speed import autocompile as AC
from shardgen.speed.accel import AccelError, AccelOptions
from tests.conftest import compose_cfg, write_lines
from tests.test_generate import shard_images

FAST = ("height=16", "width=16", "steps=1", "progress=false")


def test_a_padded_short_batch_gives_the_bytes_of_an_unpadded_one(tmp_path, monkeypatch):
    """compile=true pads every short batch (here 7 prompts in batches of 4: the last has 3) to the batch size;
    torch.compile is made the identity, so only the padding differs from the eager run."""
    f = write_lines(tmp_path / "p.txt", [f"prompt number {i} " + "word " * (i * 7) for i in range(7)])
    calls = []
    from shardgen.run import generation

    real = generation.pipeline_kwargs
    monkeypatch.setattr(generation, "pipeline_kwargs",
                        lambda pipe, s, p, *rest, **kw: calls.append(len(p)) or real(pipe, s, p, *rest, **kw))
    eager = run(compose_cfg(f"run_dir={tmp_path / 'eager'}", f"prompts.path={f}", "batch_size=4", *FAST))
    assert calls == [4, 3]
    calls.clear()
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    padded = run(compose_cfg(f"run_dir={tmp_path / 'padded'}", f"prompts.path={f}", "batch_size=4", "compile=true", *FAST))
    assert calls == [4, 4]  # the short batch was filled up to the compiled shape
    assert (eager.ok, padded.ok) == (7, 7)
    a, b = shard_images(tmp_path / "eager"), shard_images(tmp_path / "padded")
    assert len(a) == 7 and a == b  # the copies' outputs are dropped; the real samples are byte-identical


def test_qwen_image_compiled_blocks_serve_every_text_length_with_one_graph(monkeypatch):
    """Text buckets of 128 and 256 tokens, batch 1 and 2: one dynamo graph per block class (dynamo's eager
    backend: the tracing and guards of the real compile, without inductor's code generation)."""
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.speed import accel
    from tests.test_dummy_models import SMALL

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **dict(kw, backend="eager")))
    torch._dynamo.reset()
    pipe = build_dummy_pipeline("QwenImagePipeline", "cpu", torch.float32, overrides=SMALL["QwenImagePipeline"])
    prompts = ["a cat", "word " * 150, "an astronaut riding a horse " * 3]

    def pixels(batch):
        out = pipe(prompt=batch, num_inference_steps=2, height=32, width=32, output_type="np",
                   generator=[torch.Generator().manual_seed(i) for i in range(len(batch))])
        return (out.images * 255).round().astype(np.uint8)

    plain = [pixels([p]) for p in prompts]
    graphs = AC.compiled_graphs()
    try:
        done = accel.prepare(pipe, accel.AccelOptions(compile=True, sdpa="default", fused_blocks=False))
        assert done["qwen"]["text_length_dynamic"]
        compiled = [pixels([p]) for p in prompts]
        assert AC.compiled_graphs() - graphs == 1  # before: one graph per text bucket
        pixels(prompts[:2])
        assert AC.compiled_graphs() - graphs == 2  # a batch size is a shape: why the job pads its short batches
    finally:
        accel.prepare(pipe, accel.AccelOptions(sdpa="default"))
        torch._dynamo.reset()
    for a, b in zip(plain, compiled):
        np.testing.assert_allclose(a.astype(int), b.astype(int), atol=1)


def test_flux_compiled_fused_blocks_compile_one_graph_per_block_class(monkeypatch):
    """FLUX.1's first single block gets the double blocks' outputs, the others the single blocks' (views of one
    buffer when eager): one graph per block class, not a second single-block graph (a whole extra compilation on a
    fresh cache). Dynamo's eager backend: the real tracing and guards. The pixels are the stock blocks'."""
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.speed import accel
    from tests.test_dummy_models import SMALL

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **dict(kw, backend="eager")))
    torch._dynamo.reset()
    small = SMALL["FluxPipeline"]
    pipe = build_dummy_pipeline("FluxPipeline", "cpu", torch.float32, overrides={
        **small, "transformer": {**small["transformer"], "num_layers": 3, "num_single_layers": 4}})
    prompts = ["a cat", "an astronaut riding a horse " * 3]

    def pixels():
        out = pipe(prompt=prompts, num_inference_steps=2, height=32, width=32, output_type="np",
                   max_sequence_length=64, generator=[torch.Generator().manual_seed(i) for i in range(2)])
        return (out.images * 255).round().astype(np.uint8)

    plain = pixels()
    graphs = AC.compiled_graphs()
    try:
        done = accel.prepare(pipe, accel.AccelOptions(compile=True, sdpa="default", fused_blocks=True))
        assert done["compiled_blocks"] == 7
        compiled = pixels()
        assert AC.compiled_graphs() - graphs == 2, "one graph for the double blocks, one for the single blocks"
        pixels()
        assert AC.compiled_graphs() - graphs == 2
    finally:
        accel.prepare(pipe, accel.AccelOptions(sdpa="default"))
        torch._dynamo.reset()
    np.testing.assert_allclose(plain.astype(int), compiled.astype(int), atol=1)


@dataclass
class _S:
    """The GenSettings fields AutoCompile reads."""

    accel: AccelOptions = AccelOptions()
    batch_size: int = 4


def _auto(tmp_path, left, record=None):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "records.json"
    if record is not None:
        path.write_text(json.dumps({"k": record}))
    return AC.AutoCompile("k", remaining=lambda: left, path=path)


def test_compile_auto_runs_the_first_batch_eagerly_then_compiles_only_when_it_pays(tmp_path, caplog):
    from dataclasses import replace

    from shardgen.run.generation import GenSettings

    s = GenSettings(height=1024, width=1024, steps=28, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=512, model="flux_dev", strategy="dp", batch_size=4, compile_auto=True)
    few, many = _auto(tmp_path, left=20), _auto(tmp_path / "b", left=400)
    for auto in (few, many):
        for first, seconds in ((True, 26.0), (False, 20.0)):  # the first batch pays one-time costs: not the figure
            s1 = auto.settings(replace(s, accel=replace(s.accel, compile=True)))
            assert not s1.accel.compile and auto.decided is None  # no figures yet: two batches run eagerly
            auto.observe(s1, 4, seconds)  # then 5 s per sample eager
    with caplog.at_level("INFO", logger="shardgen.compile"):
        assert not few.settings(s).accel.compile  # 20 x 5 s x (1 - 1/1.35) = 26 s saved < 45 s (cold prior)
        assert many.settings(s).accel.compile     # 400 x 5 s x 0.26 = 519 s saved > 45 s
    assert "20 samples left here x 5.00 s eager" in caplog.text and "staying eager" in caplog.text
    assert json.loads((tmp_path / "records.json").read_text())["k"]["eager_s"] == 5.0
    assert "2 eager batches, 5.00 s/sample" in few.summary()  # the rate after the warm-up batch (6.50 s), not 5.75


def test_compile_auto_decides_from_records_before_the_first_batch_and_records_what_it_measured(tmp_path):
    warm = {"eager_s": 5.0, "compiled_s": 3.6, "compiled_before": True, "compile_warm_s": 8.0, "compile_cold_s": 45.0}
    auto = _auto(tmp_path, left=24, record=warm)
    assert auto.settings(_S()).accel.compile  # 24 x 5 x (1 - 3.6/5) = 34 s > 8 s warm: compiled from batch 1
    assert not _auto(tmp_path, left=24, record=dict(warm, compiled_before=False)).settings(_S()).accel.compile
    assert not _auto(tmp_path, left=10**6, record=dict(warm, compiled_s=5.5)).settings(_S()).accel.compile  # no gain
    fresh = _auto(tmp_path / "b", left=10**6, record={"eager_s": 5.0})
    s = fresh.settings(_S())
    for seconds in (60.0, 14.4, 14.4):  # the first compiled batch paid the compile
        fresh.observe(s, 4, seconds)
    rec = json.loads((tmp_path / "b" / "records.json").read_text())["k"]
    assert rec["compiled_s"] == pytest.approx(3.6) and rec["compile_cold_s"] == pytest.approx(45.6)
    assert rec["compiled_before"] is True
    assert "compiled batches, first 15.00 s/sample, steady 3.60 s/sample" in fresh.summary()


@pytest.mark.parametrize("compiled_s, eager_s, left, compiles", [
    (3.61, 3.92, 16, False),  # FLUX.1-dev, 24 prompts (H200): fused eager is nearly as fast; lost 3% compiled
    (3.61, 3.92, 400, True),
    (2.36, 2.99, 16, False),  # Qwen-Image, 24 prompts: 16 x 2.99 x (1 - 2.36/2.99) = 10 s saved < 1.2 x 15 s
    (2.36, 2.99, 32, True),   # Qwen-Image, 40 prompts: 20 s saved
])
def test_compile_auto_on_a_warm_cache_weighs_the_warm_cost_against_the_work_left(tmp_path, compiled_s, eager_s, left,
                                                                                compiles):
    """A cache a compiled job filled (no eager figure recorded): two eager batches, the second timed, then the work
    left x the gain against the warm cost (its 15 s prior here) x the margin, paid on the main thread."""
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": {"compiled_before": True, "compiled_s": compiled_s}}))
    auto = AC.AutoCompile("k", remaining=lambda: left, path=path)
    for seconds in (4 * eager_s * 1.2, 4 * eager_s):
        assert auto.decided is None
        auto.observe(auto.settings(_S()), 4, seconds)
    assert auto.settings(_S()).accel.compile is compiles and auto.decided is compiles
    assert json.loads(path.read_text())["k"]["eager_s"] == pytest.approx(eager_s)
    assert "s saved vs 15 s x 1.2 to compile (warm cache, prior)" in auto.reason


@pytest.mark.parametrize("record, left, compiles, cost", [
    # FLUX.2-dev, warm cache (H200), with a compile thread's time (compile_background_s), which is not read
    ({"eager_s": 4.59, "compiled_s": 3.73, "compile_background_s": 78.0, "compile_warm_s": 11.1}, 36, True,
     "31 s saved vs 11 s x 1.2 to compile (warm cache)"),
    ({"eager_s": 4.59, "compiled_s": 3.73, "compile_background_s": 78.0, "compile_warm_s": 11.1}, 8, False,
     "7 s saved vs 11 s x 1.2 to compile (warm cache)"),
    # Qwen-Image: only a thread's time recorded, no warm cost: the warm prior (15 s)
    ({"eager_s": 3.19, "compiled_s": 2.2, "compile_background_s": 17.0, "unknown": [1, {"x": None}]}, 40, True,
     "40 s saved vs 15 s x 1.2 to compile (warm cache, prior)"),
])
def test_records_with_fields_this_version_does_not_read_are_used_and_kept(tmp_path, record, left, compiles, cost):
    """A records.json with fields the decision does not read (``compile_background_s``, anything else) is read as
    usual: its eager, compiled and warm figures decide before the first batch, and the other fields stay in the file
    when the process records what it measured."""
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": dict(record, compiled_before=True)}))
    auto = AC.AutoCompile("k", remaining=lambda: left, path=path)
    s = auto.settings(_S())  # decided before the first batch, from the records
    assert auto.decided is compiles and s.accel.compile is compiles
    assert cost in auto.reason, auto.reason
    if compiles:  # timed from here: its cost is what the next process reads
        for seconds in (4 * 3.73 + 11.1, 4 * 3.73):
            auto.observe(s, 4, seconds)
            s = auto.settings(s)
            assert s.accel.compile
        kept = json.loads(path.read_text())["k"]
        assert kept["compile_warm_s"] == pytest.approx(11.1) and kept["compiled_s"] == pytest.approx(3.73)
        assert {k: kept[k] for k in record if k not in ("compiled_s", "compile_warm_s")} == {
            k: v for k, v in record.items() if k not in ("compiled_s", "compile_warm_s")}
        assert "compile=auto compiled; 2 compiled batches" in auto.summary()


def test_a_run_of_several_row_sizes_keeps_its_own_figures_and_expects_a_compile_per_size(tmp_path):
    """prompts.row_settings with three sizes: the records key names the shape set (a single-size run's figures are not
    reused), and without a recorded cost the prior is paid once per size (one graph set each)."""
    import dataclasses
    from types import SimpleNamespace

    from shardgen.run.generation import GenSettings

    s = GenSettings(height=64, width=64, steps=2, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=512, model="tiny", strategy="dp", batch_size=4, compile_auto=True)
    pipe = SimpleNamespace(_execution_device=torch.device("cpu"), transformer=torch.nn.Identity())
    one, mixed = AC.record_key(pipe, s), AC.record_key(pipe, s, ["64x64", "48x80", "80x48"])
    assert one != mixed and '"shapes": ["48x80", "64x64", "80x48"]' in mixed
    assert AC.record_key(pipe, s, ["64x64"]) == one  # one shape is the run's own
    attention8 = dataclasses.replace(s, accel=dataclasses.replace(s.accel, sdpa="fp8"))
    assert '"sdpa": "fp8"' in AC.record_key(pipe, attention8) and '"sdpa"' not in one  # 8-bit attention: its own
    auto = AC.AutoCompile("k", remaining=lambda: 40, path=tmp_path / "r.json", shapes=3)
    for seconds in (24.0, 20.0):
        auto.observe(auto.settings(_S()), 4, seconds)
    assert not auto.settings(_S()).accel.compile  # 40 x 5 s x (1 - 1/1.35) = 52 s saved
    assert auto.decided is False and "vs 135 s x 1.2 to compile (cold cache, prior)" in auto.reason  # 3 x 45 s


@pytest.mark.parametrize("content", [b"", b"\x00garbage", b"[1, 2]", b'{"k": "not a dict"}', b'{"k": {"eager_s": "x"}}',
                                     b'{"k": {"eager_s": Infinity, "compiled_s": 1}}', b'{"k": {"eager_s": NaN}}'])
def test_compile_auto_ignores_damaged_records(tmp_path, content):
    path = tmp_path / "records.json"
    path.write_bytes(content)
    auto = AC.AutoCompile("k", remaining=lambda: 10**6, path=path)
    assert auto.settings(_S()).accel.compile is False and auto.decided is None  # priors: measure batches first
    auto.observe(_S(), 4, 24.0)
    auto.observe(_S(), 4, 20.0)
    assert json.loads(path.read_text())["k"]["eager_s"] == 5.0  # the file is whole again


def test_compile_auto_is_off_on_cpu_and_when_compile_is_set():
    from shardgen.run.generation import GenSettings

    cfg = compose_cfg("run_dir=/tmp/x")
    assert not GenSettings.from_cfg(cfg, "dp").compile_auto  # this machine has no GPU
    assert not GenSettings.from_cfg(compose_cfg("run_dir=/tmp/x", "compile=true"), "dp").compile_auto  # asked for


def test_compile_auto_warms_a_fresh_cache_on_the_main_thread_and_the_next_job_compiles_from_its_first_batch(
        tmp_path, monkeypatch, caplog):
    """The job's path on CUDA (made possible on CPU: the CUDA check faked, torch.compile the identity). A fresh
    cache: two batches eager, the second timed, then compiled on the main thread (its cost paid there, recorded).
    The next job on that cache decides from the records before its first batch: every batch compiled (padded), the
    warm cost recorded, the fields it does not read kept. Both jobs give the same images (padding's bytes against
    an eager run: test_a_padded_short_batch_gives_the_bytes_of_an_unpadded_one)."""
    import logging

    from shardgen.speed import techniques

    f = write_lines(tmp_path / "p.txt", [f"prompt {i}" for i in range(14)])  # batches 4, 4 (eager, timed), 4, 2
    monkeypatch.setattr(techniques, "resolve_compile", lambda value, device="auto", strategy="dp": True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(AC, "PRIOR_COLD_S", 0.0)
    monkeypatch.setattr(AC, "records_path", lambda: tmp_path / "records.json")
    with caplog.at_level(logging.INFO, logger="shardgen"):
        cold = run(compose_cfg(f"run_dir={tmp_path / 'cold'}", f"prompts.path={f}", "batch_size=4", *FAST))
    assert re.search(r"compile=auto: compiling \(\d+ samples left here x [\d.]+ s eager .*\(cold cache, prior\)\)",
                     caplog.text), caplog.text[-2000:]
    assert "compile=auto compiled; 2 eager batches" in caplog.text and "2 compiled batches" in caplog.text
    records = json.loads((tmp_path / "records.json").read_text())
    (key, record), = records.items()
    assert record["compiled_before"] is True and "compile_cold_s" in record and '"model": "tiny"' in key
    # on CPU the identity "compile" gains nothing: the figures a GPU would record, and a field the decision does not read
    record.update(compiled_s=record["eager_s"] / 1.4, compile_warm_s=0.001, compile_background_s=0.001)
    (tmp_path / "records.json").write_text(json.dumps(records))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardgen"):
        warm = run(compose_cfg(f"run_dir={tmp_path / 'warm'}", f"prompts.path={f}", "batch_size=4", *FAST))
    assert (cold.ok, warm.ok) == (14, 14)
    assert re.search(r"compile=auto: compiling \(\d+ samples left here x [\d.]+ s eager x \(1 - 1/1\.40 speed-up\) "
                     r"= [\d.]+ s saved vs 0 s x 1\.2 to compile \(warm cache\)", caplog.text), caplog.text[-2000:]
    assert "compile=auto compiled; 4 compiled batches" in caplog.text
    (key2, record), = json.loads((tmp_path / "records.json").read_text()).items()
    assert key2 == key and "compile_warm_s" in record and record["compile_background_s"] == 0.001
    assert shard_images(tmp_path / "cold") == shard_images(tmp_path / "warm")


@pytest.mark.slow  # two real inductor compilations on the CPU (~10 s)
def test_compile_cache_counts_say_whether_a_warm_cache_was_hit(monkeypatch, tmp_path):
    """The job's "compiled graphs" line says where its graphs came from: a fresh cache misses, the same graph
    compiled again (a requeued job: dynamo state reset) is served by inductor's FX graph cache."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    counters.clear()
    torch._dynamo.reset()
    try:
        x = torch.randn(16)
        torch.compile(lambda t: (t * 3).cos() + 1)(x)
        assert "fx graph cache 0 hit / 1 miss" in AC.compile_cache_counts()
        torch._dynamo.reset()
        torch.compile(lambda t: (t * 3).cos() + 1)(x)
        assert "fx graph cache 1 hit / 1 miss" in AC.compile_cache_counts()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("force, left, compiles", [("eager", 10**6, False), ("main", 1, True)])
def test_a_forced_compile_path_is_taken_whatever_the_figures_say(tmp_path, monkeypatch, force, left, compiles):
    monkeypatch.setenv(AC.FORCE_ENV, force)
    # figures that would compile from the first batch (and, with one sample left, never)
    record = {"eager_s": 5.0, "compiled_s": 1.0, "compiled_before": True, "compile_warm_s": 0.1}
    auto = _auto(tmp_path, left=left, record=record)
    for _ in range(AC.EAGER_BATCHES):  # forced: the eager batches run first, the recorded eager speed is not used
        s = auto.settings(_S())
        assert not s.accel.compile
        auto.observe(s, 4, 8.0)
    assert auto.settings(_S()).accel.compile is compiles
    assert f"forced by SHARDGEN_COMPILE_AUTO={force}, 2.00 s/sample eager" in auto.reason
    monkeypatch.setenv(AC.FORCE_ENV, "sometimes")
    with pytest.raises(AccelError, match="SHARDGEN_COMPILE_AUTO='sometimes': use one of"):
        _auto(tmp_path, left=1)
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match="SHARDGEN_COMPILE_AUTO='sometimes': use one of"):
        validate_config(compose_cfg())  # refused with the config, before any weight is read


def test_every_family_declares_blocks_to_compile_and_an_unknown_transformer_runs_eagerly(caplog):
    """compile: auto compiles the repeated blocks: each family's dummy transformer has some (diffusers' SD3 lists
    none: its family declares them), and a transformer with none runs eagerly instead of failing as compile=true."""
    from types import SimpleNamespace

    from shardgen.families.base import dummy_models
    from shardgen.run.generation import GenSettings
    from shardgen.run.runner import _without_auto_compile_where_nothing_compiles
    from shardgen.speed.blocks import repeated_blocks

    for name, (family, dummy) in dummy_models().items():
        spec = dummy.components["transformer"]
        cls = getattr(__import__("diffusers"), spec.cls)
        names = getattr(cls, "_repeated_blocks", None) or family.repeated_blocks.get(spec.cls)
        assert names, f"{name}: {spec.cls} has no repeated blocks to compile"
    s = GenSettings(height=64, width=64, steps=1, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=32, model="x", strategy="dp", batch_size=1, compile_auto=True,
                    accel=AccelOptions(compile=True))
    plain = SimpleNamespace(transformer=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert not repeated_blocks(plain.transformer)
    with caplog.at_level("INFO", logger="shardgen"):
        out = _without_auto_compile_where_nothing_compiles(s, plain)
    assert not out.accel.compile and not out.compile_auto and "Sequential has no repeated blocks" in caplog.text
    compile_true = _without_auto_compile_where_nothing_compiles(dataclasses.replace(s, compile_auto=False), plain)
    assert compile_true.accel.compile  # compile=true: as asked (and refused by prepare, saying to set compile=false)


def test_a_process_that_stayed_eager_records_its_steady_eager_speed(tmp_path):
    auto = _auto(tmp_path, left=1)  # one sample left: compiling never pays
    for seconds in (14.0, 12.0, 10.0, 10.4, 9.6):  # the second batch, timed to decide, is not yet steady
        s = auto.settings(_S())
        auto.observe(s, 4, seconds)
    assert auto.decided is False
    assert json.loads((tmp_path / "records.json").read_text())["k"]["eager_s"] == 3.0  # the decision's 12 s / 4
    auto.finish()
    assert json.loads((tmp_path / "records.json").read_text())["k"]["eager_s"] == pytest.approx(2.55)  # median of 2-5


def test_a_family_whose_fused_eager_blocks_match_compiled_ones_stays_eager_on_a_long_run(tmp_path):
    """FLUX.2's fused eager blocks run as fast as its compiled ones: without a record, compile=auto expects the
    family's measured speed-up, not the generic one, and does not pay a compile for ~1%; with fused_blocks off
    (stock eager blocks) the generic prior applies."""
    from dataclasses import replace

    from diffusers import Flux2Pipeline, FluxPipeline

    from shardgen.run.generation import GenSettings

    flux2 = object.__new__(Flux2Pipeline)
    assert AC.prior_speedup(flux2, fused_blocks=True) == 1.01
    assert AC.prior_speedup(flux2, fused_blocks=False) == AC.PRIOR_SPEEDUP
    assert AC.prior_speedup(object.__new__(FluxPipeline), fused_blocks=True) == 1.02
    assert AC.prior_speedup(object.__new__(FluxPipeline), fused_blocks=False) == AC.PRIOR_SPEEDUP
    s = GenSettings(height=1024, width=1024, steps=8, guidance=4.0, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=512, model="flux2_dev", strategy="dp", batch_size=4, compile_auto=True)
    ways = {}
    for fused in (True, False):
        auto = replace(_auto(tmp_path / str(fused), left=400), prior_speedup=AC.prior_speedup(flux2, fused))
        for seconds in (16.0, 14.8):  # 3.7 s per sample eager
            auto.observe(auto.settings(s), 4, seconds)
        ways[fused] = auto.settings(s).accel.compile
    assert ways == {True: False, False: True}  # 400 x 3.7 x (1 - 1/1.01) = 15 s < 45 s; x 0.26 = 384 s > 45 s


def test_a_long_fp8_run_stays_eager_where_compiled_blocks_are_slower_than_the_fused_ones(tmp_path):
    """With fp8=true FLUX.1's fused eager blocks write float8 rows that its compiled blocks do not (H100: 2.24 s per
    sample eager, 2.47 compiled): without a record, a run of 100,000 samples stays eager, where the bf16 prior
    (1.02x) would compile it; fp8 on stock eager blocks keeps the generic prior."""
    from dataclasses import replace

    from diffusers import FluxPipeline, QwenImagePipeline

    from shardgen.run.generation import GenSettings

    flux = object.__new__(FluxPipeline)
    assert AC.prior_speedup(flux, fused_blocks=True, fp8=True) == 0.91
    assert AC.prior_speedup(flux, fused_blocks=False, fp8=True) == AC.PRIOR_SPEEDUP
    assert AC.prior_speedup(object.__new__(QwenImagePipeline), fused_blocks=True, fp8=True) == 0.97  # none for fp8
    s = GenSettings(height=1024, width=1024, steps=28, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=512, model="flux_dev", strategy="dp", batch_size=4, compile_auto=True)
    ways = {}
    for fp8 in (True, False):
        auto = replace(_auto(tmp_path / str(fp8), left=100_000),
                       prior_speedup=AC.prior_speedup(flux, fused_blocks=True, fp8=fp8))
        for seconds in (9.4, 8.96):  # 2.24 s per sample eager
            auto.observe(auto.settings(s), 4, seconds)
        ways[fp8] = auto.settings(s).accel.compile
    assert ways == {True: False, False: True}  # 100,000 x 2.24 x (1 - 1/1.02) = 4,392 s > 54 s


def test_records_that_make_compiling_pay_at_once_compile_before_the_first_batch(tmp_path, monkeypatch):
    """The GPU matrix's requeued job: records of a long job whose compilation costs next to nothing compile before
    the first batch."""
    monkeypatch.delenv(AC.FORCE_ENV, raising=False)
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": dict(eager_s=100.0, compiled_s=50.0, compile_warm_s=0.001, compiled_before=True)}))
    auto = AC.AutoCompile("k", remaining=lambda: 4, path=path)
    s = auto.settings(_S())
    assert auto.decided is True and s.accel.compile and "to compile (warm cache)" in auto.reason


def _tuning_auto(tmp_path, left, records=None):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "records.json"
    if records is not None:
        path.write_text(json.dumps(records))
    return AC.AutoCompile("tuned", untuned_key="untuned", remaining=lambda: left, path=path)


def _two_eager_batches(auto, eager_s=3.91):
    s = auto.settings(_S(accel=AccelOptions(compile=True)))
    for _ in range(AC.EAGER_BATCHES):
        auto.observe(s, 4, 4 * eager_s)
    return auto.settings(_S(accel=AccelOptions(compile=True)))


def test_compile_tuning_auto_drops_the_kernel_tuning_when_the_work_left_does_not_pay_for_it(tmp_path, caplog):
    """FLUX.1-dev's figures on an H200 (3.91 s/sample eager), a fresh cache: 88 samples left compile without the
    tuning (~2% slower steps, ~25 s less compiling), 2,000 with it, 20 not at all; what each compiled batch measures
    goes under its own variant's key, so the next process reads the cost of what it will compile."""
    with caplog.at_level("INFO", logger="shardgen.compile"):
        short = _tuning_auto(tmp_path / "short", left=88)
        s = _two_eager_batches(short)
    assert s.accel.compile and not s.accel.compile_tuning and not short.tuned
    assert re.search(r"compile=auto: compiling \(88 samples left here x 3\.91 s eager .*; without kernel tuning: .* "
                     r"= \d+ s net, more than \d+ s net with it\)", caplog.text), caplog.text
    for seconds in (80.0, 14.4):
        short.observe(s, 4, seconds)
    records = json.loads((tmp_path / "short" / "records.json").read_text())
    assert records["untuned"]["compiled_before"] and records["untuned"]["compile_cold_s"] == pytest.approx(65.6)
    assert records["untuned"]["eager_s"] == pytest.approx(3.91) and "compiled_before" not in records["tuned"]

    long = _tuning_auto(tmp_path / "long", left=2000)
    s = _two_eager_batches(long)
    assert s.accel.compile and s.accel.compile_tuning and long.key == "tuned"
    few = _tuning_auto(tmp_path / "few", left=20)
    assert not _two_eager_batches(few).accel.compile and few.tuned


def test_compile_tuning_auto_follows_the_cache_a_variant_left(tmp_path):
    """The untuned graphs compiled before (a warm cache for them) and the tuned ones never: a job of 300 samples
    compiles untuned from its first batch (the eager figure recorded); with the tuned graphs warm too, it tunes."""
    untuned = {"compiled_before": True, "compile_warm_s": 6.0, "compiled_s": 2.95, "eager_s": 3.91}
    auto = _tuning_auto(tmp_path / "a", left=300, records={"tuned": {"eager_s": 3.91}, "untuned": untuned})
    s = auto.settings(_S(accel=AccelOptions(compile=True)))
    assert s.accel.compile and not s.accel.compile_tuning
    warm_both = {"tuned": {"eager_s": 3.91, "compiled_before": True, "compile_warm_s": 6.0, "compiled_s": 2.89},
                 "untuned": untuned}
    s = _tuning_auto(tmp_path / "b", left=300, records=warm_both).settings(_S(accel=AccelOptions(compile=True)))
    assert s.accel.compile and s.accel.compile_tuning


def test_a_forced_main_thread_compile_still_chooses_the_tuning_from_the_figures(tmp_path, monkeypatch):
    """The GPU matrix forces the path (SHARDGEN_COMPILE_AUTO=main) on 12 prompts: it compiles, untuned, whatever the
    net saving; a user's compile_tuning=false is never overridden."""
    monkeypatch.setenv(AC.FORCE_ENV, "main")
    auto = _tuning_auto(tmp_path, left=8)
    s = _two_eager_batches(auto)
    assert s.accel.compile and not s.accel.compile_tuning
    off = _tuning_auto(tmp_path / "off", left=2000)
    s = off.settings(_S(accel=AccelOptions(compile=True, compile_tuning=False)))
    for _ in range(AC.EAGER_BATCHES):
        off.observe(s, 4, 16.0)
    assert not off.settings(_S(accel=AccelOptions(compile=True, compile_tuning=False))).accel.compile_tuning


@pytest.mark.parametrize("overrides, tuned, chooses", [
    ((), True, True),                                   # the default: compile=auto chooses
    (("compile_tuning=false",), False, False),
    (("compile_tuning=true",), True, False),
    (("compile=true",), True, False),                   # compile=true: tuned, as ever
])
def test_compile_tuning_auto_is_chosen_only_under_compile_auto(overrides, tuned, chooses):
    from shardgen.run.generation import GenSettings

    s = GenSettings.from_cfg(compose_cfg("run_dir=/tmp/x", "device=cuda", *overrides), "dp")
    assert (s.accel.compile_tuning, s.tuning_auto) == (tuned, chooses)


@pytest.mark.parametrize("prompts, compiles, tuned", [
    (96, False, True),    # H200: eager all the way, 362.9 s (compile=true on 24 prompts: 134.3 s against 100.8)
    (420, False, True),   # compiling costs more than the ~2% it gains back over 412 samples
    (1000, True, True),   # the ~2% is the kernel tuning's: untuned compiled blocks would gain nothing
])
def test_flux1_dev_on_a_fresh_cache_compiles_only_for_a_run_long_enough(tmp_path, prompts, compiles, tuned):
    """FLUX.1-dev's default eager path (fused blocks, CUDA graphs) runs within ~2% of its compiled blocks (its family's
    measured prior): a first job on a fresh cache (eager 3.64 s/sample, the H200's figure) compiles only where the
    work left pays for it."""
    from dataclasses import replace

    from diffusers import FluxPipeline

    auto = replace(_tuning_auto(tmp_path, left=prompts - 8),
                   prior_speedup=AC.prior_speedup(object.__new__(FluxPipeline), fused_blocks=True))
    s = _two_eager_batches(auto, eager_s=3.64)
    assert (s.accel.compile, s.accel.compile_tuning) == (compiles, tuned), auto.reason


def test_a_compile_tuning_that_is_not_true_false_or_auto_is_refused_while_validating():
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"^compile_tuning='yes': use true, false or auto"):
        validate_config(compose_cfg("compile_tuning=yes"))


def test_compile_auto_counts_the_shards_this_job_already_made_as_done(tmp_path, monkeypatch, caplog):
    """16 prompts in shards of one batch: after the two timed batches (two shards made, their commits possibly still
    queued on the writer) the decision weighs the 8 samples left, not the run's 16."""
    import logging

    from shardgen.speed import techniques

    f = write_lines(tmp_path / "p.txt", [f"prompt {i}" for i in range(16)])
    monkeypatch.setattr(techniques, "resolve_compile", lambda value, device="auto", strategy="dp": True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(AC, "records_path", lambda: tmp_path / "records.json")
    with caplog.at_level(logging.INFO, logger="shardgen"):
        result = run(compose_cfg(f"run_dir={tmp_path / 'r'}", f"prompts.path={f}", "batch_size=4",
                                 "samples_per_shard=4", *FAST))
    assert result.ok == 16
    assert re.search(r"compile=auto: \w[\w ]* \(8 samples left here x [\d.]+ s eager", caplog.text), caplog.text
