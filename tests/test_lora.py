"""LoRA adapters (shardgen/models/lora.py): made at test time with peft on the tiny model, applied through
diffusers' own loaders, in the fingerprint and each sample's json, refused with one line when unusable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.generate import run
from shardgen.dataio.resume.fingerprint import FingerprintMismatch
from shardgen.dataio.tools.verify import read_shard_members
from shardgen.errors import UserError
from shardgen.models.tiny import save_tiny_lora
from tests.conftest import compose_cfg
from tests.test_generate import shard_images
from tests.test_parallel_parity import IMAGE_TOL, TRANSFORMER_TOL, _parity_rank

FAST = ("height=64", "width=64", "steps=2", "prompts.limit=3", "samples_per_shard=3", "batch_size=3", "progress=false")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("loras")
    wide = dict(attention_head_dim=32, axes_dims_rope=(8, 8, 16))  # another model's shapes
    return dict(a=save_tiny_lora(d / "a.safetensors", seed=1), b=save_tiny_lora(d / "b.safetensors", seed=2),
                wide=save_tiny_lora(d / "wide.safetensors", seed=3, **wide))


def loras_arg(*entries: tuple[Path, float]) -> str:
    return "model.loras=[" + ",".join(f"{{path: '{p}', scale: {s}}}" for p, s in entries) + "]"


def jsons(run_dir: Path) -> dict[str, dict]:
    return {k: json.loads(m["json"]) for tar in sorted((run_dir / "shards").glob("*.tar"))
            for k, m in read_shard_members(tar).items()}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("base") / "run"
    assert run(compose_cfg(f"run_dir={d}", *FAST)).ok == 3
    return shard_images(d)


def test_scale_zero_gives_the_bytes_of_no_lora(tmp_path, adapters, base_run):
    assert run(compose_cfg(f"run_dir={tmp_path}", *FAST, loras_arg((adapters["a"], 0.0)))).ok == 3
    assert shard_images(tmp_path) == base_run


def test_a_lora_changes_the_pixels_and_is_in_each_sample(tmp_path, adapters, base_run):
    from shardgen.models.lora import file_sha256

    assert run(compose_cfg(f"run_dir={tmp_path}", *FAST, loras_arg((adapters["a"], 0.8)))).ok == 3
    images = shard_images(tmp_path)
    assert sorted(images) == sorted(base_run) and all(images[k] != base_run[k] for k in images)
    for meta in jsons(tmp_path).values():
        assert meta["loras"] == [dict(path=str(adapters["a"]), scale=0.8, sha256=file_sha256(adapters["a"]))]


def test_resume_with_another_adapter_file_is_refused(tmp_path, adapters):
    lora = tmp_path / "style.safetensors"
    lora.write_bytes(adapters["a"].read_bytes())
    args = (f"run_dir={tmp_path / 'run'}", *FAST, loras_arg((lora, 1.0)))
    run(compose_cfg(*args))
    run(compose_cfg(*args))  # the same file: resumes
    lora.write_bytes(adapters["b"].read_bytes())
    with pytest.raises(FingerprintMismatch, match="model.loras"):
        run(compose_cfg(*args))
    with pytest.raises(FingerprintMismatch, match="model.loras"):  # another scale
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *FAST, loras_arg((adapters["a"], 0.5))))


@pytest.mark.parametrize("what, needle", [
    ("missing", "does not exist"), ("garbage", "not a readable safetensors file"),
    ("not a lora", "does not fit"), ("another model", "does not fit"), ("twice", "listed twice"),
])
def test_an_unusable_adapter_is_one_line_before_generation(tmp_path, adapters, what, needle):
    bad = tmp_path / "bad.safetensors"
    entries = [(bad, 1.0)]
    if what == "garbage":
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    elif what == "not a lora":
        from safetensors.torch import save_file
        import torch

        save_file({"transformer.proj_out.weight": torch.zeros(4, 4)}, str(bad))
    elif what == "another model":
        entries = [(adapters["wide"], 1.0)]
    elif what == "twice":
        entries = [(adapters["a"], 0.5), (adapters["a"], 0.5)]
    with pytest.raises(UserError, match=needle) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *FAST, loras_arg(*entries)))
    assert "\n" not in str(e.value), str(e.value)
    assert not list((tmp_path / "run").glob("shards/*.tar"))


@pytest.mark.slow
def test_tp2_and_ulysses2_run_the_adapted_model(tmp_path, adapters):
    """Under gloo, with two adapters: tp-2 (fused before sharding) and ulysses-2 give the one-process adapted
    transformer output and images (float64: a split sum differs by ~1e-15; an adapter missing on a rank, by ~1e-2)."""
    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    cfg = compose_cfg("height=128", "width=128", "steps=2", loras_arg((adapters["a"], 0.8), (adapters["b"], 0.5)))
    mp.start_processes(_parity_rank, args=(OmegaConf.to_yaml(cfg), free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("tp", "cp_ulysses"):
            assert res[name]["transformer"] <= TRANSFORMER_TOL and res[name]["images"] <= IMAGE_TOL, (name, res)
