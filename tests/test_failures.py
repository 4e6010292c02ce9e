"""Per-sample failures are recorded with their reason and the run goes on; retry_failed regenerates
exactly those samples; a setup where everything fails stops instead of marking the run failed."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from diffusers import FluxPipeline

from dataio.verify import read_shard_members, verify_run
from dataio.plan import load_plan
from dataio.rundir import RunDir
from engine.replica import BrokenSetupError
from jobs.generate import run
from tests.conftest import compose_cfg, write_lines
from tests.test_generate import shard_images

PROMPTS = ["a cat", "a nan cat", "a dog", "a boom dog", "a bird", "a fish", "a nan fish", "a cow"]
ARGS = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=4", "samples_per_shard=3")


def faulty(monkeypatch, poison=("nan", "boom")):
    """Make FluxPipeline fail for some prompts: NaN images for 'nan', an exception for 'boom'."""
    real = FluxPipeline.__call__

    @functools.wraps(real)
    def call(self, *args, **kwargs):
        prompts = kwargs["prompt"]
        if "boom" in poison and any("boom" in p for p in prompts):
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        out = real(self, *args, **kwargs)
        for i, p in enumerate(prompts):
            if "nan" in poison and "nan" in p:
                out.images[i] = float("nan")
        return out

    monkeypatch.setattr(FluxPipeline, "__call__", call)


def test_failures_are_recorded_and_retry_failed_regenerates_exactly_them(tmp_path, monkeypatch):
    f = write_lines(tmp_path / "p.txt", PROMPTS)
    clean = run(compose_cfg(f"run_dir={tmp_path / 'clean'}", f"prompts.path={f}", *ARGS))
    assert clean.ok == 8
    with monkeypatch.context() as m:
        faulty(m)
        r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *ARGS))
    assert (r.ok, r.failed, r.complete) == (5, 3, True)
    members = {}
    for tar in sorted((tmp_path / "run" / "shards").glob("*.tar")):
        members.update(read_shard_members(tar))
    nan = json.loads(members["0000000001"]["json"])
    boom = json.loads(members["0000000003"]["json"])
    assert nan["status"] == "failed" and nan["error"].startswith("nonfinite")
    assert boom["status"] == "failed" and "illegal memory access" in boom["error"]
    assert "png" not in members["0000000001"] and "png" in members["0000000002"]
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok
    good_before = {k: v for k, v in shard_images(tmp_path / "run").items() if v is not None}

    again = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *ARGS, "retry_failed=true"))
    assert (again.ok, again.failed, again.generated_here) == (8, 0, 3)
    after = shard_images(tmp_path / "run")
    assert after == shard_images(tmp_path / "clean")  # regenerated = what a clean run makes
    assert all(after[k] == v for k, v in good_before.items())
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_everything_failing_stops_the_run(tmp_path, monkeypatch):
    f = write_lines(tmp_path / "p.txt", [f"a boom {i}" for i in range(40)])
    faulty(monkeypatch)
    with pytest.raises(BrokenSetupError, match="every sample of the last 3 batches failed"):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *ARGS))
