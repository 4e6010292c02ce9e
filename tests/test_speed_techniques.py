"""Speed techniques as a registry: a technique registered in one module (here, this test's) is checked before any
weight is read, applied by ``prepare`` to the job's pipeline, and recorded in each sample's json when lossy."""

from __future__ import annotations

import json

import pytest

from shardgen.speed.techniques import AccelError, Step, Technique, register_technique, techniques, unregister_technique
from tests.conftest import compose_cfg
from tests.test_generate import shard_images

SMALL = ("height=32", "width=32", "steps=1", "prompts.limit=2", "samples_per_shard=2", "batch_size=2",
         "progress=false")
_HOOK = "_toy_dim_hook"


def _dim_output(module, args, output):
    """Halve the transformer's prediction (a visible, lossy change of every image)."""
    return (output[0] * 0.5, *output[1:]) if isinstance(output, tuple) else output * 0.5


def _apply(step: Step) -> dict:
    step.transformer.__dict__[_HOOK] = step.transformer.register_forward_hook(_dim_output)
    return {"toy_dimmed": True}


def _release(step: Step) -> dict:
    handle = step.transformer.__dict__.pop(_HOOK, None)
    if handle is not None:
        handle.remove()
    return {}


def _validate(opts, device=None) -> None:
    if opts.compile_mode == "max-autotune":
        raise AccelError("compile_mode=max-autotune: the toy technique cannot run with it")


@pytest.fixture
def toy_technique():
    register_technique(Technique("toy_dim", 60, _apply, release=_release, validate=_validate,
                                 lossy=lambda opts: {"toy_dim": 0.5}))
    yield
    unregister_technique("toy_dim")


def test_the_registry_lists_the_built_in_techniques_in_applying_order():
    assert [t.name for t in techniques()] == ["fp8", "compile", "first_block_cache", "sdpa", "family_hooks",
                                                     "fused_decode", "cuda_graphs"]


def test_a_technique_registered_in_one_module_changes_the_jobs_images_and_is_recorded(toy_technique, tmp_path):
    from jobs.generate import run
    from shardgen.tools import read_shard_members

    assert "toy_dim" in [t.name for t in techniques()]
    run(compose_cfg(f"run_dir={tmp_path / 'toy'}", *SMALL))
    unregister_technique("toy_dim")
    run(compose_cfg(f"run_dir={tmp_path / 'plain'}", *SMALL))
    toy, plain = shard_images(tmp_path / "toy"), shard_images(tmp_path / "plain")
    assert sorted(toy) == sorted(plain) and all(toy[k] != plain[k] for k in toy)
    metas = [json.loads(m["json"]) for m in read_shard_members(tmp_path / "toy" / "shards" / "000000.tar").values()]
    assert [m.get("lossy") for m in metas] == [{"toy_dim": 0.5}] * 2


def test_a_techniques_check_refuses_the_config_before_any_weight(toy_technique, tmp_path):
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match="^compile_mode=max-autotune: the toy technique cannot run with it$"):
        validate_config(compose_cfg(f"run_dir={tmp_path}", "compile_mode=max-autotune"))
