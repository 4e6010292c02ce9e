"""shardgen.families: one ModelFamily per pipeline class, found by the most specific class; the rules the
strategies, device_map, accel and the dummy builder ask of it."""

from __future__ import annotations

import pytest

from shardgen.families import ModelFamily, family_for, family_of, register
from shardgen.families.base import unregister
from tests.conftest import compose_cfg


def test_lookup_by_name_object_and_most_specific_subclass():
    import diffusers

    class MyQwen(diffusers.QwenImagePipeline):
        pass

    class MyQwenWithOwnFamily(MyQwen):
        pass

    assert family_of("FluxPipeline").name == "FLUX.1" and family_of(diffusers.WanPipeline).name == "Wan"
    assert family_of(MyQwen).name == "Qwen-Image"  # a subclass gets its parent's family
    assert family_of("StableDiffusionXLPipeline") is None and family_of("NoSuchPipeline") is None
    assert family_for("NoSuchPipeline").text_tokens is None  # unknown: the text count is taken to vary
    diffusers.MyQwenWithOwnFamily = MyQwenWithOwnFamily  # registered families name diffusers classes
    try:
        register(ModelFamily(name="mine", pipeline="MyQwenWithOwnFamily", text_tokens=""))
        assert family_of(MyQwenWithOwnFamily).name == "mine" and family_of(MyQwen).name == "Qwen-Image"
        with pytest.raises(ValueError, match="already registered"):
            register(ModelFamily(name="again", pipeline="QwenImagePipeline", text_tokens=None))
    finally:
        unregister("MyQwenWithOwnFamily")
        del diffusers.MyQwenWithOwnFamily


@pytest.mark.parametrize("model, tokens, video", [
    ("tiny", (64, 32), False),             # 64x64 / 16 = 4x4 image tokens, max_sequence_length 32
    ("flux_dev", (4096, 512), False),
    ("qwen_image", (4096, None), False),   # text trimmed per batch
    ("tiny_video", (48, 0), True),         # 9 frames -> 3 latent frames of 4x4; Wan's text is not split
    ("wan21_t2v_14b", (75600, 0), True),   # 81 frames -> 21 x (720/16 x 1280/16)
])
def test_token_rules_and_video_come_from_the_family(model, tokens, video):
    from parallel.transformer import sequence_shape
    from shardgen.dataio.shards.video import is_video

    cfg = compose_cfg(f"model={model}")
    sequence = sequence_shape(cfg)
    assert (sequence.image, sequence.text) == tokens and is_video(cfg) is video


def test_only_the_qwen_families_have_speed_hooks_and_every_image_family_runs_device_map():
    from diffusers import QwenImageEditPipeline

    from shardgen.families import families, flux2
    from shardgen.families.qwen_image import speed as qwen, speed_hooks
    from shardgen.speed.accel import family_speed_hooks

    assert {f.name: f.speed_hooks for f in families() if f.speed_hooks} == {
        "Qwen-Image": speed_hooks, "Qwen-Image-Edit": speed_hooks}
    assert {f.name: f.encode_hooks for f in families() if f.encode_hooks} == {"FLUX.2": flux2.encode_hooks}
    assert family_speed_hooks(qwen_pipeline_class_instance()) is speed_hooks
    edit = QwenImageEditPipeline.__new__(QwenImageEditPipeline)
    assert qwen.is_qwen_image(edit) and family_speed_hooks(edit) is speed_hooks
    assert {"Flux2Pipeline", "FluxPipeline", "QwenImagePipeline"} <= {
        f.pipeline for f in families() if f.encode_outputs and not f.is_video}


def qwen_pipeline_class_instance():
    """A QwenImagePipeline object without components (the family is found by class)."""
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.__new__(QwenImagePipeline)
