"""Conditioning images per row (prompts.row_settings=[image,strength], shardgen/models/condition.py) on the tiny
image-to-image model: pixels independent of the batch, the input's sha256 in each sample's json and the index,
every unusable input rejected with its reason while the rest of the run completes."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jobs.generate import run
from shardgen.config.validate import ConfigError
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.prompts.read import PromptFileError
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import read_shard_members, verify_run
from tests.conftest import compose_cfg
from tests.test_generate import shard_images

FAST = ("model=tiny_img2img", "height=64", "width=64", "progress=false", "prompts=jsonl")
IMAGES = "prompts.row_settings=[image,strength]"


def png(path: Path, seed: int, size: tuple[int, int] = (80, 96)) -> Path:
    """A noise PNG of ``size`` (width, height) from ``seed``."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def bomb_png(path: Path, side: int = 100_000) -> Path:
    """A valid-looking PNG header declaring ``side`` x ``side`` pixels, with almost no data: a decompression bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    head = chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + head + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gen(run_dir: Path, prompts: Path, *extra: str):
    return run(compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *FAST, IMAGES, *extra))


def jsons(run_dir: Path) -> dict[str, dict]:
    return {k: json.loads(m["json"]) for tar in sorted((run_dir / "shards").glob("*.tar"))
            for k, m in read_shard_members(tar).items()}


def index_rows(run_dir: Path) -> dict[int, dict]:
    return {r["index"]: r for f in sorted((run_dir / "shards").glob("*.parquet")) for r in pq.read_table(f).to_pylist()}


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    png(d / "a.png", seed=0)
    Image.new("RGB", (80, 96), (20, 60, 220)).save(d / "b.png")  # far from a's noise
    png(d / "c.png", seed=2)
    rows = [dict(prompt="a cat", image="a.png", seed=11), dict(prompt="a cat", image="b.png", seed=11),
            dict(prompt="a dog", image=str(d / "c.png"), seed=12, strength=0.9),
            dict(prompt="a dog", image="a.png", seed=13)]
    write_rows(d / "rows.jsonl", rows)
    return d


@pytest.fixture(scope="module")
def batch3(inputs, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("b3") / "run"
    assert gen(d, inputs / "rows.jsonl", "batch_size=3", "samples_per_shard=4").ok == 4
    return d


def test_batch_size_does_not_change_the_bytes_and_a_row_alone_makes_the_same(inputs, batch3, tmp_path):
    assert gen(tmp_path / "b1", inputs / "rows.jsonl", "batch_size=1", "samples_per_shard=4").ok == 4
    both = shard_images(batch3)
    assert shard_images(tmp_path / "b1") == both
    rows = (inputs / "rows.jsonl").read_text().splitlines()
    write_rows(inputs / "one.jsonl", [json.loads(rows[2])])  # the same row alone (its own seed), in the same folder
    assert gen(tmp_path / "one", inputs / "one.jsonl").ok == 1
    assert list(shard_images(tmp_path / "one").values()) == [both["0000000002"]]


def test_another_input_image_gives_other_pixels(batch3):
    images = shard_images(batch3)  # rows 0 and 1: the same prompt and seed, images a and b
    # the tiny model's random transformer washes most of an input out at strength 0.6; what is left differs
    assert np.abs(pixels(images["0000000000"]) - pixels(images["0000000001"])).mean() > 0.5


def test_the_inputs_sha256_is_in_each_samples_json_and_the_index(inputs, batch3):
    import hashlib

    digest = {n: hashlib.sha256((inputs / f"{n}.png").read_bytes()).hexdigest() for n in "abc"}
    meta, index = jsons(batch3), index_rows(batch3)
    want = {0: "a", 1: "b", 2: "c", 3: "a"}
    for i, name in want.items():
        m = meta[f"{i:010d}"]
        assert m["input_image"]["sha256"] == digest[name] == index[i]["input_image_sha256"]
        assert (m["input_image"]["width"], m["input_image"]["height"]) == (80, 96)  # the size it had, before fitting
    assert meta["0000000000"]["input_image"]["path"] == "a.png"  # as the row wrote it
    assert [meta[f"{i:010d}"]["strength"] for i in range(4)] == [0.6, 0.6, 0.9, 0.6]  # the run's, else the row's
    assert verify_run(load_plan(RunDir(batch3))).ok


def test_strength_is_diffusers_own_near_zero_and_at_one(tmp_path):
    import torch
    from diffusers import FluxImg2ImgPipeline

    from shardgen.families.flux.tiny import tiny_model_path
    from shardgen.run.generation import to_pixels

    Image.new("RGB", (64, 64), (200, 40, 90)).save(tmp_path / "red.png")
    png(tmp_path / "noise.png", seed=5, size=(64, 64))
    rows = [dict(prompt="a cat", image=n, seed=3, strength=s) for s in (0.25, 1.0) for n in ("red.png", "noise.png")]
    assert gen(tmp_path / "run", write_rows(tmp_path / "p.jsonl", rows), "batch_size=2").ok == 4
    out = [pixels(v) for _, v in sorted(shard_images(tmp_path / "run").items())]
    pipe = FluxImg2ImgPipeline.from_pretrained(str(tiny_model_path()), dtype=torch.float64)
    pipe.set_progress_bar_config(disable=True)
    for row, got in zip(rows, out):  # each sample is what diffusers makes of its row, called directly
        want = pipe(prompt=row["prompt"], image=Image.open(tmp_path / row["image"]), strength=row["strength"],
                    height=64, width=64, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32,
                    generator=torch.Generator("cpu").manual_seed(3), output_type="pt").images
        assert np.array_equal(got, to_pixels(want)[1][0]), row
    assert not np.array_equal(out[0], out[1])  # 0.25 of 4 steps: one step from each image, whose content shows
    assert np.array_equal(out[2], out[3])  # 1: the image entirely replaced by noise, as diffusers' strength=1 does


def test_a_strength_below_one_step_is_a_bad_row_at_planning(tmp_path):
    png(tmp_path / "a.png", seed=0)
    with pytest.raises(PromptFileError, match=r"p.jsonl:1: strength: 0.1 of 4 steps is less than one denoising step"):
        gen(tmp_path / "run", write_rows(tmp_path / "p.jsonl", [dict(prompt="x", image="a.png", strength=0.1)]))
    assert not (tmp_path / "run" / "shards").exists()


BAD = {  # row image -> what its reject says
    "missing.png": "missing.png does not exist",
    "link.png": "link.png is a symbolic link",
    "folder": "folder is a directory",
    "empty.png": "empty.png is empty (0 bytes)",
    "garbage.png": "garbage.png is not a PNG, JPEG or WebP image",
    "cut.png": "cut.png does not decode whole",
    "cut.jpg": "cut.jpg does not decode whole",
    "bomb.png": "bomb.png declares too many pixels",
}


@pytest.fixture
def bad_inputs(tmp_path) -> Path:
    good = png(tmp_path / "good.png", seed=1)
    (tmp_path / "link.png").symlink_to(good)
    (tmp_path / "folder").mkdir()
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "garbage.png").write_bytes(b"not an image at all " * 20)
    (tmp_path / "cut.png").write_bytes(good.read_bytes()[:300])
    Image.open(good).save(tmp_path / "whole.jpg", quality=90)
    (tmp_path / "cut.jpg").write_bytes((tmp_path / "whole.jpg").read_bytes()[:700])
    bomb_png(tmp_path / "bomb.png")
    rows = [dict(prompt="good", image="good.png")] + [dict(prompt=n, image=n) for n in BAD]
    rows += [dict(prompt="no image"), dict(prompt="good too", image="whole.jpg"),
             dict(prompt="remote", image="s3://bucket/cat.png")]
    write_rows(tmp_path / "p.jsonl", rows)
    return tmp_path


def test_every_unusable_input_rejects_its_row_with_the_reason_and_the_rest_completes(bad_inputs, capsys):
    res = gen(bad_inputs / "run", bad_inputs / "p.jsonl", "prompts.on_bad_row=skip", "batch_size=3")
    assert (res.ok, res.rejected) == (2, len(BAD) + 2)
    index = index_rows(bad_inputs / "run")
    assert [index[i]["status"] for i in (0, len(BAD) + 2)] == ["ok", "ok"]
    for i, says in enumerate(BAD.values(), 1):
        assert index[i]["status"] == "rejected" and f"rejected: image: {bad_inputs}/{says}" in index[i]["error"]
    assert "image: this model makes each sample from an input image: give the row one" in index[len(BAD) + 1]["error"]
    assert "'s3://bucket/cat.png' is a URL: input images are read from local files" in index[len(BAD) + 3]["error"]
    rep = verify_run(load_plan(RunDir(bad_inputs / "run")))
    assert rep.ok, rep.defects


def test_with_on_bad_row_error_a_missing_image_stops_planning_at_its_line(bad_inputs):
    with pytest.raises(PromptFileError, match=r"e.jsonl:2: image: .*missing.png does not exist"):
        gen(bad_inputs / "run", write_rows(bad_inputs / "e.jsonl", [dict(prompt="a", image="good.png"),
                                                                    dict(prompt="b", image="missing.png")]))


def test_parquet_image_bytes(tmp_path):
    import pyarrow as pa

    good = png(tmp_path / "a.png", seed=0).read_bytes()
    table = pa.table({"prompt": ["a", "b", "c", "d"], "image": [good, b"", b"garbage" * 9, {"bytes": good}["bytes"]],
                      "seed": [1, 2, 3, 1]})
    pq.write_table(table, tmp_path / "p.parquet")
    res = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={tmp_path / 'p.parquet'}", *FAST[:-1],
                          "prompts=parquet", IMAGES, "prompts.on_bad_row=skip"))
    assert (res.ok, res.rejected) == (2, 2)
    index = index_rows(tmp_path / "run")
    assert "image is empty" in index[1]["error"] and "is not a PNG, JPEG or WebP image" in index[2]["error"]
    import hashlib

    assert index[0]["input_image_sha256"] == index[3]["input_image_sha256"] == hashlib.sha256(good).hexdigest()
    assert json.loads(index[0]["json"])["input_image"]["path"] is None
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_a_model_without_image_input_refuses_image_rows_before_any_weight(tmp_path):
    with pytest.raises(ConfigError, match="takes no input image"):
        run(compose_cfg(f"run_dir={tmp_path}", "prompts=jsonl", f"prompts.path={tmp_path / 'p.jsonl'}", IMAGES))
    with pytest.raises(ConfigError, match=r"makes each sample from an input image: add image to prompts.row_settings"):
        run(compose_cfg(f"run_dir={tmp_path}", "model=tiny_img2img"))
    with pytest.raises(ConfigError, match=r"a txt prompt file has no field to name one"):
        run(compose_cfg(f"run_dir={tmp_path}", "model=tiny_img2img", IMAGES))  # examples/prompts.txt
    assert not any(tmp_path.iterdir())


def test_a_changed_image_on_resume_makes_the_rows_still_to_make_from_the_new_content(tmp_path):
    """The run's fingerprint covers the prompt file, not the images: a row generated after its image changed is made
    from the new content, and its json says which; samples already made keep theirs."""
    png(tmp_path / "a.png", seed=0)
    png(tmp_path / "b.png", seed=1)
    rows = write_rows(tmp_path / "p.jsonl", [dict(prompt="x", image="a.png"), dict(prompt="y", image="b.png")])
    args = ("samples_per_shard=1", "batch_size=1")
    gen(tmp_path / "run", rows, *args)
    before, old = shard_images(tmp_path / "run"), jsons(tmp_path / "run")
    png(tmp_path / "b.png", seed=7)  # changed; and its row's shard is lost, so it is made again
    for name in ("000001.stats.json", "000001.tar"):
        (tmp_path / "run" / "shards" / name).unlink()
    assert gen(tmp_path / "run", rows, *args).generated_here == 1
    after, new = shard_images(tmp_path / "run"), jsons(tmp_path / "run")
    assert after["0000000000"] == before["0000000000"] and new["0000000000"] == old["0000000000"]
    assert after["0000000001"] != before["0000000001"]
    assert new["0000000001"]["input_image"]["sha256"] != old["0000000001"]["input_image"]["sha256"]
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


# --- image-to-video: the tiny Wan model -------------------------------------------------------------------------

VIDEO = ("model=tiny_video_i2v", "height=32", "width=32", "num_frames=5", "steps=2", "progress=false", "prompts=jsonl",
         "prompts.row_settings=[image]")


def test_image_to_video_rows_batch_by_image_and_batching_does_not_change_the_bytes(inputs, tmp_path):
    from tests.test_video import shard_videos

    rows = [dict(prompt="a cat", image=n, seed=s) for n, s in (("a.png", 1), ("b.png", 1), ("a.png", 2), ("b.png", 3))]
    prompts = write_rows(inputs / "video.jsonl", rows)
    made = {}
    for batch in (1, 3):
        d = tmp_path / f"b{batch}"
        assert run(compose_cfg(f"run_dir={d}", f"prompts.path={prompts}", *VIDEO, f"batch_size={batch}")).ok == 4
        made[batch] = shard_videos(d)
    assert made[1] == made[3]
    assert made[1]["0000000000"] != made[1]["0000000001"]  # the same seed and prompt, another first frame
    meta = jsons(tmp_path / "b3")
    assert meta["0000000000"]["input_image"]["sha256"] == meta["0000000002"]["input_image"]["sha256"] != \
        meta["0000000001"]["input_image"]["sha256"]
    assert "strength" not in meta["0000000000"]  # image-to-video takes none
    assert verify_run(load_plan(RunDir(tmp_path / "b3"))).ok


def test_wan22_i2v_dummy_has_the_published_size_and_runs_both_experts_from_an_image():
    """Wan2.2-I2V-A14B: the T2V A14B experts with 36 input channels (20 more of the 1x2x2 patch embedding's 5120
    outputs), the second expert below t = 0.9 * 1000; a scaled-down build runs both from an input image."""
    import torch

    from shardgen.models.dummy import build_dummy_pipeline, construct_meta, dummy_architecture

    arch = dummy_architecture("wan22_i2v_a14b", pipeline="WanImageToVideoPipeline")
    assert sum(p.numel() for p in construct_meta(arch["transformer"]).parameters()) == 14_288_491_584 + 20 * 5120 * 4
    tiny_tr = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=1, text_dim=32, freq_dim=32)
    pipe = build_dummy_pipeline("wan22_i2v_a14b", "cpu", torch.float32, pipeline="WanImageToVideoPipeline", overrides=dict(
        transformer=tiny_tr, transformer_2=tiny_tr, text_encoder=dict(d_model=32, d_ff=37, d_kv=8, num_layers=1,
                                                                      num_heads=4, vocab_size=1000),
        vae=dict(base_dim=4, decoder_base_dim=2, dim_mult=[1, 1, 2, 2], num_res_blocks=1)))
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and pipe.config.boundary_ratio == 0.9
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    out = pipe(prompt="a cat", image=Image.new("RGB", (32, 32), (10, 200, 30)), height=32, width=32, num_frames=5,
               num_inference_steps=4, guidance_scale=3.5, max_sequence_length=16, output_type="pt")
    assert out.frames.shape == (1, 5, 3, 32, 32)
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0


# --- edit: FLUX.1 Kontext on the tiny model ---------------------------------------------------------------------

def test_edit_rows_with_and_without_an_image_and_batching_does_not_change_the_bytes(inputs, tmp_path):
    rows = [dict(prompt="a cat", image="a.png", seed=1), dict(prompt="a cat", seed=1),
            dict(prompt="a cat", image="b.png", seed=1), dict(prompt="a dog", image="a.png", seed=2)]
    prompts = write_rows(inputs / "edit.jsonl", rows)
    made = {}
    for batch in (1, 3):
        d = tmp_path / f"b{batch}"
        assert run(compose_cfg(f"run_dir={d}", f"prompts.path={prompts}", "model=tiny_kontext", "height=64",
                               "width=64", "progress=false", "prompts=jsonl", "prompts.row_settings=[image]",
                               f"batch_size={batch}")).ok == 4
        made[batch] = shard_images(d)
    assert made[1] == made[3]
    assert len({made[1][f"{i:010d}"] for i in range(3)}) == 3  # image a, no image, image b: three images
    meta = jsons(tmp_path / "b3")
    assert "input_image" not in meta["0000000001"] and meta["0000000000"]["input_image"]["path"] == "a.png"
    assert pixels(made[1]["0000000000"]).shape == (64, 64, 3)  # the sample's size, not Kontext's preferred one


def test_verify_names_a_sample_made_from_another_image_than_its_rows(batch3):
    from shardgen.tools.verify import _check_content

    plan = load_plan(RunDir(batch3))
    row = plan.rows(0)[1]  # image b.png
    meta = jsons(batch3)["0000000001"]
    assert _check_content("k", meta, row.prompt.encode(), row, None) == []
    other = dict(meta, input_image=dict(meta["input_image"], path="a.png"))
    assert _check_content("k", other, row.prompt.encode(), row, None) == \
        ["k: made from input image 'a.png', its row (line 2) names 'b.png'"]


# --- FLUX.2 reference images: the scaled-down FLUX.2-dev dummy through the generation code --------------------------

def test_flux2_reference_images_reach_the_transformer_and_batching_does_not_change_the_pixels(inputs, monkeypatch):
    import contextlib

    import torch

    from shardgen.speed import accel

    from shardgen.dataio.prompts.plan import PlannedRow
    from shardgen.models.condition import InputImage
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.run.generation import GenSettings, generate_batch
    from tests.test_dummy_models import SMALL

    pipe = build_dummy_pipeline("Flux2Pipeline", "cpu", torch.float64, overrides=SMALL["Flux2Pipeline"])
    tokens = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: tokens.append(tuple(kw["hidden_states"].shape[:2])),
                                               with_kwargs=True)
    s = GenSettings(height=64, width=64, steps=2, guidance=4.0, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=32, model="flux2_dev", strategy="dp", input_image="optional",
                    image_per_call=True, image_in_sequence=True, batch_size=3)
    shapes = []  # the attention shape each call's SDPA kernel is chosen for
    monkeypatch.setattr(accel, "sdpa_context", lambda pipe, opts, shape: shapes.append(shape) or contextlib.nullcontext())
    images = [InputImage(ref=n, path=str(inputs / n)) for n in ("a.png", "b.png")]
    rows = [PlannedRow(index=i, line=i + 1, prompt="a cat", seed=i, extra={}, reject=None,
                       settings={"image": images[i % 2]} if i < 4 else {}) for i in range(5)]
    together = generate_batch(pipe, s, rows)
    assert sorted(set(tokens)) == [(1, 16), (2, 32)]  # calls (per step): rows 0, 2 (a) / 1, 3 (b) / 4 (none)
    heads, dim = pipe.transformer.config.num_attention_heads, pipe.transformer.config.attention_head_dim
    assert shapes == [(2, heads, 32 + 32, dim)] * 2 + [(1, heads, 16 + 32, dim)]  # image tokens (+ the refs') + text
    tokens.clear()
    alone = [smp for r in rows for smp in generate_batch(pipe, s, [r])]
    assert all(x.status == "ok" and np.array_equal(x.pixels, y.pixels) for x, y in zip(together, alone))
    assert together[0].meta["input_image"]["path"] == "a.png" and "input_image" not in together[4].meta
    # 16 image tokens of a 64x64 sample, and 16 more of its 64x64 reference image
    assert set(tokens) == {(1, 32), (1, 16)}


def test_mid_sample_checkpoints_are_off_for_image_to_video(tmp_path):
    from shardgen.dataio.shards.video import VideoConfigError
    from shardgen.run.latent_ckpt import LatentCheckpoints

    with pytest.raises(VideoConfigError, match="starts each video from an input image"):
        run(compose_cfg(f"run_dir={tmp_path}", *VIDEO, "latent_checkpoint_every=2", "prompts.path=x.jsonl"))
    cfg = compose_cfg(f"run_dir={tmp_path}", *VIDEO, "prompts.path=x.jsonl")
    assert cfg.latent_checkpoint_every == "auto" and LatentCheckpoints.from_cfg(cfg, "dp") is None
    assert LatentCheckpoints.from_cfg(compose_cfg(f"run_dir={tmp_path}", "model=tiny_video"), "dp") is not None


@pytest.mark.slow
@pytest.mark.parametrize("model,names,strategy", [
    ("tiny_img2img", "[image,strength]", ("strategy=tp", "tp_degree=2")),
    ("tiny_kontext", "[image]", ("strategy=cp_ulysses", "ulysses_degree=2")),  # the image's tokens split too
    ("tiny_img2img", "[image,strength]", ("strategy=fsdp",)),  # the VAE encodes the image on every rank
])
def test_model_parallel_ranks_make_the_one_rank_bytes(tmp_path, model, names, strategy):
    from tests.conftest import ROOT

    args = (f"prompts.path={ROOT / 'examples' / 'images.jsonl'}", f"model={model}", "prompts=jsonl",
            f"prompts.row_settings={names}", "height=64", "width=64", "progress=false")
    run(compose_cfg(f"run_dir={tmp_path / 'one'}", *args))
    run(compose_cfg(f"run_dir={tmp_path / 'two'}", *args, *strategy, "launcher=local", "launcher.nprocs=2"))
    assert shard_images(tmp_path / "two") == shard_images(tmp_path / "one") and len(shard_images(tmp_path / "one")) == 3


def test_wan21_i2v_dummy_encodes_the_image_with_its_clip_tower_through_the_job_path():
    """Wan2.1-I2V-14B: the T2V 14B transformer with 36 input channels and the image's CLIP ViT-H/14 features (1280
    wide) in its cross-attention; a scaled-down build runs its image encoder on the row's image."""
    import torch

    from shardgen.models.dummy import build_dummy_pipeline, dummy_architecture

    arch = dummy_architecture("wan21_i2v_14b", pipeline="WanImageToVideoPipeline")
    tr, clip = arch["transformer"].config, arch["image_encoder"].config
    assert (tr["in_channels"], tr["image_dim"], tr["added_kv_proj_dim"]) == (36, clip["hidden_size"], 40 * 128)
    small = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=1, text_dim=32, freq_dim=32,
                 image_dim=32, added_kv_proj_dim=32)
    pipe = build_dummy_pipeline("wan21_i2v_14b", "cpu", torch.float32, pipeline="WanImageToVideoPipeline", overrides=dict(
        transformer=small, image_encoder=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                              num_attention_heads=2, projection_dim=32),
        text_encoder=dict(d_model=32, d_ff=37, d_kv=8, num_layers=1, num_heads=4, vocab_size=1000),
        vae=dict(base_dim=4, decoder_base_dim=2, dim_mult=[1, 1, 2, 2], num_res_blocks=1)))
    seen = []
    pipe.image_encoder.register_forward_hook(lambda m, a, out: seen.append(out.hidden_states[-2].shape))
    out = pipe(prompt="a cat", image=Image.new("RGB", (32, 32), (10, 200, 30)), height=32, width=32, num_frames=5,
               num_inference_steps=2, guidance_scale=5.0, max_sequence_length=16, output_type="pt")
    assert out.frames.shape == (1, 5, 3, 32, 32) and seen == [(1, 257, 32)]  # 16x16 patches of 224 + CLS


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_and_keeps_its_own_size_and_orientation_in_the_json(tmp_path):
    from shardgen.models.condition import InputImage, load

    small = np.random.default_rng(0).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    photo = Image.fromarray(small).resize((1600, 1200), Image.Resampling.BICUBIC)
    photo.save(tmp_path / "wide.jpg", quality=90)
    exif = photo.getexif()
    exif[0x0112] = 6  # shot with the camera turned: shown a quarter turn round, 1200x1600
    photo.save(tmp_path / "turned.jpg", quality=90, exif=exif)
    wide, turned = (load(InputImage(n, str(tmp_path / n)), 64, 48) for n in ("wide.jpg", "turned.jpg"))
    assert (wide.width, wide.height, turned.width, turned.height) == (1600, 1200, 1200, 1600)
    assert wide.image.size == turned.image.size == (64, 48)
    full = np.asarray(photo.resize((64, 48), Image.Resampling.LANCZOS), dtype=np.int16)
    assert np.abs(np.asarray(wide.image, dtype=np.int16) - full).mean() < 4  # the 1/8 scale's pixels: the same picture


def test_the_runs_strength_is_in_its_fingerprint(inputs, batch3):
    from shardgen.dataio.resume.fingerprint import FingerprintMismatch

    with pytest.raises(FingerprintMismatch, match="model.strength: run has 0.6, this launch has 0.5"):
        gen(batch3, inputs / "rows.jsonl", "batch_size=3", "samples_per_shard=4", "model.strength=0.5")


def test_the_next_batchs_images_are_decoded_on_a_thread_while_a_batch_is_generated(inputs, batch3, tmp_path,
                                                                                   monkeypatch):
    import threading

    from shardgen.models import condition

    where, load = [], condition.load
    monkeypatch.setattr(condition, "load", lambda *a: where.append(threading.current_thread().name) or load(*a))
    assert gen(tmp_path / "run", inputs / "rows.jsonl", "batch_size=1", "samples_per_shard=4").ok == 4
    assert sorted(where) == ["MainThread"] + ["shardgen-images_0"] * 3  # the first batch's, then each next one's
    assert shard_images(tmp_path / "run") == shard_images(batch3)


def test_csv_image_and_strength_columns_an_empty_cell_keeping_the_runs(inputs, tmp_path):
    (tmp_path / "p.csv").write_text(f"prompt,image,strength,note\na cat,{inputs / 'a.png'},0.9,x\na dog,"
                                    f"{inputs / 'b.png'},,y\n")
    res = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={tmp_path / 'p.csv'}", *FAST[:-1],
                          "prompts=csv", IMAGES))
    assert res.ok == 2
    meta = jsons(tmp_path / "run")
    assert [meta[k]["strength"] for k in sorted(meta)] == [0.9, 0.6] and meta["0000000001"]["note"] == "y"


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n%%EndComments\nnewpath 0 0 moveto 64 64 lineto stroke\n" \
      b"showpage\n%%EOF\n"


def test_a_postscript_image_named_png_runs_no_program_and_rejects_its_row(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "gs-ran"
    (fake / "gs").write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\n")
    (fake / "gs").chmod(0o755)
    (tmp_path / "vector.png").write_bytes(EPS)
    png(tmp_path / "good.png", seed=1)
    rows = write_rows(tmp_path / "p.jsonl", [dict(prompt="eps", image="vector.png"), dict(prompt="ok", image="good.png")])
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.run([sys.executable, "-m", "jobs.generate", f"run_dir={tmp_path / 'run'}", f"prompts.path={rows}",
                        *FAST, IMAGES], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert not marker.exists(), marker.read_text()
    assert "1 images, 0 failed, 1 rejected of 2 prompts" in p.stdout + p.stderr
    why = index_rows(tmp_path / "run")[0]["error"]
    assert f"image: {tmp_path}/vector.png is not a PNG, JPEG or WebP image" in why and "\n" not in why


def test_a_16_bit_grayscale_image_makes_the_sample_of_its_high_bytes(tmp_path):
    v = np.linspace(0, 65535, 80 * 96).astype(np.uint16).reshape(96, 80)
    Image.fromarray(v).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")  # saved as 16-bit grayscale
    Image.fromarray((v >> 8).astype(np.uint8)).save(tmp_path / "high.png")
    out = []
    for name in ("deep.png", "high.png"):  # one run each: the same prompt index, so the same seed
        assert gen(tmp_path / f"run-{name}", write_rows(tmp_path / f"{name}.jsonl", [dict(prompt="g", image=name)])).ok == 1
        out.append(shard_images(tmp_path / f"run-{name}")["0000000000"])
    assert out[0] == out[1]


@pytest.mark.parametrize("how", ["deleted", "a directory"])
def test_an_image_gone_after_planning_fails_its_row_for_retry_failed_and_the_rest_of_the_shard_completes(tmp_path,
                                                                                                          how):
    from shardgen.run.runner import prepare_run

    png(tmp_path / "a.png", seed=0)
    png(tmp_path / "b.png", seed=1)
    rows = write_rows(tmp_path / "p.jsonl", [dict(prompt="a", image="a.png"), dict(prompt="b", image="b.png")])
    args = (f"run_dir={tmp_path / 'run'}", f"prompts.path={rows}", *FAST, IMAGES, "samples_per_shard=2")
    prepare_run(compose_cfg(*args))  # planned while both images were there
    (tmp_path / "b.png").rename(tmp_path / "b.away")
    if how == "a directory":
        (tmp_path / "b.png").mkdir()
    res = run(compose_cfg(*args))
    assert (res.ok, res.failed, res.rejected) == (1, 1, 0)
    why = index_rows(tmp_path / "run")[1]
    assert why["status"] == "failed" and f"image: {tmp_path}/b.png " in why["error"] and "retry_failed" in why["error"]
    if how == "a directory":
        (tmp_path / "b.png").rmdir()
    (tmp_path / "b.away").rename(tmp_path / "b.png")
    res = run(compose_cfg(*args, "retry_failed=true"))
    assert (res.ok, res.failed, res.rejected) == (2, 0, 0)
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_an_image_path_with_a_nul_byte_is_a_bad_row(tmp_path):
    png(tmp_path / "a.png", seed=0)
    rows = write_rows(tmp_path / "p.jsonl", [dict(prompt="a", image="a.png"), dict(prompt="b", image="b\u0000.png")])
    res = gen(tmp_path / "run", rows, "prompts.on_bad_row=skip")
    assert (res.ok, res.rejected) == (1, 1)
    assert "holds a NUL byte, which no file name may" in index_rows(tmp_path / "run")[1]["error"]
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: image: .* holds a NUL byte"):
        gen(tmp_path / "run2", rows)


def test_a_run_strength_below_one_step_is_refused_before_anything_is_written(tmp_path):
    png(tmp_path / "a.png", seed=0)
    rows = write_rows(tmp_path / "p.jsonl", [dict(prompt="x", image="a.png")])
    with pytest.raises(ConfigError, match=r"^model.strength=1e-300 of steps=4 is less than one denoising step, so "
                                          r"every sample would fail: use model.strength=0.25 or more"):
        gen(tmp_path / "run", rows, "model.strength=1e-300")
    assert not (tmp_path / "run").exists()
