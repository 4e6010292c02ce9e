"""LoRA adapters (shardgen/models/lora.py): made at test time with peft on the tiny model, applied through
diffusers' own loaders, in the fingerprint and each sample's json, refused with one line when unusable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.generate import run
from shardgen.dataio.resume.fingerprint import FingerprintMismatch
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import read_shard_members, verify_run
from shardgen.errors import UserError
from shardgen.families.flux.tiny import save_tiny_lora
from shardgen.run.runner import prepare_run
from tests.conftest import compose_cfg, start_ranks
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
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok
    run(compose_cfg(*args, "allow_fingerprint_change=true"))  # asked for: jobs.verify names the samples it mixed
    defects = verify_run(load_plan(RunDir(tmp_path / "run"))).defects
    assert len(defects) == 3 and all("made with LoRA adapters" in d for d in defects), defects


@pytest.mark.parametrize("what, needle", [
    ("missing", "does not exist"), ("garbage", "not a readable safetensors file"),
    ("not a lora", "does not fit"), ("another model", "does not fit"), ("other names", "2 of its 2 tensors match no layer"),
    ("twice", "listed twice"), ("some unmatched", r"model.loras\[0\]: .*bad.safetensors: 6 of its 14 tensors match no "
                                 r"layer of FluxPipeline's transformer \(e.g. 'nonexistent_blocks.0.attn.to_k.lora_A."
                                 r"weight'\): a LoRA for another model\?"),
    ("url", r"model.loras\[0\]: s3://prompts/good.safetensors is a URL: LoRA files are read from local paths; copy it "
            "locally"),
])
def test_an_unusable_adapter_is_one_line_before_generation(tmp_path, adapters, what, needle):
    import torch
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    entries = [(bad, 1.0)]
    if what == "garbage":
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    elif what == "not a lora":
        save_file({"transformer.proj_out.weight": torch.zeros(4, 4)}, str(bad))
    elif what == "other names":  # a UNet's LoRA (SDXL-style keys)
        save_file({"unet.down.0.to_q.lora_A.weight": torch.zeros(4, 8), "unet.down.0.to_q.lora_B.weight":
                   torch.zeros(8, 4)}, str(bad))
    elif what == "another model":
        entries = [(adapters["wide"], 1.0)]
    elif what == "twice":
        entries = [(adapters["a"], 0.5), (adapters["a"], 0.5)]
    elif what == "some unmatched":  # its transformer_blocks load; its single_transformer_blocks name no layer
        _renamed(adapters["a"], bad)
    elif what == "url":
        entries = [("s3://prompts/good.safetensors", 0.8)]
    with pytest.raises(UserError, match=needle) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *FAST, loras_arg(*entries)))
    assert "\n" not in str(e.value), str(e.value)
    assert not list((tmp_path / "run").glob("shards/*.tar"))


def _renamed(src: Path, dst: Path) -> Path:
    """``src``'s LoRA with its single_transformer_blocks' tensors named for blocks the tiny model lacks."""
    from safetensors.torch import load_file, save_file

    save_file({k.replace("single_transformer_blocks", "nonexistent_blocks"): v for k, v in load_file(str(src)).items()},
              str(dst))
    return dst


@pytest.mark.slow
def test_tp2_and_ulysses2_run_the_adapted_model(tmp_path, adapters):
    """Under gloo, with two adapters: tp-2 (fused before sharding) and ulysses-2 give the one-process adapted
    transformer output and images (float64: a split sum differs by ~1e-15; an adapter missing on a rank, by ~1e-2)."""
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    cfg = compose_cfg("height=128", "width=128", "steps=2", loras_arg((adapters["a"], 0.8), (adapters["b"], 0.5)))
    start_ranks(_parity_rank, (OmegaConf.to_yaml(cfg), free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("tp", "cp_ulysses"):
            assert res[name]["transformer"] <= TRANSFORMER_TOL and res[name]["images"] <= IMAGE_TOL, (name, res)


# rows naming their own adapters (prompts.row_settings=[loras]): the run's set (none here), one adapter, two, none
# again; in an order that mixes the sets within each batch of 3
ROWS = [dict(prompt="a cat"), dict(prompt="a dog", loras=["a.safetensors"]),
        dict(prompt="a car", loras=[{"path": "b.safetensors", "scale": 0.5}, "a.safetensors"]),
        dict(prompt="a hat", loras=["a.safetensors"]), dict(prompt="a cup", loras=[]),
        dict(prompt="a pen", loras=[{"path": "b.safetensors", "scale": 0.5}, "a.safetensors"])]
ROW_ARGS = ("height=64", "width=64", "steps=2", "samples_per_shard=6", "progress=false", "prompts=jsonl")


def by_prompt(run_dir: Path) -> dict[str, bytes]:
    images, metas = shard_images(run_dir), jsons(run_dir)
    return {metas[k]["prompt"]: images[k] for k in images}


@pytest.fixture(scope="module")
def row_files(tmp_path_factory, adapters) -> Path:
    d = tmp_path_factory.mktemp("rows")
    for name in ("a", "b"):
        (d / f"{name}.safetensors").write_bytes(adapters[name].read_bytes())
    (d / "rows.jsonl").write_text("".join(json.dumps(dict(r, seed=10 + i)) + "\n" for i, r in enumerate(ROWS)))
    return d


@pytest.fixture(scope="module")
def one_set_runs(tmp_path_factory, row_files) -> dict[str, bytes]:
    """prompt -> image of runs made with one adapter set each (model.loras), over the rows naming that set."""
    d = tmp_path_factory.mktemp("sets")
    sets, out = {}, {}
    for i, r in enumerate(ROWS):
        sets.setdefault(json.dumps(r.get("loras", [])), []).append(dict(prompt=r["prompt"], seed=10 + i))
    for n, (key, rows) in enumerate(sets.items()):
        f = d / f"set{n}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        entries = [(row_files / (e if isinstance(e, str) else e["path"]), 1.0 if isinstance(e, str) else e["scale"])
                   for e in json.loads(key)]
        lora = (loras_arg(*entries),) if entries else ()
        assert run(compose_cfg(f"run_dir={d / f'set{n}'}", *ROW_ARGS, "batch_size=3", f"prompts.path={f}",
                               *lora)).ok == len(rows)
        out.update(by_prompt(d / f"set{n}"))
    return out


@pytest.mark.parametrize("batch_size", [1, 3])
def test_rows_adapters_give_the_bytes_of_one_adapter_runs(tmp_path, row_files, one_set_runs, batch_size):
    assert run(compose_cfg(f"run_dir={tmp_path}", *ROW_ARGS, f"batch_size={batch_size}",
                           f"prompts.path={row_files / 'rows.jsonl'}", "prompts.row_settings=[loras]")).ok == 6
    mixed = by_prompt(tmp_path)
    assert mixed == one_set_runs
    assert len(set(mixed.values())) == 6
    assert verify_run(load_plan(RunDir(tmp_path))).ok  # each sample's adapters are its row's


def test_a_rows_adapter_changed_under_the_run_is_refused(tmp_path, row_files, adapters):
    d = tmp_path / "p"
    d.mkdir()
    for name in ("a", "b"):
        (d / f"{name}.safetensors").write_bytes(adapters[name].read_bytes())
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    # a short lease: the launch refused while reading a shard's rows leaves its claim to expire, as any stopped job
    args = (f"run_dir={tmp_path / 'run'}", *ROW_ARGS, "lease_s=2", "heartbeat_s=0.5",
            f"prompts.path={d / 'rows.jsonl'}", "prompts.row_settings=[loras]")
    prepare_run(compose_cfg(*args))  # planned, then stopped before its first batch
    (d / "a.safetensors").write_bytes(adapters["wide"].read_bytes())
    with pytest.raises(UserError, match="a.safetensors: a row of this run names this LoRA, which changed"):
        run(compose_cfg(*args))
    moved = d.rename(tmp_path / "moved")  # the prompt file and its adapters moved: rows read theirs from there
    args = (*args[:-2], f"prompts.path={moved / 'rows.jsonl'}", args[-1])
    with pytest.raises(UserError, match=r"^\S*rows.jsonl:2: loras: .*moved/a.safetensors .* is not the file this row named"):
        run(compose_cfg(*args))
    (moved / "a.safetensors").write_bytes(adapters["a"].read_bytes())
    assert run(compose_cfg(*args)).complete


def test_a_rows_unusable_adapter_is_a_bad_row(tmp_path, row_files):
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(dict(prompt="a cat", loras=["a.safetensors"])) + "\n"
                 + json.dumps(dict(prompt="a dog", loras=["missing.safetensors"])) + "\n")
    (tmp_path / "a.safetensors").write_bytes((row_files / "a.safetensors").read_bytes())
    args = (*ROW_ARGS, f"prompts.path={f}", "prompts.row_settings=[loras]")
    with pytest.raises(UserError, match=r"rows.jsonl:2: loras: loras\[0\]: .*missing.safetensors does not exist"):
        run(compose_cfg(f"run_dir={tmp_path / 'a'}", *args))
    r = run(compose_cfg(f"run_dir={tmp_path / 'b'}", *args, "prompts.on_bad_row=skip"))
    assert (r.ok, r.rejected, r.complete) == (1, 1, True)
    with pytest.raises(UserError, match="strategy=tp cannot"):
        run(compose_cfg(f"run_dir={tmp_path / 'c'}", *args, "strategy=tp"))
    with pytest.raises(UserError, match="strategy=fsdp cannot"):
        run(compose_cfg(f"run_dir={tmp_path / 'c'}", *args, "strategy=fsdp"))
    with pytest.raises(UserError, match="fp8=true quantizes the weights once"):
        run(compose_cfg(f"run_dir={tmp_path / 'c'}", *args, "fp8=true"))


def test_the_memory_check_counts_the_whole_transformer_a_tp_rank_fuses():
    from parallel.dims import ParallelDims
    from parallel.memory import memory_problem

    flux = {"transformer": 11_901_408_320, "vae": 83_819_683, "text_encoder": 123_060_480,
            "text_encoder_2": 4_762_310_656}  # FLUX.1-dev's parameters (shardgen.models.loader.component_params)
    tp4 = ParallelDims(world_size=4, strategy="tp", tp=4)  # the transformer split 4 ways: 14.8 GiB per rank
    plain = compose_cfg("model=flux_dev", "model.weights=dummy")
    assert memory_problem(plain, tp4, flux, 2, 20 << 30, "GPU 0") is None
    adapted = compose_cfg("model=flux_dev", "model.weights=dummy", "model.loras=[{path: style.safetensors}]")
    msg = memory_problem(adapted, tp4, flux, 2, 20 << 30, "GPU 0")
    assert "needs ~31.4 GiB" in msg and "fuses the adapters into the whole transformer" in msg and "\n" not in msg


def test_switching_adapter_sets_compiles_nothing(adapters):
    """The per-row sets (AdapterSets, the run's adapters preloaded) under torch.compile: the first set compiles the
    block once; switching to other sets, to none and back reuses its graph (each adapted layer keeps one merged
    state, so dynamo's guards hold)."""
    import torch

    from shardgen.models import lora
    from shardgen.models.loader import load_pipeline

    cfg = compose_cfg("prompts.row_settings=[loras]", "prompts=jsonl", "prompts.path=x.jsonl")
    pipe = lora.apply(load_pipeline(cfg.model, torch.float64, "cpu"), cfg)
    a, b = (lora.resolve([dict(path=str(adapters[n]), scale=s)], "t") for n, s in (("a", 0.8), ("b", 0.5)))
    lora.preload(pipe, {lo.sha256: lo.path for lo in (*a, *b)})
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    pipe.transformer.single_transformer_blocks[0].compile(backend=count, dynamic=False)  # adapted: to_q, to_k, to_v
    made = []
    for loras in (a, b, (*b, *a), (), a):
        n = len(graphs)
        lora.activate(pipe, loras)
        pipe(prompt=["a cat"], height=32, width=32, num_inference_steps=1, max_sequence_length=32, output_type="pt",
             generator=torch.Generator().manual_seed(0))
        made.append(len(graphs) - n)
    assert made == [1, 0, 0, 0, 0], made


def test_a_rows_adapters_parse_the_same_from_any_folder(tmp_path, adapters):
    """Every spelling of a row's adapters; a parquet shard's digest counts them by content and scale, so a run moved
    with its prompt file and adapters reads the same rows."""
    from shardgen.dataio.prompts.planscan import row_bytes
    from shardgen.dataio.prompts.read import PromptRow
    from shardgen.dataio.prompts.rowsettings import RowRules
    from shardgen.models.lora import file_sha256

    a, b = file_sha256(adapters["a"]), file_sha256(adapters["b"])
    digests = []
    for folder in ("one", "two"):
        d = tmp_path / folder
        d.mkdir()
        for name in ("a", "b"):
            (d / f"{name}.safetensors").write_bytes(adapters[name].read_bytes())
        rules = RowRules(names=("loras",), base_dir=str(d))
        spellings = [rules.parse({"loras": v}) for v in (["b.safetensors:0.5", "a.safetensors"],
                                                          [{"path": "b.safetensors", "scale": 0.5}, str(d / "a.safetensors")])]
        spellings.append(rules.parse({"loras": "b.safetensors:0.5;a.safetensors"}, text=True))
        assert all([(lo.sha256, lo.scale) for lo in s["loras"]] == [(b, 0.5), (a, 1.0)] for s in spellings)
        assert rules.parse({"loras": []}) == {"loras": ()}
        digests.append(row_bytes(PromptRow(0, 1, "a cat", None, {}, None, spellings[0])))
    assert digests[0] == digests[1]


def test_a_rows_adapter_matching_no_layer_stops_the_run_before_generation(tmp_path, row_files):
    """Per-row adapters load through the same check (preloaded before the first batch): the run stops in one line."""
    _renamed(row_files / "a.safetensors", tmp_path / "odd.safetensors")
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(dict(prompt="a cat")) + "\n" + json.dumps(dict(prompt="a dog", loras=["odd.safetensors"]))
                 + "\n")
    with pytest.raises(UserError, match=r"odd.safetensors: 6 of its 14 tensors match no layer of FluxPipeline's "
                                        r"transformer \(e.g. 'nonexistent_blocks") as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *ROW_ARGS, f"prompts.path={f}", "prompts.row_settings=[loras]"))
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "run").glob("shards/*.tar"))


@pytest.mark.parametrize("value, says", [
    ("a.safetensors:abc", r"loras: loras\[0\]: 'a.safetensors:abc': scale 'abc' is not a number; write PATH:SCALE, "
                          r"e.g. a.safetensors:0.8"),
    ("b.safetensors:0.5;a.safetensors:1,5", r"loras\[1\]: 'a.safetensors:1,5': scale '1,5' is not a number"),
    ("a.safetensors:1e300", r"loras\[0\]: scale 1e\+300 is outside -100..100; adapters are used at scales around 1"),
    ("a.safetensors:-101", r"loras\[0\]: scale -101.0 is outside -100..100"),
    ("s3://bucket/a.safetensors:0.8", r"loras\[0\]: s3://bucket/a.safetensors is a URL: LoRA files are read from "
                                      "local paths"),
    ("s3://bucket/a.safetensors", r"loras\[0\]: s3://bucket/a.safetensors is a URL"),
    ("dir:a.safetensors", r"loras\[0\]: .*/dir:a.safetensors does not exist"),  # a colon of the path
])
def test_a_rows_text_adapter_with_a_bad_scale_or_a_url_says_so(tmp_path, adapters, value, says):
    from shardgen.dataio.prompts.rowsettings import BadSetting, RowRules

    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors").write_bytes(adapters[name].read_bytes())
    rules = RowRules(names=("loras",), base_dir=str(tmp_path))
    with pytest.raises(BadSetting, match=says):
        rules.parse({"loras": value}, text=True)


def test_a_path_with_a_colon_of_its_own_still_reads(tmp_path, adapters):
    from shardgen.dataio.prompts.rowsettings import RowRules
    from shardgen.models.lora import file_sha256

    (tmp_path / "v:abc").write_bytes(adapters["a"].read_bytes())  # an existing file: not a scale
    rules = RowRules(names=("loras",), base_dir=str(tmp_path))
    for value, scale in (("v:abc", 1.0), ("v:abc:0.5", 0.5)):
        (lo,) = rules.parse({"loras": value}, text=True)["loras"]
        assert (lo.sha256, lo.scale) == (file_sha256(adapters["a"]), scale)


def test_the_list_and_text_forms_of_model_loras_make_the_bytes_of_the_mapping_form(tmp_path, adapters):
    """'model.loras=[PATH]' is the adapter at scale 1 and '"PATH:0.8"' at 0.8, as per-row adapters are written."""
    a = adapters["a"]
    for name, form, mapping in (("plain", f"model.loras=['{a}']", loras_arg((a, 1.0))),
                                ("text", f"model.loras=['{a}:0.8']", loras_arg((a, 0.8)))):
        assert run(compose_cfg(f"run_dir={tmp_path / name}", *FAST, form)).ok == 3
        assert run(compose_cfg(f"run_dir={tmp_path / (name + '-map')}", *FAST, mapping)).ok == 3
        assert shard_images(tmp_path / name) == shard_images(tmp_path / (name + "-map"))
    assert {m["loras"][0]["scale"] for m in jsons(tmp_path / "text").values()} == {0.8}


@pytest.mark.parametrize("override, says", [
    ("model.loras=style.safetensors", "model.loras takes a list: write 'model.loras=[style.safetensors]'"),
    ("model.loras=[{path: style.safetensors, scal: 0.8}]", "model.loras[0] has no field 'scal' (did you mean scale?)"),
    ("model.loras=['style.safetensors:abc']", "model.loras[0]: 'style.safetensors:abc': scale 'abc' is not a number"),
])
def test_a_mistyped_model_loras_is_one_line(tmp_path, monkeypatch, override, says):
    from shardgen.config.overrides import check_overrides
    from shardgen.models.lora import LoraError

    monkeypatch.chdir(tmp_path)
    save_tiny_lora(tmp_path / "style.safetensors")
    problem = check_overrides([override])
    if problem is None:
        with pytest.raises(LoraError) as e:
            run(compose_cfg(override, f"run_dir={tmp_path / 'r'}", "dry_run=true"))
        problem = str(e.value)
    assert says in problem and "\n" not in problem


def test_a_launch_with_other_adapters_cannot_start_over_a_run_another_launch_generates(tmp_path, adapters,
                                                                                       monkeypatch):
    """Two launches at once on a new run_dir: the second reads the first's fingerprint while the first is about to
    generate (no sample yet). It is refused, and every sample is the first launch's."""
    from shardgen.dataio.resume.fingerprint import check_or_write_fingerprint, read_fingerprint
    from shardgen.models import lora
    import shardgen.run.runner as runner

    d = tmp_path / "run"
    other = lora.fingerprint_fields(lora.run_set(compose_cfg(loras_arg((adapters["b"], 1.0)))))
    real, seen = runner._make_worker, []

    def another_launch_arrives(*a, **kw):  # the first launch has loaded its model and is about to generate
        try:
            check_or_write_fingerprint(RunDir(d), read_fingerprint(RunDir(d)) | other)
            seen.append("took the run over")
        except FingerprintMismatch as e:
            seen.append(str(e).splitlines()[0])
        return real(*a, **kw)

    monkeypatch.setattr(runner, "_make_worker", another_launch_arrives)
    assert run(compose_cfg(f"run_dir={d}", *FAST, loras_arg((adapters["a"], 1.0)))).ok == 3
    assert seen == [f"{d}/fingerprint.json says {d} was made with other settings; resuming would mix different "
                    "samples:"]
    assert verify_run(load_plan(RunDir(d))).ok
    assert not list((d / "work").glob("launch.*"))  # the launch's mark is gone with it


def test_a_rows_adapter_rewritten_mid_run_stops_the_run_naming_it_and_no_sample_mixes_two_versions(
        tmp_path, adapters, monkeypatch):
    from shardgen.dataio.prompts.plan import Plan

    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors").write_bytes(adapters[name].read_bytes())
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=f"p{i}", loras=["a.safetensors" if i < 2 else "b.safetensors"]))
                            + "\n" for i in range(4)))
    args = (f"run_dir={tmp_path / 'run'}", *ROW_ARGS, "samples_per_shard=2", "lease_s=2", "heartbeat_s=0.5",
            f"prompts.path={rows}", "prompts.row_settings=[loras]")
    real = Plan.rows

    def rewritten_before_shard_1(self, shard):
        if shard == 1:
            (tmp_path / "b.safetensors").write_bytes(adapters["wide"].read_bytes())
        return real(self, shard)

    monkeypatch.setattr(Plan, "rows", rewritten_before_shard_1)
    with pytest.raises(UserError) as e:
        run(compose_cfg(*args))
    assert str(e.value).startswith(f"{rows}:3: loras: {tmp_path / 'b.safetensors'} (sha256 ")
    assert "is not the file this row named when the run was planned; restore it, or start a new run_dir" in str(e.value)
    assert "damaged" not in str(e.value) and "plan.json" not in str(e.value)
    monkeypatch.setattr(Plan, "rows", real)
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).defects == []  # shard 0 committed, with a alone
    (tmp_path / "b.safetensors").write_bytes(adapters["b"].read_bytes())  # restored, as the message says
    import time
    time.sleep(2.5)  # the stopped launch's claim expires
    assert run(compose_cfg(*args)).complete
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_a_rows_adapter_gone_after_planning_leaves_its_rows_to_make_not_rejected(tmp_path, adapters):
    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors").write_bytes(adapters[name].read_bytes())
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=f"p{i}", loras=["a.safetensors" if i < 2 else "b.safetensors"]))
                            + "\n" for i in range(4)) + json.dumps(dict(prompt="p4", loras=["never.safetensors"])) + "\n")
    args = (f"run_dir={tmp_path / 'run'}", *ROW_ARGS, "samples_per_shard=2", "lease_s=2", "heartbeat_s=0.5",
            f"prompts.path={rows}", "prompts.row_settings=[loras]", "prompts.on_bad_row=skip")
    prepare_run(compose_cfg(*args))  # planned with every file there but never.safetensors (its row: a reject)
    (tmp_path / "b.safetensors").rename(tmp_path / "b.away")
    with pytest.raises(UserError) as e:
        run(compose_cfg(*args))
    assert str(e.value).startswith(f"{rows}:3: loras: loras[0]: {tmp_path / 'b.safetensors'} does not exist")
    assert str(e.value).endswith("(it was usable when the run was planned); put it back and re-run: its rows are "
                                 "still to be made")
    (tmp_path / "b.away").rename(tmp_path / "b.safetensors")
    import time
    time.sleep(2.5)  # the stopped launch's claim expires
    res = run(compose_cfg(*args))
    assert (res.ok, res.rejected, res.complete) == (4, 1, True)
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_an_adapter_path_with_a_nul_byte_or_a_name_too_long_is_a_bad_row_and_one_line(tmp_path, adapters):
    from shardgen.dataio.prompts.read import PromptFileError

    (tmp_path / "a.safetensors").write_bytes(adapters["a"].read_bytes())
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=f"p{i}", loras=[path])) + "\n" for i, path in
                            enumerate(["a.safetensors", "a\u0000.safetensors", "x" * 300 + ".safetensors"])))
    args = (*ROW_ARGS, f"prompts.path={rows}", "prompts.row_settings=[loras]")
    res = run(compose_cfg(f"run_dir={tmp_path / 'skip'}", *args, "prompts.on_bad_row=skip"))
    assert (res.ok, res.rejected) == (1, 2)
    with pytest.raises(PromptFileError, match=r"rows.jsonl:2: loras: loras\[0\]: .* holds a NUL byte"):
        run(compose_cfg(f"run_dir={tmp_path / 'error'}", *args))
    rows.write_text(rows.read_text().splitlines()[2] + "\n")
    with pytest.raises(PromptFileError, match=r"rows.jsonl:1: loras: loras\[0\]: .*x{100}.* cannot be read \(File name "
                                              r"too long\)"):
        run(compose_cfg(f"run_dir={tmp_path / 'long'}", *args))
    with pytest.raises(UserError, match=r"model.loras\[0\]: .* cannot be read \(File name too long\)"):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *FAST, loras_arg((tmp_path / ("y" * 300), 1.0))))


def _matmuls_of_switches(pipe, sets) -> list[int]:
    """The matrix products each ``lora.activate`` of ``sets`` computes (a LoRA's B @ A is one per adapted layer)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardgen.models import lora

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default, torch.ops.aten.bmm.default):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    out = []
    for s in sets:
        Count.n = 0
        with Count():
            lora.activate(pipe, s)
        out.append(Count.n)
    return out


def test_switching_between_rows_adapters_costs_the_adapters_that_change_not_all_loaded(tmp_path):
    """With 2 or 24 adapters loaded, switching from one row's adapter to another's computes the same work: that of
    the two adapters (undoing one, adding the other), not a fuse of every adapter loaded."""
    import torch

    from shardgen.models import lora
    from shardgen.models.loader import load_pipeline
    from shardgen.families.flux.tiny import save_tiny_lora

    cfg = compose_cfg("prompts.row_settings=[loras]", "prompts=jsonl", "prompts.path=x.jsonl")
    sets = [lora.resolve([dict(path=str(save_tiny_lora(tmp_path / f"l{i}.safetensors", seed=50 + i, rank=2)),
                               scale=1.0)], "t") for i in range(24)]
    work = {}
    for loaded in (2, 24):
        pipe = lora.apply(load_pipeline(cfg.model, torch.float32, "cpu"), cfg)
        lora.preload(pipe, {s[0].sha256: s[0].path for s in sets[:loaded]})
        work[loaded] = _matmuls_of_switches(pipe, [sets[0], sets[1], sets[0]])
    assert work[24] == work[2] and 0 < work[2][0] <= 64, work
