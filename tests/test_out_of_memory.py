"""A GPU out-of-memory, wherever it strikes, ends the job with one line that says what to change; samples already
made stay, and the same command with the change completes the run with the bytes of a run that never failed."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from diffusers import FluxPipeline

from jobs.generate import run
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.run.memory import GpuOutOfMemory
from shardgen.speed import fp8
from shardgen.tools.verify import verify_run
from tests.conftest import compose_cfg, start_module, write_lines
from tests.test_generate import shard_images

PROMPTS = [f"a small thing number {i}" for i in range(8)]
ARGS = ("height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=3")
TORCH_OOM = ("CUDA out of memory. Tried to allocate 1.27 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
             "1.02 GiB is free. Including non-PyTorch memory, this process has 138.57 GiB memory in use. Of the "
             "allocated memory 137.9 GiB is allocated by PyTorch")


def oom_above(monkeypatch, max_batch: int, after_calls: int = 0):
    """FluxPipeline raises torch's CUDA OOM for batches larger than ``max_batch``, from its ``after_calls``+1-th
    call on."""
    real, calls = FluxPipeline.__call__, []

    @functools.wraps(real)
    def call(self, *args, **kwargs):
        calls.append(len(kwargs["prompt"]))
        if len(calls) > after_calls and len(kwargs["prompt"]) > max_batch:
            raise torch.OutOfMemoryError(TORCH_OOM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FluxPipeline, "__call__", call)
    return calls


def test_a_batch_out_of_memory_stops_with_advice_and_the_advised_rerun_completes(tmp_path, monkeypatch, caplog):
    """The stop gives up the claim of the shard it was making: the advised rerun resumes it at once, not after the
    claim's lease (lease_s) has run out."""
    f = write_lines(tmp_path / "p.txt", PROMPTS)
    clean = run(compose_cfg(f"run_dir={tmp_path / 'clean'}", f"prompts.path={f}", "batch_size=3", *ARGS))
    assert clean.ok == 8
    with monkeypatch.context() as m:
        calls = oom_above(m, max_batch=1, after_calls=1)  # the first shard's batch is made, the second one is not
        with pytest.raises(GpuOutOfMemory) as err:
            run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "batch_size=3", *ARGS))
    message = str(err.value)
    assert "\n" not in message
    assert "ran out of memory generating a batch of 3 at 16x16" in message
    assert "Tried to allocate 1.27 GiB" in message and "non-PyTorch" not in message
    assert "batch_size=1 (now 3)" in message and "fp8=true" in message and "strategy=device_map" in message
    assert calls == [3, 3]  # no one-by-one retry of a batch that cannot fit: every batch would fail alike
    assert len(load_plan(RunDir(tmp_path / "run")).run.done_shards()) == 1  # what was made stays

    assert "released 1 unfinished shard(s) (000001)" in caplog.text
    caplog.clear()
    started = time.monotonic()
    again = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "batch_size=1", *ARGS))
    assert (again.ok, again.failed, again.complete) == (8, 0, True)
    assert "taking over shard" not in caplog.text and time.monotonic() - started < 60
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok
    assert shard_images(tmp_path / "run") == shard_images(tmp_path / "clean")


def test_the_advice_names_the_configured_batch_size_when_a_shard_made_the_batch_smaller(tmp_path, monkeypatch):
    """batch_size=4 over shards of 3: the batch that runs out holds 3, and the advice halves what the user set."""
    f = write_lines(tmp_path / "p.txt", PROMPTS)
    with monkeypatch.context() as m:
        oom_above(m, max_batch=1)
        with pytest.raises(GpuOutOfMemory) as err:
            run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "batch_size=4", *ARGS))
    message = str(err.value)
    assert "generating a batch of 3 at 16x16" in message
    assert "Set batch_size=2 (now 4; the batch that ran out held 3)" in message and "(now 3)" not in message


def test_out_of_memory_while_preparing_the_model_names_the_stage(tmp_path, monkeypatch):
    f = write_lines(tmp_path / "p.txt", PROMPTS[:2])

    def no_room(transformer):
        raise torch.OutOfMemoryError(TORCH_OOM)

    monkeypatch.setattr(fp8, "enable_fp8", no_room)
    with pytest.raises(GpuOutOfMemory, match="out of memory loading or preparing the model .*Set batch_size=1"):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "fp8=true", "batch_size=2", *ARGS))


@pytest.mark.slow  # a whole process
def test_the_command_line_prints_one_line_and_exits_2(tmp_path):
    """Through ``python -m jobs.generate``: no traceback, exit status 2 (a fault injected by a sitecustomize)."""
    f = write_lines(tmp_path / "p.txt", PROMPTS[:2])
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import torch, diffusers\n"
        "def call(self, *a, **k):\n"
        f"    raise torch.OutOfMemoryError({TORCH_OOM!r})\n"
        "diffusers.FluxPipeline.__call__ = call\n")
    proc = start_module("jobs.generate", [f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "prompts=txt", *ARGS],
                        tmp_path / "launch.log", hooks=[hook])
    assert proc.wait(timeout=300) == 2, proc.output[-2000:]
    assert "Traceback" not in proc.output
    lines = [ln for ln in proc.output.splitlines() if "out of memory" in ln]
    assert len(lines) == 1 and "generating a batch of 2" in lines[0], proc.output[-2000:]


def test_a_claim_store_that_cannot_be_written_at_the_stop_leaves_the_stop_s_own_message(tmp_path, monkeypatch,
                                                                                      caplog):
    """Giving up the claims after the stop is a courtesy to the rerun: a store that refuses it (the outage that
    may have caused the stop) leaves the claims to expire and the user reads the out-of-memory advice, not the
    store's error."""
    from shardgen.run.shardwalk import ShardWalk

    def refuse(self):
        raise OSError("the store is down")

    f = write_lines(tmp_path / "p.txt", PROMPTS)
    with monkeypatch.context() as m:
        oom_above(m, max_batch=1, after_calls=1)
        m.setattr(ShardWalk, "release_unfinished", refuse)
        with pytest.raises(GpuOutOfMemory, match="ran out of memory generating a batch of 3"):
            run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "batch_size=3", *ARGS))
    assert "could not give up the unfinished shards' claims (OSError: the store is down)" in caplog.text
