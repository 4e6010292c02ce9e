"""FLUX.2's text encoder run only as deep as the pipeline reads it (shardgen/families/flux2/speed.py), on the
scaled-down FLUX.2-dev dummy on the CPU."""

import torch

from shardgen.models.dummy import build_dummy_pipeline
from shardgen.speed import accel
from tests.test_dummy_models import SMALL


def _pipe(layers: int):
    small = {k: dict(v) for k, v in SMALL["Flux2Pipeline"].items()}
    small["text_encoder"] = dict(small["text_encoder"], text_config=dict(small["text_encoder"]["text_config"],
                                                                       num_hidden_layers=layers))
    return build_dummy_pipeline("Flux2Pipeline", "cpu", torch.float32, overrides=small)


def test_the_encoder_runs_to_the_deepest_layer_read_and_gives_the_same_embeddings():
    pipe = _pipe(34)  # 34 layers; the pipeline reads the hidden states after layers 10, 20 and 30
    prompts = ["a cat", "a lighthouse on a cliff at dusk, waves breaking below, seen from a fishing boat"]
    lm = pipe.text_encoder.model.language_model
    ran = []
    for i, layer in enumerate(lm.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: ran.append(i))
    heads = []
    pipe.text_encoder.lm_head.register_forward_hook(lambda m, a, out: heads.append(out.shape))
    deeper = dict(device="cpu", max_sequence_length=32, text_encoder_out_layers=(10, 20, 33))
    whole = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=32)[0]
    whole_deeper = pipe.encode_prompt(prompts, **deeper)[0]
    assert len(ran) == 2 * 34 and len(heads) == 2
    ran.clear(), heads.clear()

    done = accel.prepare(pipe, accel.AccelOptions(cuda_graphs=False))
    assert done["flux2_encoder_cut"] is True
    cut = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=32)[0]
    assert torch.equal(cut, whole) and cut.shape == (2, 32, 48)
    assert ran == list(range(30)) and heads == []  # layers 31-34 and the 131,072-wide head never ran
    # the encoder is whole again between encodings: anything else that runs it gets all of it
    assert len(lm.layers) == 34 and type(lm.norm).__name__ != "Identity"
    ran.clear()
    assert torch.equal(pipe.encode_prompt(prompts, **deeper)[0], whole_deeper)  # other layers asked: as deep as those
    assert ran == list(range(33)) and heads == []


def test_an_index_from_the_end_keeps_the_encoder_whole():
    from shardgen.families.flux2.speed import encoder_cut

    pipe = _pipe(12)
    with encoder_cut(pipe.text_encoder, (4, -1)) as enc:
        assert len(enc.model.language_model.layers) == 12
    with encoder_cut(pipe.text_encoder, (4, 8)) as enc:
        assert len(enc.model.language_model.layers) == 8
    assert len(pipe.text_encoder.model.language_model.layers) == 12


def test_device_map_streams_only_the_layers_the_pipeline_reads_and_makes_the_same_pixels(monkeypatch):
    """strategy=device_map with FLUX.2's encoder streamed layer by layer (no room to move it in whole): the staged
    pipeline encodes with the cut, so layers 31-34 are neither run nor streamed in, and the pixels are the plain
    pipeline's."""
    import parallel.device_map as device_map
    from shardgen.run.generation import GenSettings, pipeline_kwargs

    pipe = _pipe(34)
    s = GenSettings(height=64, width=64, steps=2, guidance=4.0, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=32, model="flux2_dev", strategy="device_map")
    theirs = pipe(**pipeline_kwargs(pipe, s, ["a cat", "a lighthouse at dusk"], [1, 2])).images
    ran = []
    for i, layer in enumerate(pipe.text_encoder.model.language_model.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: ran.append(i))
    monkeypatch.setattr(device_map, "room_to_encode", lambda device, reserve: 0)
    staged = device_map.StagedPipeline(pipe, torch.device("cpu"), offloaded=["text_encoder"])
    for _ in range(2):
        ours = staged(**pipeline_kwargs(staged, s, ["a cat", "a lighthouse at dusk"], [1, 2])).images
        assert torch.equal(ours, theirs)
    assert staged.streamed == ["text_encoder"] and ran == list(range(30)) * 2
