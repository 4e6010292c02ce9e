"""Launchers as a registry: each launcher= option has a config class of its own fields, and a launcher added in
one module (here, this test's) runs a job with nothing else changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from shardgen.config.schema import LauncherConfig, LocalLauncherConfig, SlurmLauncherConfig
from tests.conftest import ROOT, compose_cfg

SMALL = ("height=32", "width=32", "steps=1", "prompts.limit=3", "samples_per_shard=2", "batch_size=2",
         "progress=false")


@dataclass(kw_only=True)
class ToyLauncherConfig(LauncherConfig):
    """launcher=toy: this process, announced with a greeting."""

    name: str = "toy"
    greeting: str = "hello"


STARTED: list[str] = []


def start_toy(cfg) -> object:
    """Record the greeting, then run the job's one rank in this process."""
    from shardgen.run.runner import run_rank

    STARTED.append(cfg.launcher.greeting)
    return run_rank(cfg)


@pytest.fixture
def toy_launcher(monkeypatch):
    from shardgen.config import launchers

    monkeypatch.setitem(launchers.LAUNCHERS, "toy", launchers.Launcher(
        "toy", world_size=lambda cfg: 1, config=ToyLauncherConfig, start=start_toy))
    store = ConfigStore.instance()
    store.store(group="launcher", name="toy", node=ToyLauncherConfig)
    yield
    store.repo["launcher"].pop("toy.yaml")  # other tests list the launcher options (docs/config.md)
    STARTED.clear()


def test_a_launcher_registered_in_one_module_runs_a_job(toy_launcher, tmp_path):
    from jobs.generate import run
    from shardgen.config.overrides import check_overrides
    from shardgen.dataio.rundir import RunDir
    from shardgen.dataio.prompts import load_plan
    from shardgen.tools import verify_run

    typed = ["launcher=toy", "launcher.greeting=bonjour", f"run_dir={tmp_path / 'run'}", *SMALL]
    assert check_overrides(typed) is None
    result = run(compose_cfg(*typed))
    assert STARTED == ["bonjour"] and result.ok == 3
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok
    assert sorted(p.name for p in (tmp_path / "run" / "shards").glob("*.tar")) == ["000000.tar", "000001.tar"]


@pytest.mark.parametrize("overrides, cls, values", [
    (("launcher=slurm", "launcher.partition=gpu", "launcher.nodes=2"), SlurmLauncherConfig,
     {"partition": "gpu", "nodes": 2, "time_min": 240}),
    (("launcher=local", "launcher.nprocs=2"), LocalLauncherConfig, {"nprocs": 2, "backend": None}),
    ((), LauncherConfig, {"name": "none"}),
])
def test_each_launcher_option_has_only_its_own_fields(overrides, cls, values):
    cfg = compose_cfg(*overrides)
    assert OmegaConf.get_type(cfg.launcher) is cls
    assert {k: cfg.launcher[k] for k in values} == values
    assert ("partition" in cfg.launcher) == (cls is SlurmLauncherConfig)
    assert ("nprocs" in cfg.launcher) == (cls is LocalLauncherConfig)


def test_another_launchers_key_is_refused_in_one_line_naming_its_launcher():
    from shardgen.config.overrides import check_overrides

    assert check_overrides(["launcher.partition=gpu"]) == (
        "launcher.partition=gpu: launcher=none has no key 'launcher.partition'; it is a key of launcher=slurm: "
        "choose that launcher too")
    assert check_overrides(["launcher=local", "launcher.nodes=2"]).startswith("launcher.nodes=2: launcher=local")
    assert check_overrides(["launcher=slurm", "launcher.nodes=2"]) is None


def test_a_launchers_own_check_runs_before_any_work(tmp_path):
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"^launcher.nprocs=0: use 1 or more$"):
        validate_config(compose_cfg("launcher=local", "launcher.nprocs=0", f"run_dir={tmp_path}"))


def _report_rank(rank: int, out_dir: str, *parent) -> None:
    """A launcher=local rank in miniature: what it sees of its environment, and a line on its stdout."""
    from shardgen.launch import local

    local.adopt_parent(parent)  # as _local_rank_main does first
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"probe": os.environ.get("SHARDGEN_PROBE"),
                                                             "forked": bool(parent),
                                                             "preloaded": "transformers" in sys.modules}))
    print(f"rank {rank} says hello", flush=True)
    assert local.RANK_IMPORTS  # the child found the launcher's module


def _start_and_read(tmp_path, n: int) -> tuple[list[dict], str]:
    """Start ``n`` ranks running _report_rank with this process's stdout sent to a new file: their reports, and
    what they printed there."""
    from shardgen.launch.local import _join_ranks, start_ranks

    out = tmp_path / f"launch{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    saved = os.dup(1)
    try:
        with open(out / "stdout", "wb") as f:
            os.dup2(f.fileno(), 1)
        _join_ranks(start_ranks(_report_rank, (str(out),), n, ["transformers", "tests.test_launchers"]))
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)], (out / "stdout").read_text()


def test_local_ranks_get_the_environment_and_stdout_of_their_launch_not_of_an_earlier_one(tmp_path, monkeypatch):
    """Ranks are forked from one forkserver per process, started by the first launch: a later launch in the same
    process (a notebook, a test, a sweep) hands its ranks its own environment and stdout."""
    for value in ("first", "second"):
        monkeypatch.setenv("SHARDGEN_PROBE", value)
        reports, out = _start_and_read(tmp_path, 2)
        assert [r["probe"] for r in reports] == [value, value]
        assert all(r["forked"] and r["preloaded"] for r in reports)  # forked from the server: imports done there
        assert "rank 0 says hello" in out and "rank 1 says hello" in out, out


def test_without_a_forkserver_local_ranks_are_spawned(tmp_path, monkeypatch):
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    monkeypatch.setenv("SHARDGEN_PROBE", "spawned")
    reports, out = _start_and_read(tmp_path, 2)
    assert [r["probe"] for r in reports] == ["spawned", "spawned"] and not any(r["forked"] for r in reports)
    assert "rank 1 says hello" in out, out


@pytest.mark.parametrize("device, cuda, forked", [("cpu", True, True), ("auto", False, True), ("auto", True, False),
                                                  ("cuda", True, False)])
def test_local_ranks_are_forked_only_on_cpu(monkeypatch, device, cuda, forked):
    """On a GPU machine the ranks are spawned: a rank forked from a process where CUDA was initialized cannot use it."""
    import torch

    from shardgen.launch.local import _on_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert _on_cpu(compose_cfg(f"device={device}")) is forked


CLOSED_STDOUT = '''
import sys
from shardgen.launch.local import _join_ranks, start_ranks
from tests.test_launchers import _report_rank
assert sys.stdout is None  # Python's view of a descriptor closed at start
_join_ranks(start_ranks(_report_rank, (sys.argv[1],), 2, ["tests.test_launchers"]))
'''


def test_a_launch_with_its_stdout_closed_still_starts_its_ranks(tmp_path):
    """A job started with stdout closed (``>&-``, some daemons): its ranks start, and what they print goes nowhere
    (not into a file or pipe that has since taken the descriptor's number)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               SHARDGEN_PROBE="closed")
    p = subprocess.run(["bash", "-c", 'exec "$0" -c "$1" "$2" >&-', sys.executable, CLOSED_STDOUT, str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["probe"] for r in range(2)] == ["closed", "closed"]


def test_every_models_pipeline_module_is_found_for_the_ranks_to_import_before_they_start():
    """The forkserver imports each model's pipeline module before forking the ranks; found through diffusers' lazy
    packages, so a diffusers that moved its classes would make every local launch slower, not fail: this says so."""
    from shardgen.models.loader import pipeline_module

    for conf in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        name = OmegaConf.load(conf).get("pipeline")
        found = pipeline_module(name)
        assert found and found.startswith("diffusers.pipelines."), (conf.name, name, found)
    assert pipeline_module("FluxPipeline") == "diffusers.pipelines.flux.pipeline_flux"
    assert pipeline_module("NoSuchPipeline") is None
