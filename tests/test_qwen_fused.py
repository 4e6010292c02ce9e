"""shardgen/speed/qwen_fused.py on a scaled-down Qwen-Image on CPU: the fused block forwards give diffusers' pixels,
and the fused q/k norm + RoPE computes what the prefix attention processor's stock lines compute.

The Triton kernels run only on CUDA (tests/test_gpu.py checks them against eager there); here every fused op takes
its torch path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardgen.models.dummy import build_dummy_pipeline
from shardgen.families.qwen_image import fused as qwen_fused, speed as qwen
from shardgen.speed import accel, fused_kernels
from shardgen.speed.blocks import fused_blocks
from tests.test_dummy_models import SMALL
from tests.test_qwen_speed import PROMPTS, _pixels


@pytest.fixture(scope="module")
def pipe():
    return build_dummy_pipeline("QwenImagePipeline", "cpu", torch.float64, overrides=SMALL["QwenImagePipeline"])


def test_fused_qwen_blocks_give_diffusers_pixels_and_come_off_again(pipe):
    kw = dict(true_cfg_scale=4.0, negative_prompt=[" "] * 2)
    plain = _pixels(pipe, PROMPTS, **kw)
    tr = pipe.transformer
    assert fused_blocks(tr) is qwen_fused and not qwen_fused.COMPILED
    try:
        assert accel.fuse_blocks_eager(tr) == len(tr.transformer_blocks)
        assert all("forward" in b.__dict__ for b in tr.transformer_blocks)
        fused = _pixels(pipe, PROMPTS, **kw)
    finally:
        accel.uncompile_blocks(tr)
    assert all("forward" not in b.__dict__ for b in tr.transformer_blocks)
    np.testing.assert_array_equal(plain, fused)


def _qk_inputs(attn, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, dim = attn.heads, attn.inner_dim // attn.heads
    img_q, img_k, txt_q, txt_k = (torch.randn(2, n, heads, dim, generator=g, dtype=torch.float64)
                                  for n in (16, 16, 5, 5))
    angles = [torch.rand(n, dim // 2, generator=g, dtype=torch.float64) * 6 for n in (16, 5)]
    freqs = tuple(torch.polar(torch.ones_like(a), a).to(torch.complex64) for a in angles)
    return img_q, img_k, txt_q, txt_k, freqs


def test_fused_qk_is_the_processors_norms_and_rope_in_prefix_attentions_order(pipe):
    attn = pipe.transformer.transformer_blocks[0].attn
    img_q, img_k, txt_q, txt_k, freqs = _qk_inputs(attn)
    query, key = qwen_fused.fused_qk(attn, img_q, img_k, txt_q, txt_k, freqs)
    # the stock lines: each norm, then diffusers' complex RoPE; queries [text, image], keys [image, text]
    ref_q = torch.cat([qwen.apply_rope(attn.norm_added_q(txt_q), freqs[1]), qwen.apply_rope(attn.norm_q(img_q), freqs[0])], 1)
    ref_k = torch.cat([qwen.apply_rope(attn.norm_k(img_k), freqs[0]), qwen.apply_rope(attn.norm_added_k(txt_k), freqs[1])], 1)
    assert query.shape == (2, attn.heads, 21, img_q.shape[-1])
    # SDPA's layout: (batch, tokens, heads, head_dim) memory when fused_kernels.SDPA_TOKENS_MAJOR, as diffusers has it
    assert (query.transpose(1, 2) if fused_kernels.SDPA_TOKENS_MAJOR else query).is_contiguous()
    # every block of a call gets the same frequency tensors: the joint tables are made once for all of them
    assert all(a is b for a, b in zip(qwen_fused._joint_tables(*freqs), qwen_fused._joint_tables(*freqs)))
    torch.testing.assert_close(query, ref_q.transpose(1, 2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(key, ref_k.transpose(1, 2), rtol=1e-6, atol=1e-6)
    # eager on CUDA only: the CPU keeps the stock lines (exact bytes); compiled blocks bring real frequencies
    assert not qwen_fused.fused_qk_applies(attn, freqs, img_q)


def test_prefix_attention_with_the_fused_qk_keeps_qwen_pixels(pipe, monkeypatch):
    """The processor's fused branch (forced on the CPU) through whole pipeline calls: diffusers' pixels (the
    norms' variance in float64 instead of float32 moves no pixel of this model)."""
    kw = dict(true_cfg_scale=4.0, negative_prompt=[" "] * 2)
    plain = _pixels(pipe, PROMPTS, **kw)
    calls = []

    def applies(attn, rotary, query):
        calls.append(1)
        return rotary is not None and rotary[0].is_complex()

    monkeypatch.setattr(qwen, "fused_qk_applies", applies)
    qwen.install_text_buckets(pipe)
    try:
        qwen.enable_prefix_attention(pipe.transformer)
        fused = _pixels(pipe, PROMPTS, **kw)
    finally:
        qwen.disable_prefix_attention(pipe.transformer)
        qwen.remove_text_buckets(pipe)
    assert len(calls) == 2 * 2 * len(pipe.transformer.transformer_blocks)
    assert np.abs(plain.astype(int) - fused.astype(int)).max() <= 1


def test_each_qwen_block_hands_the_next_its_first_norms_and_the_pixels_stay_the_same(monkeypatch):
    """In bf16 a Qwen-Image block's last gated residuals and the next block's first norms of them come from one pass
    per stream, and every block after the first takes those norms: the same output bytes as diffusers' blocks, as
    without the hand-over, and nothing left on the blocks after the call or after the blocks come off."""
    from shardgen.speed import block_chain
    from tests.test_flux_fused import _record

    overrides = {**SMALL["QwenImagePipeline"]}
    overrides["transformer"] = {**overrides["transformer"], "num_layers": 3}
    bf16 = build_dummy_pipeline("QwenImagePipeline", "cpu", torch.bfloat16, overrides=overrides)
    tr = bf16.transformer
    plain = _pixels(bf16, PROMPTS)
    taken, real_take = [], block_chain.take_over
    monkeypatch.setattr(block_chain, "take_over", lambda *a: _record(taken, real_take, *a))
    try:
        accel.fuse_blocks_eager(tr)
        fused = _pixels(bf16, PROMPTS)
        calls = taken.count(False)  # one per transformer call: its first block
        assert calls >= 1 and taken == ([False] + [True] * (len(tr.transformer_blocks) - 1)) * calls
        assert not any(block_chain._HANDOVER in b.__dict__ for b in tr.transformer_blocks)
        monkeypatch.setattr(qwen_fused, "_successor", lambda *a: None)
        alone = _pixels(bf16, PROMPTS)
    finally:
        accel.uncompile_blocks(tr)
    assert not any(block_chain._NEXT in b.__dict__ for b in tr.transformer_blocks)
    np.testing.assert_array_equal(plain, fused)
    np.testing.assert_array_equal(fused, alone)
