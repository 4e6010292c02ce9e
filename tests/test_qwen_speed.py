"""Qwen-Image speed hooks (shardgen/speed/qwen.py) on a scaled-down Qwen-Image on CPU: text-length buckets
and batched true CFG give the pixels of the plain pipeline; the real-valued RoPE matches diffusers' complex one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardgen.models.dummy import build_dummy_pipeline
from shardgen.speed import qwen
from tests.test_dummy_models import SMALL

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, digital art, a dog on the beach"]


@pytest.fixture(scope="module")
def pipe():
    # float64: per-sample results do not depend on the batch size or on extra masked zeros in a sum
    return build_dummy_pipeline("QwenImagePipeline", "cpu", torch.float64, overrides=SMALL["QwenImagePipeline"])


def _pixels(pipe, prompts, **kw) -> np.ndarray:
    out = pipe(prompt=prompts, num_inference_steps=2, height=64, width=64, output_type="np",
               generator=[torch.Generator().manual_seed(i) for i in range(len(prompts))], **kw)
    return (out.images * 255).round().astype(np.uint8)


def _calls(pipe) -> list[tuple[int, int]]:
    """(batch, text length) of every transformer computation (a pre-hook on its text input layer)."""
    shapes = []
    h = pipe.transformer.txt_norm.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape[:2])))
    return shapes, h


def test_bucket_length_and_padding():
    assert [qwen.bucket_length(n) for n in (1, 128, 129, 700, 5000)] == [128, 128, 256, 1024, 5000]
    emb, mask = qwen.pad_text(torch.ones(2, 3, 4), None, 5)
    assert emb.shape == (2, 5, 4) and emb[:, 3:].abs().sum() == 0
    assert mask.tolist() == [[1, 1, 1, 0, 0]] * 2


@pytest.mark.slow
def test_text_buckets_keep_pixels_and_fix_the_text_length(pipe):
    plain = [_pixels(pipe, [p]) for p in PROMPTS]
    shapes, h = _calls(pipe)
    qwen.install_text_buckets(pipe)
    try:
        padded = [_pixels(pipe, [p]) for p in PROMPTS]
    finally:
        qwen.remove_text_buckets(pipe)
        h.remove()
    assert {s[1] for s in shapes} == {128}  # two prompt lengths, one shape
    for a, b in zip(plain, padded):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_true_cfg_batched_in_one_call_same_pixels(pipe):
    kw = dict(true_cfg_scale=4.0, negative_prompt=[" "] * 2)
    plain = _pixels(pipe, PROMPTS, **kw)
    shapes, h = _calls(pipe)
    qwen.install_cfg_batching(pipe)
    try:
        batched = _pixels(pipe, PROMPTS, **kw)
        no_cfg = _pixels(pipe, PROMPTS, true_cfg_scale=1.0)  # no true CFG: plain calls
    finally:
        qwen.remove_cfg_batching(pipe)
        qwen.remove_text_buckets(pipe)
        h.remove()
    assert shapes[:2] == [(4, 128), (4, 128)]  # 2 steps, one call each, cond + uncond stacked
    assert shapes[2:] == [(2, 128), (2, 128)]
    np.testing.assert_array_equal(plain, batched)
    assert "forward" not in pipe.transformer.__dict__ and "encode_prompt" not in pipe.__dict__


@pytest.mark.slow
def test_real_rope_matches_diffusers_complex_rope(pipe):
    from diffusers.models.transformers import transformer_qwenimage as tq

    torch.manual_seed(0)
    rope = tq.QwenEmbedRope(theta=10000, axes_dim=[4, 6, 6], scale_rope=True)
    img_f, txt_f = rope([(1, 4, 6)], device=torch.device("cpu"), max_txt_seq_len=7)
    for freqs in (img_f, txt_f):
        x = torch.randn(2, freqs.shape[0], 3, 16, dtype=torch.bfloat16)
        want = tq.apply_rotary_emb_qwen(x, freqs, use_real=False)
        got = qwen.rope_real(x, torch.view_as_real(freqs))
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)

    # through the whole transformer: the hook + dispatcher give diffusers' eager output
    before = _pixels(pipe, PROMPTS[:1])
    assert qwen.enable_real_rope(pipe.transformer)
    try:
        after = _pixels(pipe, PROMPTS[:1])
    finally:
        qwen.disable_real_rope(pipe.transformer)
    np.testing.assert_array_equal(before, after)
