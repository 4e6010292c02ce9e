"""The operator's view: messages, help, progress of a run in progress, dry runs, exact resumes."""

from __future__ import annotations

import json
import logging

import pytest

from shardgen.dataio.shards.sizing import resolve_samples_per_shard
from shardgen.dataio.prompts.read import PromptSource
from tests.conftest import compose_cfg


def test_a_tsv_header_is_not_counted_and_a_video_plan_says_mp4(tmp_path, caplog):
    from shardgen.run.runner import shard_sizing

    tsv = tmp_path / "p.tsv"
    tsv.write_text("Prompt\tCategory\n" + "".join(f"prompt {i}\tc\n" for i in range(30)))
    with caplog.at_level(logging.INFO, logger="shardgen"):
        resolve_samples_per_shard(None, PromptSource(str(tsv), "tsv", field="Prompt"),
                                  **shard_sizing(compose_cfg("height=64", "width=64"), 1))
        resolve_samples_per_shard(None, PromptSource(str(tsv), "tsv", field="Prompt"),
                                  **shard_sizing(compose_cfg("model=tiny_video"), 1))
    image, video = [r.getMessage() for r in caplog.records if "samples_per_shard=" in r.getMessage()]
    assert "30 prompts over 1 replica" in image and "64x64 png sample" in image
    assert "64x64 mp4 of 9 frames sample" in video and "png" not in video


@pytest.mark.slow
def test_a_resumed_run_has_the_uninterrupted_runs_tar_bytes(tmp_path):
    """Member mtimes are fixed and timing stays out of the sample json: the tars are identical, not only the PNGs."""
    import time

    from shardgen.run.runner import run_rank

    args = ("height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=6", "batch_size=2",
            "prompts.limit=12", "lease_s=1", "heartbeat_s=0.25")  # our own interrupted claim expires soon
    run_rank(compose_cfg(f"run_dir={tmp_path / 'whole'}", *args))
    batches = []

    def stop_at_the_second_batch(event, worker):
        if event == "end" and len(batches) == 1:
            raise KeyboardInterrupt
        batches.append(event) if event == "end" else None

    time.sleep(1.1)  # a member mtime taken from the clock would differ now
    with pytest.raises(KeyboardInterrupt):
        run_rank(compose_cfg(f"run_dir={tmp_path / 'resumed'}", *args), on_batch=stop_at_the_second_batch)
    assert list((tmp_path / "resumed" / "work").glob("*.ckpt.json"))  # a partial shard to resume
    assert run_rank(compose_cfg(f"run_dir={tmp_path / 'resumed'}", *args)).complete
    whole = sorted((tmp_path / "whole" / "shards").glob("*.tar"))
    assert len(whole) == 2
    for tar in whole:
        assert (tmp_path / "resumed" / "shards" / tar.name).read_bytes() == tar.read_bytes()
    import pandas as pd

    index = pd.read_parquet(tmp_path / "resumed" / "shards" / "000001.parquet")
    assert index.gen_s.notna().all()  # the timing is kept in the index (jobs.report's histogram)


def group_options() -> list[tuple[str, str]]:
    """(group, option) of every YAML under conf/<group>/."""
    from tests.conftest import CONF

    return [(g.name, y.stem) for g in sorted(CONF.iterdir()) if g.is_dir() for y in sorted(g.glob("*.yaml"))]


@pytest.mark.parametrize("group,option", group_options())
def test_every_config_group_option_without_its_mandatory_values_is_a_one_line_error(group, option, tmp_path):
    from omegaconf import OmegaConf

    from jobs.generate import run
    from shardgen.config.validate import ConfigError

    choice = f"{group}=[{option}]" if group == "signals" else f"{group}={option}"
    cfg = compose_cfg(choice, f"run_dir={tmp_path / 'run'}")
    missing = OmegaConf.missing_keys(cfg)
    if not missing:  # nothing mandatory left unset: nothing to refuse
        return
    with pytest.raises(ConfigError) as e:
        run(cfg)
    msg = str(e.value)
    assert "\n" not in msg and all(f"{key} is not set: set {key}=" in msg for key in missing)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_prompts_parti_without_a_path_says_where_to_get_partiprompts(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    p = subprocess.run([sys.executable, "-m", "jobs.generate", "prompts=parti", f"run_dir={tmp_path / 'r'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "prompts.path is not set: set prompts.path=FILE" in p.stderr
    assert "https://github.com/google-research/parti/blob/main/PartiPrompts.tsv" in p.stderr


def test_generate_help_describes_every_key_from_the_schemas_docstrings():
    import subprocess
    import sys

    from shardgen.config.help import help_entries
    from tests.conftest import ROOT

    p = subprocess.run([sys.executable, "-m", "jobs.generate", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())  # help text is wrapped: compare with whitespace collapsed
    assert "usage: python -m jobs.generate" in out and "prompts: csv, default, jsonl" in out
    sections = help_entries()
    entries = [row for _, rows in sections for row in rows]
    assert len(entries) > 60 and all(doc for _, _, doc in entries)  # every key has a docstring
    assert len({key for key, _, _ in entries}) == len(entries)  # each key once, under its group's heading
    assert all(f"== {heading} ==" in p.stdout for heading, _ in sections)
    assert "== Speed: shardgen/speed/accel.py; the LOSSY options are opt-in (top-level keys) == compile=auto" in out
    for key, default, doc in entries:
        assert f"{key}={default} {doc}" in out, key
    assert "tp_degree=1 Tensor-parallel ranks per replica (strategy=tp)." in out  # one, spelled out


@pytest.mark.parametrize("tool", ["status", "verify", "preview", "report", "dedup", "bench"])
def test_every_jobs_tool_has_its_whole_description_and_a_text_per_option(tool, monkeypatch):
    import argparse
    import importlib

    module = importlib.import_module(f"jobs.{tool}")
    seen = {}

    def capture(parser, *a, **k):
        seen["parser"] = parser
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    parser = seen["parser"]
    assert parser.description == module.__doc__  # the whole docstring, not its first line cut mid-sentence
    assert module.__doc__.strip().splitlines()[-1].strip() in parser.format_help()  # shown to its last line
    undocumented = [a.dest for a in parser._actions if not a.help]
    assert not undocumented, f"jobs.{tool}: options without a help text: {undocumented}"


def test_launcher_local_refuses_a_changed_run_whole_and_starts_no_rank_for_a_complete_one(tmp_path, capsys,
                                                                                          monkeypatch):
    import torch.multiprocessing as mp

    from jobs.generate import run
    from shardgen.errors import UserError

    args = (f"run_dir={tmp_path / 'run'}", "height=16", "width=16", "steps=1", "progress=false", "prompts.limit=4")
    run(compose_cfg(*args))
    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("a rank was spawned"))
    run(compose_cfg(*args, "launcher=local", "launcher.nprocs=2"))
    assert "already complete (4 samples in 1 shards); nothing to do." in capsys.readouterr().out
    with pytest.raises(UserError) as e:
        run(compose_cfg(*args, "steps=2", "launcher=local", "launcher.nprocs=2"))
    msg = str(e.value)  # the first lines name the run directory and the changed field, as in one process
    assert f"says {tmp_path / 'run'} was made with other settings" in msg and "steps" in msg
    assert "allow_fingerprint_change=true" in msg


def test_a_spawned_ranks_user_error_reaches_the_parent_whole():
    from shardgen.launch.local import USER_ERROR_MARK, rank_error_message

    message = "first line naming the run\n  steps: 1 -> 2\nUse the original settings"
    traceback = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
                 '  File "x.py", line 1, in f\nRuntimeError: ' + USER_ERROR_MARK + json.dumps(message) + "\n")
    assert rank_error_message(traceback) == message
    assert rank_error_message("Traceback ...\nValueError: boom\n") == "ValueError: boom"


@pytest.mark.slow
def test_under_torchrun_a_refusal_rank_0_shares_is_printed_once_not_once_per_rank(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    missing = tmp_path / "nowhere.txt"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "jobs.generate",
                        f"run_dir={tmp_path / 'run'}", f"prompts.path={missing}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0
    said = p.stdout + p.stderr
    assert said.count(f"{missing}: the prompt file does not exist") == 1, said[-3000:]


def test_a_spawned_rank_killed_by_a_signal_is_named_with_the_likely_cause():
    from shardgen.launch.local import rank_exit_message

    killed = rank_exit_message(-9, 87, 120.0)
    assert killed.startswith("a rank was killed by SIGKILL (the kernel's out-of-memory killer")
    assert "dmesg" in killed and "lease_s=120 s" in killed and "re-run the same command" in killed
    assert rank_exit_message(-11, 87, 120.0).startswith("a rank was killed by SIGSEGV; re-run")
    assert "it stalled: stall_timeout_s" in rank_exit_message(87, 87, 120.0)
    assert rank_exit_message(3, 87, 120.0) == "a rank exited with code 3; re-run the same command to continue"


@pytest.mark.slow
def test_a_run_in_progress_and_then_stopped_as_the_tools_show_it(tmp_path, capsys):
    """Before its first commit: status has a rate and an ETA, preview shows the partial shard's images, verify
    says unfinished (exit 0), report works; once stopped: no ETA. (One shard of 12, batches of 2.)"""
    import time

    from jobs import preview, report, status, verify
    from shardgen.run.runner import run_rank

    d = tmp_path / "run"
    args = (f"run_dir={d}", "height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=12",
            "batch_size=2", "prompts.limit=12", "lease_s=1", "heartbeat_s=0.25")
    seen = {}

    def look_then_stop(event, worker):
        if event == "start" and worker.generated == 6:  # three batches handed over: two of them durable
            assert status.main([str(d), "--json"]) == 0
            seen["live"] = json.loads(capsys.readouterr().out)
            assert status.main([str(d)]) == 0
            seen["text"] = capsys.readouterr().out
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_rank(compose_cfg(*args), on_batch=look_then_stop)
    live = seen["live"]
    assert live["state"] == "running" and live["samples_committed"] == 0 and live["samples_done"] >= 4
    assert live["rate"] > 0 and live["eta_s"] > 0 and live["claims"][0]["shard"] == 0
    assert live["replicas"][0]["replica"] == "0" and live["replicas"][0]["rate"] > 0
    assert "ETA " in seen["text"] and "last batch durable" in seen["text"]

    sheet = tmp_path / "sheet.png"
    assert preview.main([str(d), "--out", str(sheet), "--size", "32"]) == 0
    assert f"wrote {sheet} (" in capsys.readouterr().out
    assert verify.main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "UNFINISHED shard 000000: in progress," in out and "DEFECT" not in out and "OK so far" in out
    assert report.main([str(d), "--out", str(tmp_path / "r.html")]) == 0
    assert "in progress:" in (tmp_path / "r.html").read_text()
    capsys.readouterr()

    time.sleep(1.3)  # the interrupted claim's lease (1 s) runs out: nothing is running any more
    assert status.main([str(d), "--json"]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["state"] == "stopped" and stopped["eta_s"] is None and stopped["rate"] > 0
    assert status.main([str(d)]) == 0
    assert "no ETA: no live claim" in capsys.readouterr().out


FAST = ("prompts.limit=8", "height=32", "width=32", "steps=1", "progress=false")


def test_a_model_too_big_for_the_memory_is_refused_before_it_is_built_saying_what_to_change():
    from parallel.dims import ParallelDims
    from parallel.memory import memory_problem

    cfg = compose_cfg("model=flux_dev", "model.weights=dummy")
    flux = {"transformer": 11_901_408_320, "vae": 83_819_683, "text_encoder": 123_060_480,
            "text_encoder_2": 4_762_310_656}  # FLUX.1-dev's parameters (shardgen.models.loader.component_params)
    dp = ParallelDims(world_size=1, strategy="dp")
    msg = memory_problem(cfg, dp, flux, 2, 16 << 30, "the CPU")
    assert msg.startswith("model=flux_dev (weights=dummy, dtype=bfloat16) needs ~31.4 GiB for its weights in each "
                          "process (16.9B parameters, strategy dp), but the CPU has 16.0 GiB available.")
    assert "strategy=tp tp_degree=N" in msg and "check_memory=false" in msg and "\n" not in msg
    assert memory_problem(cfg, dp, flux, 2, 40 << 30, "the CPU") is None
    tp4 = ParallelDims(world_size=4, strategy="tp", tp=4)  # the transformer split 4 ways: 14.8 GiB per rank
    assert memory_problem(cfg, tp4, flux, 2, 20 << 30, "GPU 0") is None
    # device_map holds the transformer on the GPU; the encoders live on the CPU when they do not fit beside it
    one_gpu = ParallelDims(world_size=1, strategy="device_map", gpus_per_replica=1)
    assert memory_problem(cfg, one_gpu, flux, 2, 25 << 30, "GPU 0") is None
    msg = memory_problem(cfg, one_gpu, flux, 2, 20 << 30, "GPU 0")
    assert "needs ~22.2 GiB" in msg and "Use a GPU with more memory, fewer ranks" in msg
    # FLUX.2-dev under dp on an 80 GB card: its transformer alone fits, so device_map on that one GPU is the advice
    flux2 = {"transformer": 32_220_000_000, "text_encoder": 24_010_000_000, "vae": 84_000_000}
    cfg2 = compose_cfg("model=flux2_dev", "model.weights=dummy")
    msg = memory_problem(cfg2, dp, flux2, 2, 78 << 30, "GPU 0")
    assert ("has 78.0 GiB available. Use strategy=device_map (the transformer alone, 60.0 GiB, fits: the text encoders "
            "stay in the machine's RAM and come in for each batch's encoding; strategy=auto picks it), a GPU with more "
            "memory or split") in msg
    assert "strategy=device_map (the transformer alone" not in memory_problem(cfg2, dp, flux2, 2, 50 << 30, "GPU 0")
    assert "strategy=device_map (the transformer alone" not in memory_problem(cfg2, dp, flux2, 2, 78 << 30, "the CPU")
    assert "a smaller model (model=tiny)" in memory_problem(cfg2, dp, flux2, 2, 50 << 30, "GPU 0")
    # model=tiny with weights=dummy is FLUX.1-dev's architecture (random weights): the way back is its own weights
    tiny = compose_cfg("model=tiny", "model.weights=dummy")
    msg = memory_problem(tiny, dp, flux, 8, 16 << 30, "the CPU")
    assert ("model.weights=pretrained (weights=dummy gives model=tiny FLUX.1-dev's whole architecture, with random "
            "weights)") in msg and "model=tiny)" not in msg



def test_device_map_refuses_encoders_kept_on_the_cpu_that_the_machine_s_ram_cannot_hold():
    """FLUX.2-dev under device_map on an 80 GB card: its 24B text encoder (44.7 GiB) has no room beside the 60 GiB
    transformer, so it lives on the CPU: refused where the rank's share of the RAM is smaller, in one line."""
    from parallel.dims import ParallelDims
    from parallel.memory import offload_problem

    cfg = compose_cfg("model=flux2_dev", "model.weights=dummy")
    flux2 = {"transformer": 32_220_000_000, "text_encoder": 24_010_000_000, "vae": 84_000_000}
    one_gpu = ParallelDims(world_size=1, strategy="device_map", gpus_per_replica=1)
    msg = offload_problem(cfg, one_gpu, flux2, 2, 78 << 30, 30 << 30, "the CPU (8 rank(s) sharing its RAM)")
    assert msg == ("model=flux2_dev under strategy=device_map keeps text_encoder (44.7 GiB) on the CPU (no room beside "
                   "the transformer on its GPU), but the CPU (8 rank(s) sharing its RAM) has 30.0 GiB available. Use a "
                   "machine with more RAM, fewer ranks per machine, or check_memory=false to try anyway")
    assert offload_problem(cfg, one_gpu, flux2, 2, 78 << 30, 120 << 30, "the CPU") is None
    assert offload_problem(cfg, one_gpu, flux2, 2, 141 << 30, 30 << 30, "the CPU") is None  # it fits an H200
    dp = ParallelDims(world_size=1, strategy="dp")
    assert offload_problem(cfg, dp, flux2, 2, 78 << 30, 1 << 30, "the CPU") is None  # dp keeps it all on the GPU


def test_the_memory_check_refuses_a_device_map_job_whose_encoders_the_ram_cannot_hold(monkeypatch):
    """Through check_memory, as run_rank calls it: FLUX.2-dev's dummy architecture under device_map on an 80 GB GPU,
    8 ranks sharing 200 GiB of RAM."""
    import parallel.memory as memory
    from parallel.dims import ParallelDims

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(memory, "available_bytes", lambda device, n: (
        (78 << 30, "GPU 0") if device == "cuda" else (200 * 2**30 // n, f"the CPU ({n} rank(s) sharing its RAM)")))
    cfg = compose_cfg("model=flux2_dev", "model.weights=dummy")
    with pytest.raises(memory.MemoryCheckError, match=r"keeps text_encoder \(44\.7 GiB\) on the CPU .* but the CPU "
                                                      r"\(8 rank\(s\) sharing its RAM\) has 25\.0 GiB available"):
        memory.check_memory(cfg, ParallelDims(world_size=1, strategy="device_map", gpus_per_replica=1), "cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    memory.check_memory(cfg, ParallelDims(world_size=1, strategy="device_map", gpus_per_replica=1), "cuda")


def test_the_memory_check_runs_before_the_model_is_built(tmp_path, monkeypatch):
    """run_rank refuses before apply_strategy builds anything (the available memory made tiny here)."""
    import parallel.memory as memory
    from shardgen.run import runner

    monkeypatch.setattr(memory, "available_bytes", lambda device, ranks: (1 << 10, "the CPU"))
    monkeypatch.setattr(runner, "apply_strategy", lambda *a: pytest.fail("the model was built"))
    with pytest.raises(memory.MemoryCheckError, match="needs ~0.0 GiB .* but the CPU has 0.0 GiB available"):
        runner.run_rank(compose_cfg(f"run_dir={tmp_path / 'r'}", "prompts.limit=2", "progress=false"))


@pytest.mark.slow
def test_log_lines_are_not_glued_to_the_progress_bar_and_a_first_build_draws_no_bars(tmp_path):
    import os

    from tests.conftest import start_module

    env = dict(os.environ, SHARDGEN_CACHE=str(tmp_path / "fresh-cache"))  # the tiny model is built by this run
    p = start_module("jobs.generate", [f"run_dir={tmp_path / 'r'}", "progress=true", "samples_per_shard=4", *FAST[:-1]],
                     tmp_path / "out.log", env=env, stderr=tmp_path / "err.log")
    assert p.wait(timeout=300) == 0, p.errors
    out, err = p.output, p.errors
    assert "Writing model shards" not in err and "Loading pipeline components" not in err
    assert not out.startswith("\n")  # the tokenizer trainer's progress lines
    segments = [seg for line in err.split("\n") for seg in line.split("\r")]
    assert any("generate:" in s for s in segments) and any("shard 000001 committed" in s for s in segments)
    glued = [s for s in segments if "generate:" in s and "[shardgen" in s]
    assert not glued, glued
