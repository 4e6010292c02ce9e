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
        with tarfile.open(run.shard_file(shard)) as tar:  # every member, a repeated one included
            keys = sorted(name.split(".")[0] for name in tar.getnames() if name.endswith(".json"))
        assert keys == [sample_key(i) for i in plan.shard_range(shard)], shard
    assert not [p for p in run.claims_dir.iterdir()]  # every claim released after its commit


@pytest.mark.slow
def test_many_replicas_beaten_by_one_thread_commit_every_shard_once_without_a_takeover(tmp_path):
    """40 replicas, their claims kept alive by the simulation's one heartbeat thread (Claimer.beat): every shard
    committed once, no claim taken over (the lease never lapsed), and the tail is measured."""
    sim = _sim()
    fig = sim.simulate(tmp_path / "run", replicas=40, shards=100, per_shard=1, batch=1, gen_s=0.1, seconds=40,
                       lease_s=30.0, heartbeat_s=0.5, poll_s=0.05, seed=1)  # a lease no load on a shared box outlasts
    assert fig["complete"] and fig["stuck"] == 0 and fig["committed_shards"] == 100
    assert fig["takeovers"] == 0 and fig["commits_twice"] == 0 and fig["duplicated_samples"] == 0
    assert fig["heartbeat_ops"] > 0  # the shared thread did beat the claims held
    assert fig["tail_s"] is not None and 0 <= fig["tail_s"] < fig["run_s"]
    assert not list(RunDir(tmp_path / "run").claims_dir.iterdir())


@pytest.mark.slow
def test_claim_operations_per_shard_do_not_grow_with_the_shards_of_the_run(tmp_path):
    """The same 60 shards left to do on a run of 150 and of 3,000 shards (the rest committed): a claim costs
    about as many metadata operations on either (no listing per claim, no walk over the done ones)."""
    sim = _sim()
    figs = [sim.simulate(tmp_path / f"run{n}", replicas=12, shards=n, per_shard=1, batch=1, gen_s=0.02, seconds=40,
                         prefill_frac=1 - 60 / n, lease_s=4.0, heartbeat_s=1.0, poll_s=0.05, seed=2)
            for n in (150, 3000)]
    for fig in figs:
        assert fig["complete"] and fig["committed_shards"] == 60 and fig["duplicated_samples"] == 0
    small, large = (f["ops_per_shard"]["claim"] for f in figs)
    assert large < 1.5 * small + 3, (small, large)


@pytest.mark.slow
def test_replicas_killed_mid_shard_and_mid_upload_on_a_run_kept_in_a_bucket_commit_every_prompt_once(tmp_path, bucket):
    """The simulated cluster on a run kept in a bucket (the test S3 server): claims and done markers are objects,
    each shard committed by its upload and record; replicas killed while generating and between a shard's upload
    and its record, their shards taken over after the lease: read back from the bucket, every shard is done once and
    every prompt is in exactly one sample. The S3 requests are counted per shard and per heartbeat."""
    sim = _sim()
    fig = sim.simulate(tmp_path / "run", replicas=8, shards=40, per_shard=2, batch=1, gen_s=0.02, seconds=90,
                       kill_prob=0.08, kill_upload_prob=0.08, lease_s=3.0, heartbeat_s=0.5, seed=5,
                       store=f"s3://{bucket}/sim")
    assert fig["exactly_once"] and fig["complete"] and fig["stuck"] == 0, fig
    assert fig["kills"] > 0  # replicas did die: their shards were taken over once their claims expired
    assert fig["commits_twice"] == 0 and fig["duplicated_samples"] == 0 and fig["missing_samples"] == 0
    assert fig["committed_samples"] == 80 and fig["objects_not_as_uploaded"] == 0
    assert fig["claims_left"] == 0  # every claim released after its commit, a dead holder's by its successor
    assert fig["s3_per_shard_working"]["put_object"] >= 4  # claim, commit claim, tar, index, record
    assert 0.5 <= fig["s3_per_heartbeat"]["put_object"] <= 1  # a claim renewed is one conditional PutObject
    assert 0 < fig["store_requests_total"] < fig["s3_requests_total"]  # the uploads go around the stores' counters
    run = sim.RunDir.at(f"s3://{bucket}/sim")
    assert sorted(run.done_shards()) == list(range(40))
