"""Qwen-Image-Edit (shardgen/families/qwen_image_edit.py) on the embedded tiny model (model=tiny_qwen_edit): the job
makes diffusers' own single-image pixels, rows batch without changing a byte, a bad input image rejects only its row;
Qwen-Image's speed hooks keep the edit pipeline's pixels; the dummy's processor and tokenizer agree with its config.

The pipeline encodes every input image at about 1024x1024 whatever the sample's size (~1 s a sample on a CPU in
float64), so the tests that generate are marked slow."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from jobs.generate import run
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import verify_run
from tests.conftest import compose_cfg
from tests.test_condition import index_rows, jsons, pixels, png, write_rows
from tests.test_generate import shard_images

EDIT = ("model=tiny_qwen_edit", "progress=false", "prompts=jsonl", "prompts.row_settings=[image]")
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, digital art, a dog on the beach"]


def edit_run(run_dir, prompts, *extra: str):
    return run(compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *EDIT, *extra))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("edit-inputs")
    png(d / "a.png", seed=0, size=(96, 96))  # square like the samples: fitting only resizes it
    png(d / "b.png", seed=1, size=(96, 96))
    png(d / "wide.png", seed=2, size=(160, 90))  # cropped to the sample's aspect ratio first
    return d


@pytest.fixture(scope="module")
def pipe():
    """The tiny model as a job loads it (its processor through the family's own class), float64 on the CPU."""
    from shardgen.models.loader import load_pipeline

    return load_pipeline(compose_cfg(*EDIT).model, torch.float64, "cpu")


def _uint8(images: torch.Tensor) -> np.ndarray:
    """[0, 1] NCHW floats as the job's uint8 pixels (shardgen/run/generation.py: to_pixels)."""
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8).movedim(-3, -1).numpy()


def test_an_input_image_is_fitted_to_the_size_the_pipeline_resizes_it_to():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from shardgen.models.condition import area_size
    from shardgen.run.generation import GenSettings, input_size

    for w, h in ((64, 64), (1328, 800), (256, 432), (1024, 1536), (832, 1248)):
        size = area_size(w, h, 1024 * 1024)
        assert calculate_dimensions(1024 * 1024, size[0] / size[1])[:2] == size  # the pipeline finds it again
        assert abs(size[0] / size[1] - w / h) < 0.05 and abs(size[0] * size[1] / 1024**2 - 1) < 0.1
    s = GenSettings.from_cfg(compose_cfg("model=tiny_qwen_edit", "height=64", "width=128"))
    assert s.input_image == "required" and not s.image_per_call and input_size(s) == area_size(128, 64, 1024**2)
    assert input_size(GenSettings.from_cfg(compose_cfg("model=tiny_kontext", "height=64", "width=128"))) == (128, 64)


def test_dummy_tokenizer_and_processor_use_the_config_s_vision_token_ids():
    """The real Qwen2.5-VL ids (the text encoder finds the image's tokens by them) and the edit template's 64-token
    system prefix, which the pipeline drops: what is kept starts at the image."""
    from shardgen.models.dummy import build_dummy_pipeline, dummy_architecture

    arch = dummy_architecture("qwen_image_edit")
    assert arch["processor"].config["image_processor"]["max_pixels"] == 12845056
    assert arch["transformer"] == dummy_architecture("qwen_image")["transformer"]  # Qwen-Image's 20B MMDiT
    small = dict(transformer=dict(num_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                  axes_dims_rope=(2, 2, 4)),
                 vae=dict(base_dim=2, dim_mult=[1, 1, 1, 1], num_res_blocks=0),
                 text_encoder=dict(text_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                                    num_attention_heads=2, num_key_value_heads=1,
                                                    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                                   vision_config=dict(depth=1, hidden_size=32, intermediate_size=37, num_heads=2,
                                                      out_hidden_size=32, fullatt_block_indexes=[0])))
    pipe = build_dummy_pipeline("qwen_image_edit", "cpu", torch.float32, overrides=small)
    config, proc = pipe.text_encoder.config, pipe.processor
    assert (proc.image_token_id, config.image_token_id) == (151655, 151655)
    tok = proc.tokenizer
    assert tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"]) == [
        config.vision_start_token_id, config.vision_end_token_id]
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    ids = proc(text=[pipe.prompt_template_encode.format("a cat")], images=[image], return_tensors="pt")["input_ids"][0]
    kept = ids[pipe.prompt_template_encode_start_idx:].tolist()
    assert kept[0] == config.vision_start_token_id and kept.count(config.image_token_id) == 4  # 56x56: 2x2 merged


@pytest.mark.slow
def test_edit_rows_at_batch_3_make_the_bytes_of_a_one_row_run_and_of_diffusers_own_calls(inputs, pipe, tmp_path):
    """Three rows (two images, two seeds) in one call of three (the family's true CFG batched, text padded to a
    bucket), a row alone in a run, and diffusers' own call on each row's image alone: the same pixels."""
    from diffusers import QwenImageEditPipeline

    rows = [dict(prompt=PROMPTS[0], image="a.png", seed=1), dict(prompt=PROMPTS[1], image="b.png", seed=1),
            dict(prompt=PROMPTS[1], image="a.png", seed=2)]
    assert edit_run(tmp_path / "b3", write_rows(inputs / "three.jsonl", rows), "batch_size=3",
                    "cfg_batching=true").ok == 3
    batched = shard_images(tmp_path / "b3")
    assert edit_run(tmp_path / "one", write_rows(inputs / "one.jsonl", rows[2:])).ok == 1
    assert list(shard_images(tmp_path / "one").values()) == [batched["0000000002"]]
    assert len(set(batched.values())) == 3
    stock = QwenImageEditPipeline(**pipe.components)  # diffusers' own, one image a call, as its example
    for i, row in enumerate(rows):
        out = stock(image=Image.open(inputs / row["image"]), prompt=row["prompt"], negative_prompt=" ",
                    true_cfg_scale=4.0, num_inference_steps=2, height=64, width=64, output_type="pt",
                    generator=torch.Generator().manual_seed(row["seed"]))
        np.testing.assert_array_equal(_uint8(out.images)[0], pixels(batched[f"{i:010d}"]))
    meta = jsons(tmp_path / "b3")
    digest = hashlib.sha256((inputs / "b.png").read_bytes()).hexdigest()
    assert meta["0000000001"]["input_image"] == dict(sha256=digest, path="b.png", width=96, height=96)
    assert verify_run(load_plan(RunDir(tmp_path / "b3"))).ok


@pytest.mark.slow
def test_a_bad_input_image_rejects_only_its_row_and_the_rest_completes(inputs, tmp_path, monkeypatch):
    import contextlib

    from shardgen.speed import accel

    shapes = []  # the attention shape each call's SDPA kernel is chosen for
    monkeypatch.setattr(accel, "sdpa_context",
                        lambda pipe, opts, shape: shapes.append(shape) or contextlib.nullcontext())
    (inputs / "garbage.png").write_bytes(b"not an image at all " * 20)
    rows = [dict(prompt="a cat", image="a.png", seed=5), dict(prompt="lost", image="missing.png"),
            dict(prompt="garbage", image="garbage.png"), dict(prompt="no image"),
            dict(prompt="a cat", image="wide.png", seed=5)]
    res = edit_run(tmp_path / "run", write_rows(inputs / "bad.jsonl", rows), "batch_size=3", "prompts.on_bad_row=skip")
    assert (res.ok, res.rejected) == (2, 3)
    # two calls of one row: the 4x4 sample's tokens, the input's 64x64 (fitted to 1024x1024), the text's
    assert shapes == [(1, 2, 16 + 4096 + 512, 8)] * 2
    index = index_rows(tmp_path / "run")
    assert [index[i]["status"] for i in range(5)] == ["ok", "rejected", "rejected", "rejected", "ok"]
    assert f"rejected: image: {inputs}/missing.png does not exist" in index[1]["error"]
    assert f"rejected: image: {inputs}/garbage.png is not a PNG, JPEG or WebP image" in index[2]["error"]
    assert "this model makes each sample from an input image" in index[3]["error"]
    meta = jsons(tmp_path / "run")
    assert meta["0000000004"]["input_image"]["sha256"] == hashlib.sha256((inputs / "wide.png").read_bytes()).hexdigest()
    assert (meta["0000000004"]["input_image"]["width"], meta["0000000004"]["input_image"]["height"]) == (160, 90)
    made = shard_images(tmp_path / "run")
    assert pixels(made["0000000004"]).shape == (64, 64, 3)
    assert np.abs(pixels(made["0000000000"]) - pixels(made["0000000004"])).mean() > 1  # the same prompt and seed
    rep = verify_run(load_plan(RunDir(tmp_path / "run")))
    assert rep.ok, rep.defects


@pytest.mark.slow
def test_qwen_speed_hooks_keep_the_edit_pipelines_pixels(inputs, pipe):
    """Text buckets, true CFG in one call, the unmasked prefix attention and the fused blocks (the last two CUDA-only
    in a job, forced here) on the edit pipeline's longer image stream (the input image's latent tokens after the
    sample's) and longer text (its vision tokens): diffusers' pixels. Real-valued RoPE (with compile) too, within a
    level: its float32 rotation rounds apart from torch's complex product on the CPU (~3e-6)."""
    from shardgen.families.qwen_image import speed as qwen
    from shardgen.speed import accel

    images = [Image.open(inputs / n).convert("RGB").resize((1024, 1024)) for n in ("a.png", "b.png")]
    calls = []
    hooks = [pipe.transformer.img_in.register_forward_pre_hook(lambda m, a: calls.append(tuple(a[0].shape[:2]))),
             pipe.transformer.txt_norm.register_forward_pre_hook(lambda m, a: calls.append(tuple(a[0].shape[:2])))]

    def edit():
        out = pipe(image=images, prompt=PROMPTS, negative_prompt=[" "] * 2, true_cfg_scale=4.0, num_inference_steps=2,
                   height=64, width=64, output_type="pt", generator=[torch.Generator().manual_seed(i) for i in (0, 1)])
        return _uint8(out.images)

    try:
        plain = edit()
        assert calls[:2] == [(2, 16 + 4096), (2, 40)]  # 4x4 sample + 64x64 image tokens; 16 vision + 24 text
        calls.clear()
        qwen.install_cfg_batching(pipe)
        assert qwen.enable_prefix_attention(pipe.transformer) == len(pipe.transformer.transformer_blocks)
        assert accel.fuse_blocks_eager(pipe.transformer) == len(pipe.transformer.transformer_blocks)
        hooked = edit()
        assert qwen.enable_real_rope(pipe.transformer)
        real_rope = edit()
    finally:
        accel.uncompile_blocks(pipe.transformer)
        qwen.disable_prefix_attention(pipe.transformer)
        qwen.disable_real_rope(pipe.transformer)
        qwen.remove_cfg_batching(pipe)
        qwen.remove_text_buckets(pipe)
        for h in hooks:
            h.remove()
    assert calls == [(4, 16 + 4096), (4, 128)] * 4  # 2 steps, cond + uncond in one call, text padded to 128
    np.testing.assert_array_equal(plain, hooked)
    assert np.abs(plain.astype(int) - real_rope).max() <= 1


def test_a_long_prompt_is_not_flagged_truncated_the_edit_pipeline_keeps_every_token(pipe):
    """Qwen-Image-Edit's encode_prompt ignores max_sequence_length: its windows are the tokenizer's own, while
    planning and when samples are annotated, so a 40-token prompt at max_sequence_length=8 is not 'truncated'."""
    from shardgen.dataio.prompts.truncation import planning_windows, token_counts
    from shardgen.dataio.shards.annotate import text_windows

    long = " ".join(["word"] * 40)
    cfg = compose_cfg(*EDIT, "model.max_sequence_length=8")
    for windows in (text_windows(pipe, 8), planning_windows(cfg.model)):
        assert [w for _, _, w in windows] == [pipe.tokenizer.model_max_length]
        (counts, truncated), = token_counts(windows, [long])
        assert not truncated and max(counts.values()) > 8
