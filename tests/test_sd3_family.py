"""Stable Diffusion 3.5 Large (shardgen/families/sd3.py): the published sizes on meta, and a scaled-down copy of
its dummy architecture run end to end through the job (model.weights=dummy strategy=auto) and through
device_map's staged encoding. The full-size dummy (8.1B transformer) needs a GPU."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from PIL import Image

from tests.conftest import compose_cfg
from tests.test_generate import shard_images

_CLIP = dict(hidden_size=32, intermediate_size=37, projection_dim=32, num_hidden_layers=1, num_attention_heads=2)
# Same classes and code paths, tiny widths: two 32-wide CLIPs pool to 64 = the transformer's pooled width; T5 is
# 64 wide, the joint attention width the CLIP embeddings are padded to.
SMALL = {
    "transformer": dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                        caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=16, sample_size=8),
    "vae": dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4),
    "text_encoder": _CLIP, "text_encoder_2": _CLIP,
    "text_encoder_3": dict(d_model=64, d_ff=37, d_kv=8, num_layers=1, num_heads=4),
}


def test_sd35_large_has_the_published_sizes_and_token_rules():
    from parallel.transformer import sequence_shape
    from shardgen.families import family_of
    from shardgen.models.dummy import construct_meta, dummy_architecture

    params = {n: sum(p.numel() for p in construct_meta(s).parameters()) for n, s in dummy_architecture("sd35_large").items()
              if s.library in ("diffusers", "transformers") and not s.cls.endswith("Scheduler")}
    assert round(params["transformer"] / 1e9, 2) == 8.06  # "8.1B parameters" (the model card)
    assert params["text_encoder"] == 123_650_304 and params["text_encoder_2"] == 694_659_840  # CLIP-L, bigG + proj.
    assert round(params["text_encoder_3"] / 1e9, 2) == 4.76 and family_of("StableDiffusion3Pipeline").name.startswith(
        "Stable Diffusion 3")
    # 1024/16 squared image tokens; CLIP's 77 + T5's 256 text tokens in the joint attention
    sequence = sequence_shape(compose_cfg("model=sd35_large"))
    assert (sequence.image, sequence.text) == (4096, 333)


@pytest.fixture
def small_sd3(monkeypatch):
    """model.weights=dummy builds the scaled-down SD3.5 Large (the job's loader calls the patched builder)."""
    from shardgen.models import dummy

    monkeypatch.setattr(dummy, "build_dummy_pipeline", functools.partial(dummy.build_dummy_pipeline, overrides=SMALL))


def test_sd35_dummy_runs_through_the_job_with_strategy_auto(small_sd3, tmp_path):
    from jobs.generate import run

    run_dir = tmp_path / "run"
    cfg = compose_cfg("model=sd35_large", "model.weights=dummy", "strategy=auto", "dtype=float32", "height=64",
                      "width=64", "steps=2", "model.max_sequence_length=16", "prompts.limit=2", "batch_size=2",
                      "samples_per_shard=2", f"run_dir={run_dir}", "progress=false",
                      "check_memory=false")  # the check sizes the full 13.7B-parameter pipeline: 51 GiB in float32
    assert run(cfg).ok == 2
    images = shard_images(run_dir)
    assert len(images) == 2 and all(Image.open(io.BytesIO(b)).size == (64, 64) for b in images.values())


def test_sd35_staged_encoding_gives_the_pipelines_pixels():
    """device_map's StagedPipeline encodes with the family's encode outputs (negatives included): same pixels."""
    from parallel.device_map import StagedPipeline
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.run.generation import GenSettings, pipeline_kwargs

    pipe = build_dummy_pipeline("sd35_large", "cpu", torch.float32, overrides=SMALL)
    staged = StagedPipeline(pipe, torch.device("cpu"), offloaded=["text_encoder_3"])
    s = GenSettings(height=32, width=32, steps=2, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=16, model="sd35_large",
                    strategy="device_map")
    ours = staged(**pipeline_kwargs(staged, s, ["a cat", "a dog"], [1, 2])).images
    theirs = pipe(**pipeline_kwargs(pipe, s, ["a cat", "a dog"], [1, 2])).images
    assert ours.shape == (2, 3, 32, 32) and torch.equal(ours, theirs)
