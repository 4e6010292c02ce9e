"""``sdpa_backend=auto_8bit`` (``speed=fast``'s attention): the 8-bit kernel measured faster for the model where the
GPU runs it, else lossless attention; chosen once per run and kept in RUN_DIR/attention.json
(shardgen/run/auto_8bit.py). The GPU side (FLUX.1-dev taking fa3_fp8 on Hopper) is tests/test_gpu_fp8.py's."""

from __future__ import annotations

import json
import tarfile

import pytest

from shardgen.run import auto_8bit
from tests.conftest import compose_cfg

FAST = ("height=16", "width=16", "steps=1", "progress=false")


def test_speed_fast_asks_for_the_8bit_attention_that_pays():
    cfg = compose_cfg("speed=fast")
    assert (cfg.fp8, cfg.sdpa_backend, cfg.calibrate_samples) == (True, "auto_8bit", 4)


def test_the_kernel_is_the_family_s_where_the_gpu_runs_it(monkeypatch):
    from shardgen.speed import fa3_fp8

    on_cpu = auto_8bit.choose("FluxPipeline", "cpu")
    assert on_cpu.sdpa_backend == "auto" and "CUDA" in on_cpu.why
    monkeypatch.setattr(fa3_fp8, "unavailable_reason", lambda device: None)  # a Hopper GPU with fa3-fwd
    assert auto_8bit.choose("FluxPipeline", "cpu").sdpa_backend == "fa3_fp8"
    assert auto_8bit.choose("Flux2Pipeline", "cpu").sdpa_backend == "fa3_fp8"
    qwen = auto_8bit.choose("QwenImagePipeline", "cpu")  # fa3_fp8 is no faster there: lossless attention
    assert qwen.sdpa_backend == "auto" and "Qwen-Image" in qwen.why
    ring = auto_8bit.choose("FluxPipeline", "cpu", attention_backend="_native_cudnn")
    assert ring.sdpa_backend == "auto" and "_native_cudnn" in ring.why


def _pixels(run_dir) -> dict[str, bytes]:
    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        with tarfile.open(tar) as t:
            out.update({m.name: t.extractfile(m).read() for m in t.getmembers() if m.name.endswith(".png")})
    return out


def test_a_run_without_the_kernel_keeps_lossless_attention_and_says_so(tmp_path):
    """On a CPU (or a GPU fa3_fp8 does not run on) auto_8bit makes the pixels sdpa_backend=auto makes; the choice
    and why are in attention.json, and the run's fingerprint keeps what was asked."""
    from jobs.generate import run

    run(compose_cfg(f"run_dir={tmp_path / 'lossless'}", "prompts.limit=3", *FAST))
    result = run(compose_cfg(f"run_dir={tmp_path / 'auto8'}", "prompts.limit=3", "sdpa_backend=auto_8bit", *FAST))
    assert result.complete and result.ok == 3
    assert _pixels(tmp_path / "auto8") == _pixels(tmp_path / "lossless") and len(_pixels(tmp_path / "auto8")) == 3
    pinned = json.loads((tmp_path / "auto8" / "attention.json").read_text())
    assert pinned["sdpa_backend"] == "auto" and pinned["asked"] == "auto_8bit" and "CUDA" in pinned["why"]
    assert json.loads((tmp_path / "auto8" / "fingerprint.json").read_text())["sdpa_backend"] == "auto_8bit"


def _interrupted_run(run_dir) -> tuple:
    """A run of 4 prompts with auto_8bit, stopped after its first batch (a sample made, the run unfinished)."""
    from shardgen.run.runner import run_rank

    args = (f"run_dir={run_dir}", "prompts.limit=4", "samples_per_shard=2", "batch_size=1",
            "sdpa_backend=auto_8bit", *FAST)

    def stop(event, worker):
        if event == "end":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_rank(compose_cfg(*args), on_batch=stop)
    return args


def test_a_run_pinned_to_a_kernel_this_gpu_lacks_is_refused_before_any_weight_and_keeps_its_samples(tmp_path):
    """The first launch ran on a Hopper GPU and chose fa3_fp8; a later one here cannot run it: one line, naming the
    kernel, the GPU it was chosen on and what to do, and nothing of the run is lost."""
    from jobs.generate import run
    from shardgen.errors import UserError

    d = tmp_path / "run"
    args = _interrupted_run(d)
    made = sorted(p.name for p in (d / "work").iterdir())
    assert any(n.endswith(".ckpt.json") for n in made)
    pin = auto_8bit.Choice("fa3_fp8", "measured faster", "NVIDIA H100 80GB HBM3", "gpu-node-7")
    (d / "attention.json").write_bytes(pin.record())
    with pytest.raises(UserError) as e:
        run(compose_cfg(*args))
    message = str(e.value)
    assert "fa3_fp8" in message and "NVIDIA H100 80GB HBM3" in message and "start a new run_dir" in message
    assert "\n" not in message
    assert sorted(p.name for p in (d / "work").iterdir()) == made  # the partial shard and its checkpoint stay
    assert json.loads((d / "attention.json").read_text())["sdpa_backend"] == "fa3_fp8"  # the run's, still


def test_the_choice_is_kept_once_the_run_holds_a_sample_and_made_again_while_it_holds_none(tmp_path, monkeypatch):
    """A later launch on a GPU that runs fa3_fp8 keeps a run begun with lossless attention lossless (its samples
    would otherwise mix the two); a run that made nothing yet takes this launch's choice."""
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.speed import fa3_fp8

    d = tmp_path / "run"
    _interrupted_run(d)
    run = RunDir(d)
    assert auto_8bit.read_pin(run).sdpa_backend == "auto"
    monkeypatch.setattr(fa3_fp8, "unavailable_reason", lambda device: None)
    assert auto_8bit.pin(run, "FluxPipeline", "cpu").sdpa_backend == "auto"  # it holds a sample
    fresh = RunDir(tmp_path / "fresh")
    fresh.create()
    fresh.attention_path.write_bytes(auto_8bit.Choice("auto", "no CUDA", "cpu").record())
    assert auto_8bit.pin(fresh, "FluxPipeline", "cpu").sdpa_backend == "fa3_fp8"
    assert auto_8bit.read_pin(fresh).sdpa_backend == "fa3_fp8"


@pytest.mark.parametrize("text", ["", "{", "[]", '{"sdpa_backend": 3}', '{"sdpa_backend": "warp_drive", "why": "",'
                                  ' "gpu": ""}'])
def test_a_damaged_attention_json_is_named_not_guessed(tmp_path, text):
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.dataio.rundir.storage import RunDirError

    run = RunDir(tmp_path / "run")
    run.create()
    run.attention_path.write_text(text)
    with pytest.raises(RunDirError, match="attention.json"):
        auto_8bit.read_pin(run)


def test_a_run_kept_in_a_bucket_keeps_its_choice_in_the_bucket(tmp_path, bucket, s3, monkeypatch):
    """run_dir=s3://...: attention.json is an object beside the fingerprint (created once, with If-None-Match), so
    launches on other machines read the same choice."""
    from jobs.generate import run
    from shardgen.dataio.rundir.layout import RunDir

    monkeypatch.chdir(tmp_path)
    url = f"s3://{bucket}/runs/a8"
    assert run(compose_cfg(f"run_dir={url}", "prompts.limit=2", "sdpa_backend=auto_8bit", *FAST)).complete
    pinned = json.loads(s3.fs().cat_file(f"{bucket}/runs/a8/attention.json"))
    assert pinned["sdpa_backend"] == "auto"
    assert auto_8bit.read_pin(RunDir.at(url)) == auto_8bit.Choice("auto", pinned["why"], pinned["gpu"], pinned["host"])


def test_a_dry_run_estimates_speed_fast_at_the_rate_of_the_kernel_it_will_take(tmp_path, monkeypatch):
    """Rates are recorded under the attention that ran: a dry run of an auto_8bit run that will take fa3_fp8 is
    estimated at fa3_fp8's rate, not fp8 alone's; a run pinned to lossless attention at fp8 alone's."""
    from shardgen.run import rates
    from shardgen.run.dryrun import describe, dry_run
    from shardgen.speed import fa3_fp8

    monkeypatch.setattr(rates, "rates_path", lambda: tmp_path / "rates.json")
    pinned = tmp_path / "pinned"
    _interrupted_run(pinned)  # begun here, with lossless attention, and holding a sample: it keeps lossless
    new = ("dry_run=true", "fp8=true", *FAST)
    fp8_alone = compose_cfg(*new, f"run_dir={tmp_path / 'a'}")
    with_fa3 = compose_cfg(*new, f"run_dir={tmp_path / 'b'}", "sdpa_backend=fa3_fp8")
    for cfg, rate, name in ((fp8_alone, 1.0, "fp8-run"), (with_fa3, 2.0, "fa3-run")):
        rates.record_rate(rates.rate_key(cfg, "dp", 1, "cpu"), rate, name)
    asked = (*new, "sdpa_backend=auto_8bit")
    assert dry_run(compose_cfg(*asked, f"run_dir={tmp_path / 'new'}")).rate == 1.0  # no fa3_fp8 here: lossless
    monkeypatch.setattr(fa3_fp8, "unavailable_reason", lambda device: None)  # a Hopper GPU with fa3-fwd
    d = dry_run(compose_cfg(*asked, f"run_dir={tmp_path / 'new'}"))
    assert d.rate == 2.0 and "fa3-run" in describe(d)
    d = dry_run(compose_cfg(*asked, f"run_dir={pinned}"))
    assert d.rate == 1.0 and "fp8-run" in describe(d)


def test_a_launch_whose_choice_another_launch_replaced_while_it_loaded_generates_nothing(tmp_path, monkeypatch):
    """Two first launches of one run on different GPU kinds: this one chose lossless attention, and while it loaded
    its model (the run holding no sample) the other pinned fa3_fp8. This one stops in one line before its first
    batch, so the run's samples never mix the two kernels; a launch again takes the run's pin."""
    from jobs.generate import run
    from shardgen.run import runner

    d = tmp_path / "run"
    other = auto_8bit.Choice("fa3_fp8", "measured faster", "NVIDIA H100 80GB HBM3", "gpu-node-7")
    loaded = runner.preload_adapters

    def load_while_another_launch_chooses(pipe, adapters):
        (d / "attention.json").write_bytes(other.record())
        return loaded(pipe, adapters)

    monkeypatch.setattr(runner, "preload_adapters", load_while_another_launch_chooses)
    with pytest.raises(auto_8bit.AttentionChoiceChanged) as e:
        run(compose_cfg(f"run_dir={d}", "prompts.limit=3", "sdpa_backend=auto_8bit", *FAST))
    message = str(e.value)
    assert "chose auto" in message and "pinned fa3_fp8" in message and "NVIDIA H100 80GB HBM3" in message
    assert "\n" not in message
    assert not list((d / "shards").glob("*.tar")) and [p.name for p in (d / "work").iterdir()] == []
    assert auto_8bit.read_pin(auto_8bit.RunDir(d)).sdpa_backend == "fa3_fp8"  # the other launch's, kept


def test_a_launch_choosing_again_as_another_starts_generating_takes_the_other_s_kernel(tmp_path, monkeypatch):
    """Launch A pinned fa3_fp8 and is loading its model; launch B, on a GPU without it, chooses again (the run holds
    no sample). While B probes its GPU, A marks itself generating and finds its pin unchanged. B, writing its own
    choice, then finds A generating: it puts A's pin back and takes it, so the run's samples share A's kernel."""
    from shardgen.dataio.resume.fingerprint import run_settings, start_generating, stop_generating
    from shardgen.dataio.rundir.layout import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    a = auto_8bit.Choice("fa3_fp8", "measured faster", "NVIDIA H100 80GB HBM3", "gpu-node-7")
    run.attention_path.write_bytes(a.record())
    choose, markers = auto_8bit.choose, []

    def a_starts_generating_while_b_probes_its_gpu(*args, **kwargs):
        markers.append(start_generating(run, run_settings(run)))
        auto_8bit.check_unchanged(run, a)
        return choose(*args, **kwargs)  # no CUDA here: auto

    monkeypatch.setattr(auto_8bit, "choose", a_starts_generating_while_b_probes_its_gpu)
    try:
        assert auto_8bit.pin(run, "FluxPipeline", "cpu").sdpa_backend == "fa3_fp8"
        assert auto_8bit.read_pin(run).sdpa_backend == "fa3_fp8"
    finally:
        stop_generating(markers[0] if markers else None)


def test_a_run_holding_samples_without_its_pin_is_refused_not_switched(tmp_path, monkeypatch):
    """attention.json deleted (or not copied with the run) from a run with lossless samples: a resume on a Hopper GPU
    must not go on with fa3_fp8 silently. It is refused naming the file, and allow_fingerprint_change=true pins the
    resume's choice for the samples left."""
    from jobs.generate import run
    from shardgen.dataio.rundir.storage import RunDirError
    from shardgen.speed import fa3_fp8

    d = tmp_path / "run"
    args = _interrupted_run(d)
    (d / "attention.json").unlink()
    made = sorted(p.name for p in (d / "work").iterdir())
    monkeypatch.setattr(fa3_fp8, "unavailable_reason", lambda device: None)  # the resume runs on a Hopper GPU
    with pytest.raises(RunDirError) as e:
        run(compose_cfg(*args))
    assert "attention.json is missing" in str(e.value) and "allow_fingerprint_change=true" in str(e.value)
    assert sorted(p.name for p in (d / "work").iterdir()) == made and not (d / "attention.json").exists()
    assert "attention.json is missing" in run(compose_cfg(*args, "dry_run=true")).refused


def test_a_dry_run_says_a_launch_here_would_be_refused_for_the_run_s_pinned_kernel(tmp_path):
    from jobs.generate import run

    d = tmp_path / "run"
    args = _interrupted_run(d)
    (d / "attention.json").write_bytes(auto_8bit.Choice("fa3_fp8", "measured faster", "NVIDIA H100 80GB HBM3",
                                                        "gpu-node-7").record())
    refused = run(compose_cfg(*args, "dry_run=true", "device=cpu")).refused
    assert "makes its samples with fa3_fp8" in refused and "NVIDIA H100 80GB HBM3" in refused
    # device=auto on a host without a GPU (a login node) cannot judge the GPU the launch will get
    assert run(compose_cfg(*args, "dry_run=true")).refused is None


def test_a_pin_s_control_characters_reach_the_log_as_escapes_not_as_terminal_commands(tmp_path, caplog):
    """attention.json is a run file, someone else's input on shared storage: its why, quoted in a launch's log
    line, is shown with its escape sequences written out, on the console and in the rank log."""
    import logging

    from jobs.generate import run

    d = tmp_path / "run"
    args = _interrupted_run(d)
    (d / "attention.json").write_bytes(auto_8bit.Choice("auto", "\x1b]0;owned\x07\x1b[2J", "cpu").record())
    with caplog.at_level(logging.INFO, logger="shardgen"):
        assert run(compose_cfg(*args)).complete
    line = [r.getMessage() for r in caplog.records if "sdpa_backend=auto_8bit" in r.getMessage()][-1]  # the resume's
    assert "\\x1b]0;owned\\x07\\x1b[2J" in line and "\x1b" not in line
    rank_log = (d / "logs" / "rank000.log").read_text()
    assert "\\x1b]0;owned" in rank_log and "\x1b" not in rank_log
