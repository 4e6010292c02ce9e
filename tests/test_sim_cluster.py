"""The simulated cluster (benchmarks/sim_cluster.py): replicas killed at random still give every prompt exactly one
sample, through the real claims, takeovers, checkpoints and commits."""

import importlib.util
import tarfile
from pathlib import Path

import pytest

from shardgen.dataio.prompts.plan import load_plan, sample_key
from shardgen.dataio.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[1]


def _sim():
    spec = importlib.util.spec_from_file_location("sim_cluster", ROOT / "benchmarks" / "sim_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_random_kills_leave_every_prompt_in_exactly_one_sample(tmp_path):
    sim = _sim()
    fig = sim.simulate(tmp_path / "run", replicas=6, shards=30, per_shard=4, batch=2, gen_s=0.01, seconds=40,
                       kill_prob=0.06, lease_s=0.6, heartbeat_s=0.15, seed=3)
    assert fig["complete"] and fig["stuck"] == 0
    assert fig["kills"] > 0  # replicas did die mid-shard: their shards were taken over and continued
    assert fig["duplicated_samples"] == 0 and fig["commits_twice"] == 0
    run = RunDir(tmp_path / "run")
    plan = load_plan(run)
    for shard in range(plan.num_shards):
        with tarfile.open(run.shard_tar(shard)) as tar:  # every member, a repeated one included
            keys = sorted(name.split(".")[0] for name in tar.getnames() if name.endswith(".json"))
        assert keys == [sample_key(i) for i in plan.shard_range(shard)], shard
    assert not [p for p in run.claims_dir.iterdir()]  # every claim released after its commit
