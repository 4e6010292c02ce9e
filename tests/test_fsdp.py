"""strategy=fsdp: the transformer sharded with FSDP2 over a replica's ranks gives one process's images, with
about 1/degree of the transformer's weights on each rank; its degrees checked before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel.dims import ParallelConfigError, ParallelDims
from parallel.memory import weights_per_process
from tests.conftest import compose_cfg, join_gloo_world, start_ranks


def test_fsdp_shape_and_weight_share():
    d = ParallelDims(world_size=8, strategy="fsdp", degree=2, cfg=2)
    assert (d.dp, d.replica_size, d.replica_dims(), d.describe()) == (
        2, 4, (("cfg", 2), ("fsdp", 2)), "cfg_degree=2 strategy.degree=2")
    assert d.kind.splits_transformer and not d.kind.one_gpu_per_replica
    assert weights_per_process({"transformer": 1000, "vae": 100}, 2, d) == (500 + 100) * 2


@pytest.mark.parametrize("overrides,needle", [
    (("strategy=fsdp", "strategy.degree=1"), r"strategy=fsdp needs strategy.degree >= 2 \(got 1\)"),
    (("strategy=fsdp", "strategy.degree=2", "tp_degree=2"), "strategy=fsdp ignores tp_degree"),
    (("strategy=fsdp", "strategy.degree=2"), "do not divide the world of 3 ranks"),
])
def test_fsdp_misconfiguration_says_what_to_change(overrides, needle):
    from parallel.strategies import parallel_dims

    with pytest.raises(ParallelConfigError, match=needle):
        parallel_dims(compose_cfg(*overrides), 3)


def _fsdp_rank(rank: int, cfg_yaml: str, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks: the single-process pipeline, then strategy=fsdp strategy.degree=2 from apply_strategy."""
    import torch
    from omegaconf import OmegaConf

    from parallel import world as W
    from parallel.fsdp import local_bytes
    from parallel.strategies import apply_strategy, parallel_dims
    from shardgen.models.loader import load_pipeline, torch_dtype
    from shardgen.run.generation import GenSettings, pipeline_kwargs

    world = join_gloo_world(rank, port)
    cfg = OmegaConf.create(cfg_yaml)
    settings = GenSettings.from_cfg(cfg)
    prompts, seeds = ["a cat", "an astronaut riding a horse"], [11, 12]
    with torch.no_grad():
        ref = load_pipeline(cfg.model, torch_dtype(cfg.dtype), world.device)
        ref_img = ref(**pipeline_kwargs(ref, settings, prompts, seeds)).images
        dims = parallel_dims(cfg, 2)
        dims.build_mesh(world.device.type)
        pipe = apply_strategy(cfg, world, dims)
        img = pipe(**pipeline_kwargs(pipe, settings, prompts, seeds)).images
        again = pipe(**pipeline_kwargs(pipe, settings, prompts, seeds)).images  # shards freed and gathered again
    result = dict(same=torch.equal(img, ref_img) and torch.equal(again, ref_img), shape=list(img.shape),
                  whole=local_bytes(ref.transformer), local=local_bytes(pipe.transformer))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    W.shutdown()


@pytest.mark.slow
def test_fsdp2_gives_one_process_images_with_half_the_transformer_per_rank(tmp_path):
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    cfg = compose_cfg("strategy=fsdp", "strategy.degree=2", "height=64", "width=64", "steps=2")
    start_ranks(_fsdp_rank, (OmegaConf.to_yaml(cfg), free_port(), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(results)
    for res in results:
        assert res["same"] and res["shape"] == [2, 3, 64, 64]
        assert res["local"] <= res["whole"] * 0.55  # half, and a little for dim-0 padding of odd sizes
    assert sum(r["local"] for r in results) == results[0]["whole"]  # the shards together are the whole


TRUE_CFG = ("model.true_cfg_scale=4", "model.negative_prompt=blurry")
JOB = ("height=64", "width=64", "steps=2", "prompts.limit=4", "samples_per_shard=4", "batch_size=4", "progress=false",
       *TRUE_CFG)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [("launcher.nprocs=2",), ("cfg_degree=2", "launcher.nprocs=4")],
                         ids=["fsdp2", "cfg2xfsdp2"])
def test_whole_job_writes_the_one_process_png_bytes(tmp_path, overrides):
    """The job with `strategy=fsdp strategy.degree=2 launcher=local`, alone and under CFG parallel: every rank
    shards the transformer, and the PNG bytes are one process's."""
    from jobs.generate import run
    from tests.test_generate import shard_images

    assert run(compose_cfg(f"run_dir={tmp_path / 'one'}", *JOB)).ok == 4
    run(compose_cfg("strategy=fsdp", "strategy.degree=2", "launcher=local", *overrides, f"run_dir={tmp_path / 'fsdp'}",
                    *JOB))
    rank_logs = sorted((tmp_path / "fsdp" / "logs").glob("rank*.log"))
    assert len(rank_logs) == int(overrides[-1].split("=")[1])
    assert all("fsdp: transformer sharded 2 ways" in log.read_text() for log in rank_logs)
    one, fsdp = shard_images(tmp_path / "one"), shard_images(tmp_path / "fsdp")
    assert sorted(fsdp) == sorted(one) and all(fsdp[k] == one[k] for k in one)
