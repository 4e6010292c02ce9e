"""CFG parallel (cfg_degree=2): the two branches of true CFG on two gloo ranks give the one-process image bytes,
alone and composed with tensor parallelism; every invalid combination is refused before any weight is read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.generate import run
from parallel.dims import ParallelConfigError, ParallelDims
from tests.conftest import ROOT, compose_cfg
from tests.test_generate import shard_images

TRUE_CFG = ("model.true_cfg_scale=4", "model.negative_prompt=blurry")
COMMON = ("height=64", "width=64", "steps=2", "prompts.limit=8", "samples_per_shard=4", "batch_size=4",
          "progress=false", *TRUE_CFG)


def _job(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.generate", f"run_dir={run_dir}", *COMMON, *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("cfg1") / "run"
    assert run(compose_cfg(f"run_dir={d}", *COMMON)).ok == 8
    return shard_images(d)


@pytest.mark.slow
# cfg_degree=2 alone (2 ranks) is the same hook on a mesh without tp; the 4-rank case also proves the cfg
# dimension composes with another one (tests/test_dims.py checks the shapes of both)
@pytest.mark.parametrize("overrides", [("cfg_degree=2", "strategy=tp", "tp_degree=2", "launcher=local",
                                        "launcher.nprocs=4")], ids=["cfg2xtp2"])
def test_cfg_parallel_gives_the_one_process_bytes(tmp_path, one_process, overrides):
    p = _job(tmp_path / "run", *overrides)
    assert p.returncode == 0, p.stderr[-3000:]
    # one rank of each pair computes each branch (a rank computing both would pass the byte check too)
    assert p.stderr.count("this rank computes the conditional branch") == p.stderr.count(
        "this rank computes the unconditional branch") >= 1, p.stderr[-3000:]
    images = shard_images(tmp_path / "run")
    assert sorted(images) == sorted(one_process)
    assert all(images[k] == one_process[k] for k in images), "cfg parallel changed the image bytes"


def test_true_cfg_really_runs_two_branches(tmp_path, one_process):
    """The reference is true CFG: without it (true_cfg_scale=1) the same prompts give other pixels."""
    d = tmp_path / "run"
    assert run(compose_cfg(f"run_dir={d}", *[o for o in COMMON if "true_cfg" not in o])).ok == 8
    plain = shard_images(d)
    assert sorted(plain) == sorted(one_process) and all(plain[k] != one_process[k] for k in plain)


@pytest.mark.parametrize("overrides,message", [
    (("cfg_degree=2", "model.true_cfg_scale=1"), "model.true_cfg_scale=1.0 turns true CFG off"),
    (("cfg_degree=3",), "use cfg_degree=1 or cfg_degree=2"),
    (("cfg_degree=2", "launcher.nprocs=3"), "do not divide the world of 3 ranks"),
    (("cfg_degree=2", "strategy=device_map"), "strategy=device_map runs one process per replica"),
])
def test_invalid_cfg_parallel_is_refused_before_anything_runs(tmp_path, overrides, message):
    """In process (jobs.generate prints a user error as one line, exit 2: tests/test_errors.py): refused with the
    message before a rank is spawned or anything is written."""
    from shardgen.errors import is_user_error

    base = [o for o in COMMON if o not in overrides and not any(o.split("=")[0] == x.split("=")[0] for x in overrides)]
    with pytest.raises(Exception) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *base, "launcher=local", "launcher.nprocs=2", *overrides))
    assert is_user_error(e.value) and message in str(e.value), repr(e.value)
    assert not (tmp_path / "run" / "shards").exists()


def test_guidance_distilled_pipeline_is_refused():
    from parallel.strategies import _check_cfg
    from parallel.transformer import sequence_shape

    cfg = compose_cfg("model=flux2_dev", "cfg_degree=2", "model.true_cfg_scale=4")
    with pytest.raises(ParallelConfigError, match="Flux2Pipeline has no true classifier-free guidance"):
        _check_cfg(ParallelDims(world_size=2, strategy="dp", cfg=2), cfg, sequence_shape(cfg))


def test_cfg_dimension_composes_on_the_mesh():
    dims = ParallelDims(world_size=8, strategy="cp_ulysses", ulysses=2, cfg=2)
    assert (dims.replica_size, dims.dp) == (4, 2)
    assert dims.replica_dims() == (("cfg", 2), ("ring", 1), ("ulysses", 2))
    assert ParallelDims(world_size=8, strategy="tp", tp=2, cfg=2).replica_dims() == (("cfg", 2), ("tp", 2))
    assert "cfg_degree=2" in dims.describe()


def test_auto_keeps_both_branches_on_one_gpu_unless_they_do_not_fit():
    """strategy=auto with true CFG: dp (branches batched on one GPU) while they fit; cfg_degree=2 when the two
    branches' activations together would not fit and the ranks pair up; never with an odd rank count."""
    from dataclasses import replace

    from parallel.auto import choose
    from tests.test_strategies import FLUX_DEV, GiB

    qwen = replace(FLUX_DEV, true_cfg=True)
    dims, why = choose(qwen)
    assert (dims.strategy, dims.cfg) == ("dp", 1) and "two branches run on the same GPU" in why[-1]
    # a wide transformer (hidden 16384): one branch's activations ~9 GiB fit next to the 31.5 GiB of weights in
    # 45 GiB, both branches batched (~18 GiB) do not
    tight = replace(qwen, hidden=16384, free_bytes=int(50 * GiB))
    dims, why = choose(tight)
    assert (dims.strategy, dims.cfg, dims.replica_size) == ("dp", 2, 2) and "cfg_degree=2" in why[-1]
    dims, _ = choose(replace(tight, world_size=3))
    assert (dims.strategy, dims.cfg) == ("dp", 1)


def test_cfg_batching_and_cfg_parallel_are_exclusive():
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match="choose one"):
        validate_config(compose_cfg("cfg_degree=2", "cfg_batching=true", *TRUE_CFG))
