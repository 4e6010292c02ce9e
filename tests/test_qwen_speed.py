"""Qwen-Image speed hooks (shardgen/speed/qwen.py) on a scaled-down Qwen-Image on CPU: text-length buckets
and batched true CFG give the pixels of the plain pipeline; the real-valued RoPE matches diffusers' complex one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardgen.models.dummy import build_dummy_pipeline
from shardgen.families.qwen_image import speed as qwen
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
        _pixels(pipe, PROMPTS, true_cfg_scale=1.0)  # no true CFG: plain calls (their shapes are checked below)
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


# --- joint attention without the key-padding mask (shardgen/speed/prefix_attention.py) --------------------

def _masked_reference(q, k, v, valid, offset):
    keep = torch.arange(k.shape[1])[None, :] < (valid + offset)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :]).transpose(1, 2)


def test_prefix_attention_is_the_masked_attention():
    from shardgen.speed.prefix_attention import prefix_attention, prefix_lengths, runs

    assert runs([5, 5, 2, 5]) == [(0, 2, 5), (2, 3, 2), (3, 4, 5)] and runs([]) == []
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 11, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for valid in ([3, 7, 7, 0], [4, 4, 4, 4], [7, 7, 7, 7]):
        valid = torch.tensor(valid)
        got = prefix_attention(q, k, v, valid, 4)
        assert got.shape == q.shape and got.is_contiguous()
        torch.testing.assert_close(got, _masked_reference(q, k, v, valid, 4), rtol=1e-12, atol=1e-12)
    assert prefix_lengths(torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])).tolist() == [2, 3, 0]
    assert prefix_lengths(torch.tensor([[1, 0, 1]])) is None  # padding in the middle: the masked path runs


def test_prefix_attention_compiles_once_for_every_set_of_lengths():
    """The lengths are a host tensor the compiled graph passes through: new lengths, no new graph."""
    from torch._dynamo.testing import CompileCounter

    from shardgen.speed import prefix_attention  # noqa: F401 (registers the op)

    counter = CompileCounter()
    fn = torch.compile(lambda q, k, v, n: torch.ops.shardgen.prefix_attention(q * 2, k, v, n, 4) + 1,
                       backend=counter, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 11, 2, 8, generator=g) for _ in range(3))
    for valid in ([1, 2, 3], [7, 7, 7], [0, 5, 5]):
        valid = torch.tensor(valid)
        torch.testing.assert_close(fn(q, k, v, valid), _masked_reference(q * 2, k, v, valid, 4) + 1)
    assert counter.frame_count == 1


def _ran_prefix_attention(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "shardgen::prefix_attention")


@pytest.mark.slow
def test_attention_without_the_mask_keeps_qwen_pixels(pipe):
    """Prompts of different lengths padded to a bucket (a key-padding mask in every block), true CFG with a
    negative prompt, batched or not: the unmasked prefix attention gives the pixels of diffusers' masked one."""
    kw = dict(true_cfg_scale=4.0, negative_prompt=[" "] * 2)
    plain = _pixels(pipe, PROMPTS, **kw)
    stock = {id(b.attn.processor) for b in pipe.transformer.transformer_blocks}
    qwen.install_text_buckets(pipe)
    try:
        assert qwen.enable_prefix_attention(pipe.transformer) == len(pipe.transformer.transformer_blocks)
        assert qwen.enable_prefix_attention(pipe.transformer) == 0  # idempotent
        out = {}
        calls = _ran_prefix_attention(lambda: out.setdefault("padded", _pixels(pipe, PROMPTS, **kw)))
        assert calls == 2 * 2 * len(pipe.transformer.transformer_blocks)  # 2 steps x (cond, uncond) x blocks
        qwen.install_cfg_batching(pipe)
        calls = _ran_prefix_attention(lambda: out.setdefault("cfg_batched", _pixels(pipe, PROMPTS, **kw)))
        assert calls == 2 * len(pipe.transformer.transformer_blocks)
    finally:
        qwen.disable_prefix_attention(pipe.transformer)
        qwen.remove_cfg_batching(pipe)
        qwen.remove_text_buckets(pipe)
    np.testing.assert_array_equal(plain, out["padded"])
    np.testing.assert_array_equal(plain, out["cfg_batched"])
    assert {id(b.attn.processor) for b in pipe.transformer.transformer_blocks} == stock
    assert not pipe.transformer._forward_pre_hooks


def test_attention_lengths_from_the_mask_once_per_call():
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    first = qwen.text_lengths(m, 2, 3)
    assert first.tolist() == [2, 1] and qwen.text_lengths(m, 2, 3) is first  # cached for the same mask
    m[1, 1] = 1  # changed in place: read again
    assert qwen.text_lengths(m, 2, 3).tolist() == [2, 2]
    assert qwen.text_lengths(None, 3, 5).tolist() == [5, 5, 5]
    assert qwen.text_lengths(torch.tensor([[0, 1, 1]]), 1, 3) is None
    assert qwen.text_lengths(m, 3, 3) is None  # not this call's shape


def test_prefix_attention_processors_keep_their_class_across_enables(pipe):
    """Compiled blocks guard on their processor's type: enabling again (autocompile prepares the pipeline at each
    change of its settings) must bring the same class, or the blocks would compile again."""
    blocks = pipe.transformer.transformer_blocks
    try:
        qwen.enable_prefix_attention(pipe.transformer)
        first = {type(b.attn.processor) for b in blocks}
        qwen.disable_prefix_attention(pipe.transformer)
        qwen.enable_prefix_attention(pipe.transformer)
        assert {type(b.attn.processor) for b in blocks} == first and len(first) == 1
        assert len(pipe.transformer._forward_pre_hooks) == 1
    finally:
        qwen.disable_prefix_attention(pipe.transformer)
    assert not pipe.transformer._forward_pre_hooks


@pytest.mark.slow
def test_prefix_attention_made_eagerly_takes_the_compiled_path_real_rope(pipe):
    """compile=auto runs its first batches eagerly (prefix attention, complex RoPE) and then switches to compiled
    blocks, which take real RoPE pairs: the processors made before the switch rotate by the real pairs too, and the
    pixels stay diffusers' own."""
    plain = _pixels(pipe, PROMPTS)
    qwen._prefix_processor_class.cache_clear()  # made now, before real RoPE, as in an eager first batch
    qwen.install_text_buckets(pipe)
    try:
        qwen.enable_prefix_attention(pipe.transformer)
        eager = _pixels(pipe, PROMPTS)
        assert qwen.enable_real_rope(pipe.transformer)
        switched = _pixels(pipe, PROMPTS)
    finally:
        qwen.disable_real_rope(pipe.transformer)
        qwen.disable_prefix_attention(pipe.transformer)
        qwen.remove_text_buckets(pipe)
    np.testing.assert_array_equal(plain, eager)
    np.testing.assert_array_equal(plain, switched)
