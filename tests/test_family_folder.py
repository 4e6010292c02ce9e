"""Adding a model family is one folder: a toy family written into a folder the registry searches is found, its tiny
model is built and loaded, its speed hook is handed down to the speed techniques, and a job runs end to end on it."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from jobs.generate import run
from tests.conftest import compose_cfg, write_lines
from tests.test_generate import FAST, shard_images

TOY_FAMILY = '''
"""A toy family: FLUX.1's tiny pipeline under a pipeline class of its own, with its own tiny model and speed hook."""

import dataclasses

import diffusers

from shardgen.families.base import TinyModel, register
from shardgen.families.flux import FLUX


class ToyFluxPipeline(diffusers.FluxPipeline):
    """FLUX.1 under another name."""


diffusers.ToyFluxPipeline = ToyFluxPipeline  # model.pipeline names a class of the diffusers namespace
HOOK_CALLS = []


def speed_hooks(pipe, opts):
    HOOK_CALLS.append(type(pipe).__name__)
    return {"toy_hook": "on"}


def tiny_transformer_config():
    from shardgen.families.flux.tiny import TRANSFORMER_CONFIG

    return TRANSFORMER_CONFIG


def build():
    from shardgen.families.flux.tiny import build_tiny_pipeline

    return ToyFluxPipeline(**build_tiny_pipeline(seed=7).components)


def tiny_path(cache_dir=None):
    from shardgen.models.tiny import cached_build

    return cached_build("tiny-toy-v1", build, cache_dir)


TOY = register(dataclasses.replace(
    FLUX, name="Toy FLUX", pipeline="ToyFluxPipeline", dummies={}, speed_hooks=speed_hooks,
    tiny_models=(TinyModel("tiny_toy", "tiny-toy-v1", "FluxTransformer2DModel", tiny_transformer_config, tiny_path),)))
'''


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The toy family's folder on the families package's search path, discovered; removed again afterwards."""
    import diffusers

    import shardgen.families as families
    from shardgen.families.base import unregister

    folder = tmp_path / "more_families" / "toyflux"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(textwrap.dedent(TOY_FAMILY))
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(folder.parent)])
    try:
        assert "toyflux" in families.discover()
        yield sys.modules["shardgen.families.toyflux"]
    finally:
        unregister("ToyFluxPipeline")
        sys.modules.pop("shardgen.families.toyflux", None)
        if hasattr(diffusers, "ToyFluxPipeline"):
            del diffusers.ToyFluxPipeline


def test_a_family_added_as_one_folder_runs_a_job(toy_family, tmp_path):
    from shardgen.families import family_of, tiny_model

    assert family_of("ToyFluxPipeline").name == "Toy FLUX" and tiny_model("tiny_toy").version == "tiny-toy-v1"
    prompts = write_lines(tmp_path / "p.txt", ["a toy fox", "a toy boat", "a toy moon"])
    run_dir = tmp_path / "run"
    cfg = compose_cfg("model.pipeline=ToyFluxPipeline", "model.source=tiny_toy", f"prompts.path={prompts}",
                      f"run_dir={run_dir}", *FAST)
    result = run(cfg)
    assert (result.total, result.ok, result.failed, result.complete) == (3, 3, 0, True)
    assert len(shard_images(run_dir)) == 3
    assert toy_family.HOOK_CALLS and set(toy_family.HOOK_CALLS) == {"ToyFluxPipeline"}  # handed down to speed/
    fingerprint = json.loads((run_dir / "fingerprint.json").read_text())
    assert "tiny-toy-v1" in json.dumps(fingerprint)  # its tiny model's version pins the run


def test_the_toy_family_is_gone_after_the_test():
    from shardgen.families import family_of, tiny_model

    assert family_of("ToyFluxPipeline") is None and tiny_model("tiny_toy") is None
