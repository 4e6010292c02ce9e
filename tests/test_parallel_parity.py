"""Model parallelism gives the single-process numbers: TP-2 and Ulysses-2 under gloo on CPU, 2 real ranks.

The tiny model runs in float64, so a split computation differs from the single-process one only by the
order of its floating-point sums: ~1e-15 relative. The bounds below (1e-10 on the transformer output and
on the decoded [0, 1] images) leave five orders of magnitude for that, and still catch any real mistake
(a wrong shard, a missed all-reduce, a misordered gather: those give differences of order 1e-2 and up).
The whole jobs (on a prompt file whose rows set their own sizes and guidance) then write the same PNG pixels as a
one-rank run: a drift of 1e-12 can change an 8-bit
value only if the exact value sits within 1e-12 of a rounding boundary, so we allow at most 1 level,
and in practice see none.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import verify_run
from tests.conftest import compose_cfg, join_gloo_world, start_ranks
from tests.test_generate import shard_images

pytestmark = pytest.mark.slow
TRANSFORMER_TOL = 1e-10
IMAGE_TOL = 1e-10
COMMON = ("height=64", "width=64", "steps=2", "prompts.limit=8", "samples_per_shard=4", "batch_size=4",
          "progress=false")


def _transformer_inputs(torch):
    """Inputs shaped like the tiny pipeline's at 128x128: 64 image tokens, 32 text tokens."""
    g = torch.Generator().manual_seed(1)
    d = dict(dtype=torch.float64)
    img_ids = torch.zeros(64, 3, **d)
    img_ids[:, 1], img_ids[:, 2] = torch.arange(64) // 8, torch.arange(64) % 8
    return dict(hidden_states=torch.randn(1, 64, 64, generator=g, **d),
                encoder_hidden_states=torch.randn(1, 32, 32, generator=g, **d),
                pooled_projections=torch.randn(1, 32, generator=g, **d), timestep=torch.tensor([0.5], **d),
                guidance=torch.tensor([3.5], **d), img_ids=img_ids, txt_ids=torch.zeros(32, 3, **d), return_dict=False)


def _parity_rank(rank: int, cfg_yaml: str, port: int, out_dir: str) -> None:
    """One of 2 ranks: the single-process reference (with the config's LoRA adapters, as dp applies them), then
    TP-2 and Ulysses-2 built by the strategies."""
    import torch
    from omegaconf import OmegaConf

    from shardgen.run.generation import GenSettings, pipeline_kwargs
    from shardgen.models import lora
    from shardgen.models.loader import load_pipeline, torch_dtype
    from parallel import world as W
    from parallel.dims import ParallelDims
    from parallel.strategies import apply_strategy

    world = join_gloo_world(rank, port)
    cfg = OmegaConf.create(cfg_yaml)
    settings = GenSettings.from_cfg(cfg)
    prompts, seeds = ["a cat", "an astronaut riding a horse"], [11, 12]
    with torch.no_grad():
        ref = lora.apply(load_pipeline(cfg.model, torch_dtype(cfg.dtype), world.device), cfg)
        ref_out = ref.transformer(**_transformer_inputs(torch))[0]
        ref_img = ref(**pipeline_kwargs(ref, settings, prompts, seeds)).images
        results = {}
        for name, degrees in (("tp", dict(tp=2)), ("cp_ulysses", dict(ulysses=2, attention_backend="native"))):
            dims = ParallelDims(world_size=2, strategy=name, **degrees)
            dims.build_mesh(world.device.type)
            pipe = apply_strategy(cfg, world, dims)
            out = pipe.transformer(**_transformer_inputs(torch))[0]
            img = pipe(**pipeline_kwargs(pipe, settings, prompts, seeds)).images
            results[name] = dict(transformer=(out - ref_out).abs().max().item(),
                                 images=(img - ref_img).abs().max().item(), shape=list(img.shape),
                                 ref_scale=ref_out.abs().max().item())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    W.shutdown()


def test_tp2_and_ulysses2_match_one_process(tmp_path):
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    cfg = compose_cfg("height=128", "width=128", "steps=2")
    start_ranks(_parity_rank, (OmegaConf.to_yaml(cfg), free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: {res}")
        for name in ("tp", "cp_ulysses"):
            assert res[name]["shape"] == [2, 3, 128, 128]
            assert res[name]["transformer"] <= TRANSFORMER_TOL, (name, res[name])
            assert res[name]["images"] <= IMAGE_TOL, (name, res[name])


# Rows of three shapes with their own negative prompts, guidance and true CFG (prompts.row_settings), so the
# whole jobs below also check per-row settings under model parallelism: every image has its row's size. Each size
# gives an even number of image tokens (Ulysses-2 splits them): 64x64 -> 16, 32x64 -> 8, 96x48 -> 18.
MIXED = [dict(prompt="a cat"), dict(prompt="a dog", width=32, height=64, true_cfg_scale=2.0, negative_prompt="blurry"),
         dict(prompt="a car", aspect_ratio="2:1", guidance=5.0), dict(prompt="a tree"),
         dict(prompt="a boat", width=32, height=64, true_cfg_scale=2.0, negative_prompt="dark"),
         dict(prompt="a hat", aspect_ratio="2:1", guidance=5.0), dict(prompt="a cup"),
         dict(prompt="a pen", width=32, height=64, true_cfg_scale=2.0)]  # 3 pipeline calls a shard
MIXED_SIZES = [(64, 64), (32, 64), (96, 48), (64, 64), (32, 64), (96, 48), (64, 64), (32, 64)]  # (width, height)
ROW_ARGS = ("prompts=jsonl", "prompts.row_settings=[width,height,aspect_ratio,negative_prompt,guidance,true_cfg_scale]")


@pytest.fixture(scope="module")
def mixed_prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "mixed.jsonl"
    path.write_text("".join(json.dumps(dict(r, seed=10 + i)) + "\n" for i, r in enumerate(MIXED)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, mixed_prompts) -> dict[str, bytes]:
    from jobs.generate import run

    d = tmp_path_factory.mktemp("one") / "run"
    assert run(compose_cfg(f"run_dir={d}", *COMMON, *ROW_ARGS, f"prompts.path={mixed_prompts}")).ok == 8
    return shard_images(d)


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


@pytest.mark.parametrize("strategy", [("strategy=tp", "tp_degree=2"), ("strategy=cp_ulysses", "ulysses_degree=2")],
                         ids=["tp2", "ulysses2"])
def test_whole_job_matches_one_rank(tmp_path, one_rank, mixed_prompts, strategy):
    """The job with `strategy=... launcher=local launcher.nprocs=2`, on a prompt file whose rows set their own
    size, negative prompt, guidance and true CFG: a complete run that jobs.verify accepts, every image of its row's
    size, with the one-rank run's pixels."""
    from jobs.generate import run

    run_dir = tmp_path / "run"
    run(compose_cfg(*strategy, "launcher=local", "launcher.nprocs=2", f"run_dir={run_dir}", *COMMON, *ROW_ARGS,
                    f"prompts.path={mixed_prompts}"))
    rep = verify_run(load_plan(RunDir(run_dir)))  # what jobs.verify checks, in process (each image's size too)
    assert rep.ok, rep.defects
    images = shard_images(run_dir)
    assert sorted(images) == sorted(one_rank)
    assert [_pixels(images[k]).shape[1::-1] for k in sorted(images)] == MIXED_SIZES
    worst = max(int(np.abs(_pixels(images[k]) - _pixels(one_rank[k])).max()) for k in images)
    identical = sum(images[k] == one_rank[k] for k in images)
    print(f"{strategy}: max pixel difference vs one rank = {worst} levels; {identical}/8 PNGs byte-identical")
    assert worst <= 1
