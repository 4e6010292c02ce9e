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


@pytest.mark.parametrize("background", [False, True])
def test_flux_compiled_fused_blocks_compile_one_graph_per_block_class(monkeypatch, background):
    """FLUX.1's first single block gets the double blocks' outputs, the others the single blocks' (views of one
    buffer when eager): one graph per block class, not a second single-block graph (a whole extra compilation on a
    fresh cache). Compiled on a background thread too, from the arguments the eager blocks left (views there):
    the thread traces on what the compiled blocks pass. Dynamo's eager backend: the real tracing and guards.
    The pixels are the stock blocks'."""
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.speed import accel
    from shardgen.speed.background import state_of
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
        done = accel.prepare(pipe, accel.AccelOptions(compile=True, compile_background=background, sdpa="default",
                                                      fused_blocks=True))
        assert done["compiled_blocks"] == 7
        if background:
            state = state_of(pipe.transformer)
            pixels()  # eager, leaving the arguments
            assert state.start() and state.wait(120) and state.error is None
            assert AC.compiled_graphs() - graphs == 2, "the thread: one graph for each block class"
            assert state.switch()
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
    (2.36, 2.99, 16, False),  # Qwen-Image, 24 prompts: compiling in the background lost 4% to compile=false
    (2.36, 2.99, 32, True),   # Qwen-Image, 40 prompts: it gained 11%
])
def test_compile_auto_in_the_background_weighs_the_thread_against_the_work_left(tmp_path, compiled_s, eager_s, left,
                                                                                compiles):
    """A cache a compiled job filled (no eager figure recorded): two eager batches, the second timed, then the work
    left minus the thread's prior time (45 s), x the gain, minus what the thread slows the eager batches beside it."""
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": {"compiled_before": True, "compiled_s": compiled_s}}))
    auto = AC.AutoCompile("k", remaining=lambda: left, path=path, background=torch.nn.Identity())
    for seconds in (4 * eager_s * 1.2, 4 * eager_s):
        assert auto.decided is None
        auto.observe(auto.settings(_S()), 4, seconds)
    assert auto.decided is compiles
    assert json.loads(path.read_text())["k"]["eager_s"] == pytest.approx(eager_s)
    assert "0.2 x 45 s slower eager batches beside it" in auto.reason


@pytest.mark.parametrize("record, left, way", [
    # FLUX.2-dev, warm cache (H200): its thread took 78 s beside the eager batches, the main thread 11 s
    ({"eager_s": 4.59, "compiled_s": 3.73, "compile_background_s": 78.0, "compile_warm_s": 11.1}, 36, "main"),
    ({"eager_s": 4.59, "compiled_s": 3.73, "compile_background_s": 78.0, "compile_warm_s": 11.1}, 8, "eager"),
    # Qwen-Image: a 17 s thread; no main-thread figure (15 s prior): the background saves more
    ({"eager_s": 3.19, "compiled_s": 2.2, "compile_background_s": 17.0}, 40, "background"),
])
def test_compile_auto_compiles_on_the_main_thread_when_the_thread_would_starve(tmp_path, record, left, way):
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": dict(record, compiled_before=True)}))
    auto = AC.AutoCompile("k", remaining=lambda: left, path=path, background=torch.nn.Identity())
    s = auto.settings(_S())  # decided before the first batch, from the records
    assert (s.accel.compile, s.accel.compile_background) == {"main": (True, False), "background": (True, True),
                                                             "eager": (False, False)}[way]
    assert ("on the main thread" in auto.reason) is (way == "main")
    if way == "main":  # timed as a main-thread compilation from here: its cost is what the next process reads
        for seconds in (4 * 3.73 + 11.1, 4 * 3.73):
            auto.observe(s, 4, seconds)
            s = auto.settings(s)
            assert (s.accel.compile, s.accel.compile_background) == (True, False)
        assert json.loads(path.read_text())["k"]["compile_warm_s"] == pytest.approx(11.1)
        assert "compile=auto compiled; 2 compiled batches" in auto.summary()


def test_a_first_job_on_a_warm_cache_compiles_on_the_main_thread_without_a_thread_record(tmp_path):
    """FLUX.2-dev on an H200: the cache a compiled job filled, no eager or thread figure yet. With the
    30 s thread prior it went to the background (the thread took 60 s: 1.08x the seed loop); the main thread (the
    next job, 7 s) gave 1.17x. After its two eager batches (4.60 s/sample) with 32 left it now waits for the compile:
    32 x 4.60 x (1 - 3.72/4.60) - 15 s = 13 s saved, against (147 - 45 s) x 0.19 - 0.2 x 45 s = 10 s."""
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": {"compiled_before": True, "compiled_s": 3.72}}))
    auto = AC.AutoCompile("k", remaining=lambda: 32, path=path, background=torch.nn.Identity())
    for seconds in (4 * 4.60 * 1.2, 4 * 4.60):
        auto.observe(auto.settings(_S()), 4, seconds)
    s = auto.settings(_S())
    assert auto.decided and (s.accel.compile, s.accel.compile_background) == (True, False)
    assert "to compile on the main thread (warm cache, prior) = 13 s saved" in auto.reason


def test_a_run_of_several_row_sizes_keeps_its_own_figures_and_expects_a_compile_per_size(tmp_path):
    """prompts.row_settings with three sizes: the records key names the shape set (a single-size run's figures are not
    reused), and without a recorded cost the prior is paid once per size (one graph set each)."""
    from types import SimpleNamespace

    from shardgen.run.generation import GenSettings

    s = GenSettings(height=64, width=64, steps=2, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=512, model="tiny", strategy="dp", batch_size=4, compile_auto=True)
    pipe = SimpleNamespace(_execution_device=torch.device("cpu"), transformer=torch.nn.Identity())
    one, mixed = AC.record_key(pipe, s), AC.record_key(pipe, s, ["64x64", "48x80", "80x48"])
    assert one != mixed and '"shapes": ["48x80", "64x64", "80x48"]' in mixed
    assert AC.record_key(pipe, s, ["64x64"]) == one  # one shape is the run's own
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


def test_blocks_compiled_on_a_background_thread_serve_the_main_thread_without_compiling_again(monkeypatch):
    """compile=auto on CUDA compiles in the background (shardgen/speed/background.py): the first call runs
    eagerly and leaves each block class's arguments; a thread compiles from them; after ``switch`` the main
    thread's blocks find those graphs (dynamo's eager backend here: the tracing, guards and cache of the
    real compile, without inductor)."""
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.speed import accel
    from shardgen.speed.background import state_of
    from tests.test_dummy_models import SMALL

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **dict(kw, backend="eager")))
    torch._dynamo.reset()
    pipe = build_dummy_pipeline("QwenImagePipeline", "cpu", torch.float32, overrides=SMALL["QwenImagePipeline"])

    def pixels(prompt):
        out = pipe(prompt=[prompt], num_inference_steps=2, height=32, width=32, output_type="np",
                   generator=[torch.Generator().manual_seed(0)])
        return (out.images * 255).round().astype(np.uint8)

    plain = pixels("a cat " * 40)
    graphs = AC.compiled_graphs()
    try:
        accel.prepare(pipe, accel.AccelOptions(compile=True, compile_background=True, sdpa="default",
                                               fused_blocks=False))
        state = state_of(pipe.transformer)
        eager = pixels("a cat " * 40)  # eager, leaving the arguments
        assert AC.compiled_graphs() == graphs and len(state.captured) == 1 and not state.ready
        assert not state.switch()  # nothing compiled yet: stays eager
        assert state.start() and state.wait(120) and state.error is None and state.seconds > 0
        assert AC.compiled_graphs() - graphs == 1 and not state.captured  # one block class; activations let go
        assert state.switch() and state.ready
        compiled = pixels("a dog")  # another text length: the same dynamic-text graph
        assert AC.compiled_graphs() - graphs == 1  # the main thread compiled nothing
    finally:
        accel.prepare(pipe, accel.AccelOptions(sdpa="default"))
        torch._dynamo.reset()
    np.testing.assert_array_equal(plain, eager)
    assert compiled.shape == plain.shape


def test_a_failed_background_compilation_leaves_the_blocks_eager(monkeypatch, caplog):
    from shardgen.speed.background import BackgroundCompile, DeferredForward

    def broken(*a, **k):
        raise RuntimeError("inductor exploded")

    state = BackgroundCompile()
    block = torch.nn.Linear(2, 2)
    fwd = DeferredForward(block, block.forward, broken, state)
    x = torch.ones(1, 2)
    assert torch.equal(fwd(x), block(x))  # eager, captured
    with caplog.at_level("WARNING", logger="shardgen.compile"):
        assert state.start() and state.wait(10)
    assert "background compilation failed" in caplog.text and "inductor exploded" in caplog.text
    assert not state.switch() and torch.equal(fwd(x), block(x))  # still eager, never the broken wrapper


def test_compile_auto_warms_a_fresh_cache_on_the_main_thread_then_compiles_in_the_background(tmp_path, monkeypatch,
                                                                                            caplog):
    """The job's path on CUDA (made possible on CPU: the CUDA check faked, torch.compile the identity). A fresh
    cache: the first batch eager and timed, then compiled on the main thread (its cost paid there, recorded).
    The next job on that cache: the first batch eager, a thread compiles while the job goes on, the batches
    after the switch run the compiled blocks (padded). Both jobs give the same images (padding's bytes against
    an eager run: test_a_padded_short_batch_gives_the_bytes_of_an_unpadded_one)."""
    import logging

    from shardgen.speed import techniques
    from shardgen.speed.background import BackgroundCompile

    f = write_lines(tmp_path / "p.txt", [f"prompt {i}" for i in range(14)])  # batches 4, 4 (eager, timed), 4, 2
    monkeypatch.setattr(techniques, "resolve_compile", lambda value, device="auto", strategy="dp": True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(AC, "PRIOR_COLD_S", 0.0)
    monkeypatch.setattr(AC, "BACKGROUND_MIN_SAVING_S", 0.0)
    monkeypatch.setattr(AC, "records_path", lambda: tmp_path / "records.json")
    real_switch = BackgroundCompile.switch
    # no race: a started thread is waited for at the next switch point
    monkeypatch.setattr(BackgroundCompile, "switch", lambda self: (not self.started or self.done.wait(30))
                        and real_switch(self))
    with caplog.at_level(logging.INFO, logger="shardgen"):
        cold = run(compose_cfg(f"run_dir={tmp_path / 'cold'}", f"prompts.path={f}", "batch_size=4", *FAST))
    assert re.search(r"compile=auto: compiling \(\d+ samples left here x [\d.]+ s eager", caplog.text)
    assert "in the background" not in caplog.text
    records = json.loads((tmp_path / "records.json").read_text())
    for r in records.values():  # on CPU the identity "compile" gains nothing: the figures a GPU would record
        # a thread that compiles in no time, a main-thread compile that would block for long: the background wins
        r.update(compiled_s=r["eager_s"] / 1.4, compile_background_s=0.001, compile_warm_s=1000.0)
    (tmp_path / "records.json").write_text(json.dumps(records))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardgen"):
        warm = run(compose_cfg(f"run_dir={tmp_path / 'warm'}", f"prompts.path={f}", "batch_size=4", *FAST))
    assert (cold.ok, warm.ok) == (14, 14)
    assert re.search(r"compile=auto: compiling in the background \(\(\d+ samples left here x [\d.]+ s eager - "
                     r"\d+ s to compile in the background, warm cache.* slower eager batches beside it", caplog.text)
    assert "compiled in the background in" in caplog.text
    assert "compile=auto compiled in the background; 1 eager batches" in caplog.text and "3 compiled batches" in caplog.text
    (key, record), = json.loads((tmp_path / "records.json").read_text()).items()
    assert record["eager_s"] > 0 and record["compiled_s"] > 0 and 0 < record["compile_background_s"] < 1000  # the thread's
    assert record["compiled_before"] is True and '"model": "tiny"' in key
    assert shard_images(tmp_path / "cold") == shard_images(tmp_path / "warm")


def test_a_decision_taken_before_the_first_batch_starts_compiling_at_the_second_step():
    """With recorded figures compile=auto decides before the first batch: the thread starts inside that batch,
    when its second denoising step begins (the first one left every argument signature: here block a's first
    call has other strides than its second, as FLUX.1's first double block has), not after the batch."""
    from shardgen.speed.background import BackgroundCompile, DeferredForward

    state = BackgroundCompile()
    a, b = torch.nn.Linear(2, 2), torch.nn.Identity()
    fa = DeferredForward(a, a.forward, a.forward, state)
    fa2 = DeferredForward(a, a.forward, a.forward, state)  # a second block of a's class
    fb = DeferredForward(b, b.forward, b.forward, state)
    assert not state.start_when_captured() and not state.started  # nothing captured yet
    x = torch.ones(2, 2)
    fa(x), fa2(x.t()), fb(x)  # step 1: a with two stride patterns, then b
    assert not state.started and len(state.captured) == 3
    fa(x)  # step 2 begins
    assert state.started and state.wait(10) and state.error is None
    assert state.switch() and torch.equal(fa(x), a(x))


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


def test_a_forced_background_compile_switches_while_work_is_left_even_on_a_fresh_cache(tmp_path, monkeypatch, caplog):
    """The job's background path on CUDA (made possible on CPU: the CUDA check faked, torch.compile the identity),
    forced on a cache that has never compiled: two eager batches, one beside the thread, then compiled batches."""
    import logging

    from shardgen.speed import techniques

    f = write_lines(tmp_path / "p.txt", [f"prompt {i}" for i in range(22)])  # batches of 4: 2 eager, then compiled by the 4th
    monkeypatch.setenv(AC.FORCE_ENV, "background")
    monkeypatch.setattr(techniques, "resolve_compile", lambda value, device="auto", strategy="dp": True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(AC, "records_path", lambda: tmp_path / "records.json")
    with caplog.at_level(logging.INFO, logger="shardgen"):
        r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "batch_size=4", *FAST))
    assert (r.ok, r.failed) == (22, 0)
    assert "compile=auto: compiling in the background (forced by SHARDGEN_COMPILE_AUTO=background" in caplog.text
    m = re.search(r"compile=auto compiled in the background; ([23]) eager batches, [\d.]+ s/sample; compiled in the "
                  r"background in [\d.]+ s; ([34]) compiled batches", caplog.text)
    assert m and int(m[1]) + int(m[2]) == 6, caplog.text[-2000:]  # the third batch: beside the thread or after it


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


def test_a_family_whose_fused_eager_blocks_are_not_compiled_never_runs_stock_blocks_beside_a_background_compile(
        tmp_path, monkeypatch):
    """FLUX.2's fused eager blocks are not what its blocks compile: eager batches beside a background compilation
    would run the stock blocks (H200: 4.5 s/image against the fused 3.7), so on a cache that has compiled before,
    compile=auto decides on the main thread instead (forcing the background path still takes it); FLUX.1's fused
    blocks are compiled, so its background path stays."""
    from shardgen.speed.regional_compile import background_runs_eager_path
    from shardgen.speed.techniques import AccelOptions
    from tests.test_flux2_fused import small_flux2
    from tests.test_flux_fused import small_flux

    opts = AccelOptions()
    flux2 = small_flux2()
    assert not background_runs_eager_path(flux2, opts, device="cuda")
    assert background_runs_eager_path(flux2, opts)  # on the CPU: no fused eager blocks
    assert background_runs_eager_path(flux2, AccelOptions(fused_blocks=False), device="cuda")
    assert background_runs_eager_path(small_flux(), opts, device="cuda")
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": {"compiled_before": True, "compiled_s": 1.0}}))
    monkeypatch.delenv(AC.FORCE_ENV, raising=False)
    kw = dict(remaining=lambda: 100, path=path, background=flux2)
    assert AC.AutoCompile("k", **kw).background is flux2
    assert AC.AutoCompile("k", **kw, background_eager_ok=False).background is None
    monkeypatch.setenv(AC.FORCE_ENV, "background")
    assert AC.AutoCompile("k", **kw, background_eager_ok=False).background is flux2


@pytest.mark.parametrize("background_ok", [True, False])
def test_records_that_make_compiling_pay_at_once_compile_before_the_first_batch_on_either_path(tmp_path, monkeypatch,
                                                                                               background_ok):
    """The GPU matrix's requeued job: records of a long job whose compilation costs next to nothing compile before
    the first batch, in the background where the model's eager batches may run beside the thread, else on the main
    thread."""
    monkeypatch.delenv(AC.FORCE_ENV, raising=False)
    path = tmp_path / "records.json"
    path.write_text(json.dumps({"k": dict(eager_s=100.0, compiled_s=50.0, compile_background_s=0.001,
                                          compile_warm_s=0.001, compiled_before=True)}))
    auto = AC.AutoCompile("k", remaining=lambda: 4, path=path, background=torch.nn.Identity(),
                          background_eager_ok=background_ok)
    s = auto.settings(_S())
    assert auto.decided is True and s.accel.compile
    assert (auto.background is not None) is background_ok and s.accel.compile_background is background_ok


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
