"""shardgen.models.dummy: real architectures with random weights, built on the device (scaled down here, on CPU)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from shardgen.families import dummy_models, family_of
from shardgen.models.dummy import construct_meta, build_dummy_pipeline, dummy_architecture

# Scaled-down copies of the embedded architectures: same classes and code paths, tiny widths/depths.
SMALL = {
    "FluxPipeline": {
        "transformer": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                            joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
        "vae": dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4),
        "text_encoder": dict(hidden_size=32, intermediate_size=37, projection_dim=32, num_hidden_layers=1,
                             num_attention_heads=2),
        "text_encoder_2": dict(d_model=32, d_ff=37, d_kv=8, num_layers=1, num_heads=4),
    },
    "Flux2Pipeline": {
        # The pipeline stacks text-encoder hidden states 10, 20, 30: 30 (narrow) layers, 3 x 16 = 48 wide context.
        "transformer": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                            joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)),
        "vae": dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4),
        "text_encoder": dict(
            text_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=30, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8),
            vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                               head_dim=8)),
    },
    "QwenImagePipeline": {
        "transformer": dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                            axes_dims_rope=(4, 6, 6)),
        "vae": dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
        "text_encoder": dict(
            text_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=37, num_heads=2, out_hidden_size=32,
                               fullatt_block_indexes=[0])),
    },
}


def _generate(pipe, name, steps=1):
    # Qwen-Image's scheduler (shift_terminal) needs 2 steps to avoid 0/0 in its sigma stretch.
    steps = max(steps, 2) if name == "QwenImagePipeline" else steps
    out = pipe(prompt="a photo of a cat", num_inference_steps=steps, height=64, width=64, output_type="np",
               generator=torch.Generator().manual_seed(0))
    return out.images


def test_flux_dev_scaled_down_builds_fast_and_generates():
    t0 = time.perf_counter()
    pipe = build_dummy_pipeline("FluxPipeline", "cpu", torch.float32, overrides=SMALL["FluxPipeline"])
    assert time.perf_counter() - t0 < 10
    # The real prompt lengths of FLUX.1-dev.
    assert pipe.tokenizer.model_max_length == 77 and pipe.tokenizer_2.model_max_length == 512
    assert pipe.vae.config.scaling_factor == 0.3611 and pipe.vae.config.shift_factor == 0.1159
    assert pipe.transformer.config.guidance_embeds and pipe.scheduler.config.use_dynamic_shifting
    assert set(pipe.dummy_build_seconds) >= {"transformer", "vae", "text_encoder", "text_encoder_2"}
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        assert not module.training
        assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())
    images = _generate(pipe, "FluxPipeline")
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()


@pytest.mark.parametrize("name", ["Flux2Pipeline", "QwenImagePipeline"])
def test_other_pipelines_scaled_down_generate(name):
    pipe = build_dummy_pipeline(name, "cpu", torch.float32, overrides=SMALL[name])
    images = _generate(pipe, name)
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()


def test_unknown_pipeline_names_the_supported_ones():
    with pytest.raises(ValueError) as e:
        build_dummy_pipeline("StableDiffusionXLPipeline", "cpu", torch.float32)
    for name in ("flux_dev", "flux2_dev", "qwen_image", "wan21_t2v_14b", "FLUX.1-dev", "Wan2.2-T2V-A14B"):
        assert name in str(e.value)
    with pytest.raises(ValueError, match="no dummy architecture for model 'WanPipeline'"):  # three Wan models: ambiguous
        dummy_architecture("WanPipeline")
    with pytest.raises(ValueError, match="unknown components"):
        dummy_architecture("FluxPipeline", {"unet": {"num_layers": 1}})


def test_embedded_configs_are_the_published_ones():
    flux = dummy_models()["flux_dev"][1].components
    assert family_of("FluxPipeline").dummy("any_custom_flux_yaml").components is flux  # one FLUX.1 dummy: any name
    assert flux["transformer"].config["num_layers"] == 19 and flux["transformer"].config["num_single_layers"] == 38
    assert flux["text_encoder_2"].config["d_model"] == 4096 and flux["text_encoder_2"].config["num_layers"] == 24
    # Parameter counts of the full-size modules, built on meta only (no memory).
    t = construct_meta(flux["transformer"])
    assert abs(sum(p.numel() for p in t.parameters()) / 1e9 - 11.90) < 0.01
    t5 = construct_meta(flux["text_encoder_2"])
    assert abs(sum(p.numel() for p in t5.parameters()) / 1e9 - 4.76) < 0.01  # shared embedding tied once


def test_bf16_build_keeps_buffers_and_ties():
    overrides = SMALL["QwenImagePipeline"]
    specs = dummy_architecture("QwenImagePipeline", overrides)
    pipe = build_dummy_pipeline("QwenImagePipeline", "cpu", torch.bfloat16, overrides=overrides)
    te = pipe.text_encoder
    assert all(p.dtype == torch.bfloat16 for p in te.parameters())
    # Buffers (rotary inv_freq tables) equal those of a normally constructed model, in their own dtype.
    import transformers

    ref = getattr(transformers, specs["text_encoder"].cls)(
        getattr(transformers, specs["text_encoder"].config_cls)(**specs["text_encoder"].config))
    ref_buffers = dict(ref.named_buffers())
    assert ref_buffers
    for name, b in te.named_buffers():
        assert b.dtype == ref_buffers[name].dtype and torch.equal(b, ref_buffers[name]), name
    # Norm scales are ones, biases zeros, matrices random.
    assert torch.all(pipe.transformer.transformer_blocks[0].attn.norm_q.weight == 1)
    assert torch.all(pipe.transformer.transformer_blocks[0].attn.to_q.bias == 0)
    w = pipe.transformer.transformer_blocks[0].attn.to_q.weight.float()
    assert 0.01 < w.std() < 0.03
    # Tied parameters stay tied (T5's shared embedding).
    flux = build_dummy_pipeline("FluxPipeline", "cpu", torch.bfloat16, overrides=SMALL["FluxPipeline"])
    assert flux.text_encoder_2.shared.weight is flux.text_encoder_2.encoder.embed_tokens.weight
    (position_ids,) = [b for n, b in flux.text_encoder.named_buffers() if n.endswith("position_ids")]
    assert position_ids.tolist() == [list(range(77))]


def test_parking_the_text_encoders_builds_the_same_weights():
    """``encoders_on_cpu`` (device_map's build of a pipeline larger than its GPU) builds the encoders first: each
    component's weights come from its own seed, so the pipeline is the one built in the usual order, value for value."""
    usual = build_dummy_pipeline("FluxPipeline", "cpu", torch.float32, overrides=SMALL["FluxPipeline"])
    parked = build_dummy_pipeline("FluxPipeline", "cpu", torch.float32, overrides=SMALL["FluxPipeline"],
                                  encoders_on_cpu=True)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        a, b = getattr(usual, name).state_dict(), getattr(parked, name).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    other = build_dummy_pipeline("FluxPipeline", "cpu", torch.float32, overrides=SMALL["FluxPipeline"], seed=1)
    assert not torch.equal(other.transformer.proj_out.weight, usual.transformer.proj_out.weight)
