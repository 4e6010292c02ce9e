"""The sampler (``scheduler=``, ``scheduler_shift=``): it changes the pixels, is recorded in every sample's
provenance, and a run made with one refuses a launch with another."""

from __future__ import annotations

import json

import pytest

from jobs.generate import run
from shardgen.config.validate import ConfigError
from shardgen.dataio.resume.fingerprint import FingerprintMismatch
from shardgen.tools.verify import read_shard_members
from tests.conftest import compose_cfg
from tests.test_generate import shard_images

ARGS = ("height=32", "width=32", "steps=3", "progress=false", "prompts.limit=2")


def provenance(run_dir) -> dict:
    tar = sorted((run_dir / "shards").glob("*.tar"))[0]
    return json.loads(next(iter(read_shard_members(tar).values()))["json"])["provenance"]["scheduler"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sched") / "default"
    assert run(compose_cfg(f"run_dir={d}", *ARGS)).ok == 2
    return d


@pytest.mark.parametrize("choice, name", [("scheduler=unipc", "UniPCMultistepScheduler"),
                                          ("scheduler_shift=1.5", "FlowMatchEulerDiscreteScheduler")])
def test_another_sampler_or_shift_changes_the_pixels_and_is_recorded(default_run, tmp_path, choice, name):
    assert run(compose_cfg(f"run_dir={tmp_path / 'r'}", *ARGS, choice)).ok == 2
    base, other = shard_images(default_run), shard_images(tmp_path / "r")
    assert sorted(base) == sorted(other) and all(base[k] != other[k] for k in base)
    got = provenance(tmp_path / "r")
    assert got["name"] == name and got["chosen"] == {choice.split("=")[0]: json.loads(choice.split("=")[1])
                                                    if "shift" in choice else choice.split("=")[1]}
    assert "chosen" not in provenance(default_run)


def test_a_run_made_with_one_sampler_refuses_another(tmp_path):
    args = (f"run_dir={tmp_path / 'r'}", *ARGS)
    assert run(compose_cfg(*args, "scheduler=unipc")).ok == 2
    with pytest.raises(FingerprintMismatch, match="scheduler: run has 'unipc', this launch has 'euler'"):
        run(compose_cfg(*args, "scheduler=euler"))
    with pytest.raises(FingerprintMismatch, match="scheduler: run has 'unipc', this launch has None"):
        run(compose_cfg(*args))


def test_the_models_shift_carries_over_to_a_sampler_that_names_it_otherwise(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from shardgen.models import schedulers

    class Pipe:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)

    pipe = schedulers.apply(Pipe(), "unipc", None)
    assert pipe.scheduler.config.flow_shift == 3.0 and pipe.scheduler.config.prediction_type == "flow_prediction"
    pipe = schedulers.apply(pipe, None, 5.0)
    assert pipe.scheduler.config.flow_shift == 5.0 and not pipe.scheduler.config.use_dynamic_shifting


@pytest.mark.parametrize("override, says", [
    ("scheduler=ddim", "scheduler=ddim: is not a scheduler shardgen knows; use one of euler, unipc, lcm, or null"),
    ("scheduler=dpmpp_2m", "scheduler=dpmpp_2m: does not work in FluxPipeline; use one of euler, unipc, lcm"),
    ("scheduler_shift=0", "scheduler_shift=0.0: use a positive number"),
])
def test_a_sampler_that_cannot_be_used_is_one_line_before_anything_is_written(tmp_path, override, says):
    with pytest.raises(ConfigError) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'r'}", *ARGS, override))
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_dpm_solver_runs_in_wan(tmp_path):
    cfg = compose_cfg("model=tiny_video", "num_frames=5", f"run_dir={tmp_path / 'v'}", *ARGS, "scheduler=dpmpp_2m")
    assert run(cfg).ok == 2
    assert provenance(tmp_path / "v")["name"] == "DPMSolverMultistepScheduler"
