"""fp8=true under strategy=tp: each rank quantises its own shard of every planned layer, and the layer does what the
shard's tensor-parallel hooks did (a row shard's partial products summed over the group, its bias added once), on
two gloo ranks; and under strategy=fsdp fp8 is refused before any weight is read (FSDP gathers each block's weights
in the run's dtype, so no layer would stay float8 while the samples said fp8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel.dims import ParallelConfigError
from tests.conftest import compose_cfg, join_gloo_world, start_ranks


def _rel(x, ref) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _tp_rank(rank: int, cfg_yaml: str, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks: a column shard then a row shard of a small MLP in float8, against the whole layers in
    float8 and exact; then the tiny FLUX pipeline under strategy=tp with fp8, against one process's fp8 images."""
    import copy

    import torch
    from omegaconf import OmegaConf
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from parallel import world as W
    from parallel.strategies import apply_strategy, parallel_dims
    from shardgen.families.flux import fused
    from shardgen.models.loader import load_pipeline, torch_dtype
    from shardgen.run.generation import GenSettings, pipeline_kwargs
    from shardgen.speed import fp8

    world = join_gloo_world(rank, port)
    cfg = OmegaConf.create(cfg_yaml)
    result = {}
    with torch.no_grad():
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 96))
        x = torch.randn(2, 10, 64)
        exact = mlp(x)
        whole = copy.deepcopy(mlp)
        whole[0], whole[2] = fp8.Float8Linear(whole[0]), fp8.Float8Linear(whole[2])
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        sharded_exact = mlp(x)
        mlp[0], mlp[2] = fp8.Float8Linear(mlp[0]), fp8.Float8Linear(mlp[2])
        out = mlp(x)
        result.update(shard_exact_err=_rel(sharded_exact, exact), fp8_err=_rel(out, exact),
                      whole_fp8_err=_rel(whole(x), exact), vs_whole_fp8=_rel(out, whole(x)),
                      shards=[mlp[0].weight_fp8.shape[0], mlp[2].weight_fp8.shape[1]],
                      layouts=[repr(mlp[0]), repr(mlp[2])], tp=fp8.is_tensor_parallel(mlp))

        settings = GenSettings.from_cfg(cfg)
        prompts, seeds = ["a cat", "an astronaut riding a horse"], [11, 12]
        ref = load_pipeline(cfg.model, torch_dtype(cfg.dtype), world.device)
        fp8.enable_fp8(ref.transformer)
        ref_img = ref(**pipeline_kwargs(ref, settings, prompts, seeds)).images
        dims = parallel_dims(cfg, 2)
        dims.build_mesh(world.device.type)
        pipe = apply_strategy(cfg, world, dims)
        converted = fp8.enable_fp8(pipe.transformer)
        img = pipe(**pipeline_kwargs(pipe, settings, prompts, seeds)).images
        result.update(converted=converted, image_err=_rel(img, ref_img), fused=fused.applicable(pipe.transformer))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    W.shutdown()


@pytest.mark.slow
def test_fp8_on_tensor_parallel_shards_computes_what_one_process_does(tmp_path):
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    cfg = compose_cfg("strategy=tp", "tp_degree=2", "height=64", "width=64", "steps=2")
    start_ranks(_tp_rank, (OmegaConf.to_yaml(cfg), free_port(), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(results)
    for r in results:
        assert r["shard_exact_err"] < 1e-5  # the sharded layers as torch runs them: the baseline
        assert r["shards"] == [128, 128]  # each rank quantised half the hidden features, in both layers
        assert "column shard" in r["layouts"][0] and "row shard" in r["layouts"][1] and r["tp"]
        # float8's own error, as the whole layers make it: a missing sum over the ranks or a bias added twice
        # would be tens of percent off
        assert r["whole_fp8_err"] < 0.08 and r["fp8_err"] < 1.2 * r["whole_fp8_err"] and r["vs_whole_fp8"] < 0.05
        assert r["converted"] > 0 and r["image_err"] < 0.05
        assert r["fused"] == "it is sharded for tensor parallelism"  # the fused blocks keep off a sharded model
    assert results[0]["image_err"] == results[1]["image_err"]  # both ranks of the replica made the same images


def test_fp8_with_fsdp_is_refused_before_any_weight_is_read():
    from parallel.strategies import parallel_dims

    cfg = compose_cfg("strategy=fsdp", "strategy.degree=2", "fp8=true")
    with pytest.raises(ParallelConfigError) as e:
        parallel_dims(cfg, 2)
    assert str(e.value).startswith("fp8=true cannot run under strategy=fsdp: ")
    assert "strategy=tp" in str(e.value) and "fp8=false" in str(e.value)
