"""On a CUDA GPU: every path a default run can take, for every model in conf/model/ that fits one GPU.

    python -m pytest -m gpu tests/test_gpu_matrix.py          # all models (~10 min on an H200)
    python -m pytest -m gpu tests/test_gpu_matrix.py -k qwen  # one

Each model runs the whole job (dummy bf16 weights, small sizes, 2 steps, prompts of 1 to 160 words, the model's own
CFG settings) these ways, one after the other on one compile cache:

- ``eager``: ``compile=false`` (the reference; its calls replay CUDA graphs where the family declares them);
- ``ungraphed``: ``compile=false cuda_graphs=false``: the same bytes as ``eager``;
- ``floor``: ``compile=false`` with another exact attention kernel: how far bf16 rounding alone moves the pixels;
- ``compiled``: ``compile=true`` (fills the compile cache);
- ``auto-eager``, ``auto-main``: ``compile: auto`` forced (``SHARDGEN_COMPILE_AUTO``) to stay eager, or to switch to
  compiled blocks on the main thread, after its eager batches;
- ``resume``: ``compile: auto`` unforced on a run of ``auto-main`` that lost two shards, with compile records that
  make it decide before its first batch (a requeued job on a filled cache).

Every sample must be made, ``jobs.verify`` clean, and each image within the bf16 noise floor of ``eager``
(PSNR no more than 3 dB below ``floor``'s), ``compiled`` the graphs the model's block classes need and no
compiling way more. The graphs each way compiled are printed, and written as JSON to
``$SHARDGEN_MATRIX_OUT`` when set.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil

import pytest
import torch

from jobs.generate import run
from shardgen.bench.main import bench_prompts
from shardgen.bench.measure import psnr, shard_images
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.families import family_of
from shardgen.tools.verify import verify_run
from shardgen.speed import autocompile as AC
from tests.conftest import compose_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = 12  # batches of 2: two eager, four after any switch
IMAGE = ("model.weights=dummy", "height=256", "width=256")
MODELS = {  # conf/model/<name>.yaml -> its overrides here
    "flux_dev": IMAGE,
    "flux2_dev": IMAGE,
    "qwen_image": IMAGE,
    "sd35_large": IMAGE,
    "wan21_t2v_1_3b": (*IMAGE, "num_frames=9"),
}
COMPILED_GRAPHS = {  # compile=true's graphs: one per block class (SD3.5's last block, context_pre_only, has its own);
    "flux_dev": 2,     # a block that recompiles for its input's strides is a whole extra compilation on a fresh cache
    "flux2_dev": 2,
    "qwen_image": 1,
    "sd35_large": 2,
    "wan21_t2v_1_3b": 1,
}
WAYS = {
    "eager": (None, ("compile=false", "sdpa_backend=cudnn")),
    "ungraphed": (None, ("compile=false", "sdpa_backend=cudnn", "cuda_graphs=false")),
    "floor": (None, ("compile=false", "sdpa_backend=flash")),
    "compiled": (None, ("compile=true", "sdpa_backend=cudnn")),
    "auto-eager": ("eager", ("sdpa_backend=cudnn",)),
    "auto-main": ("main", ("sdpa_backend=cudnn",)),
}


def _free_gpu() -> None:
    torch._dynamo.reset()  # each way starts as a fresh process would: no compiled code in memory, the disk cache kept
    gc.collect()
    torch.cuda.empty_cache()


def _run_way(tmp_path, model, force, extra, monkeypatch, caplog, run_dir=None):
    from shardgen.speed.autocompile import compiled_graphs

    if force:
        monkeypatch.setenv(AC.FORCE_ENV, force)
    else:
        monkeypatch.delenv(AC.FORCE_ENV, raising=False)
    before = compiled_graphs()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardgen"):
        r = run(compose_cfg(f"run_dir={run_dir}", f"model={model}", *MODELS[model], "steps=2",
                            "batch_size=2", "samples_per_shard=2", "progress=false", "prompts=txt",
                            f"prompts.path={tmp_path / 'prompts.txt'}", *extra))
    summary = next((m for m in (rec.getMessage() for rec in reversed(caplog.records))
                    if re.match(r"compile=\w+ (eager|compiled)", m)), "")
    errors = [rec.getMessage()[:300] for rec in caplog.records if rec.levelno >= logging.ERROR]
    cuda_graphs = sum("cuda_graphs: captured" in rec.getMessage() for rec in caplog.records)
    _free_gpu()
    return r, {"graphs": compiled_graphs() - before, "cuda_graphs": cuda_graphs, "summary": summary,
               "errors": errors[:3]}


def _doctor_records_to_compile_before_the_first_batch() -> None:
    """Records saying: compiling pays at once (a long job's figures), as a requeued job finds them."""
    path = AC.records_path()
    records = AC.read_records(path)
    for rec in records.values():
        if isinstance(rec, dict) and AC._number(rec.get("eager_s")):
            rec.update(eager_s=100.0, compiled_s=50.0, compile_warm_s=0.001, compiled_before=True)
    path.write_text(json.dumps(records))


@pytest.mark.parametrize("model", list(MODELS))
def test_every_default_path_makes_every_sample_within_the_noise_floor(tmp_path, model, monkeypatch, caplog):
    monkeypatch.setenv("SHARDGEN_CACHE", str(tmp_path / "cache"))  # a fresh compile cache and compile records
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in bench_prompts(PROMPTS)), encoding="utf-8")
    _free_gpu()
    figures, images = {}, {}
    for way, (force, extra) in WAYS.items():
        r, figures[way] = _run_way(tmp_path, model, force, extra, monkeypatch, caplog, run_dir=tmp_path / way)
        assert (r.ok, r.failed, r.complete) == (PROMPTS, 0, True), (way, figures[way])
        images[way] = shard_images(tmp_path / way)
    # resume: two shards of auto-main lost, the records of a long job, compile=auto left to decide
    resumed = tmp_path / "resume"
    shutil.copytree(tmp_path / "auto-main", resumed)
    for shard in sorted((resumed / "shards").glob("00000[12].*")):
        shard.unlink()
    _doctor_records_to_compile_before_the_first_batch()
    r, figures["resume"] = _run_way(tmp_path, model, None, ("sdpa_backend=cudnn",), monkeypatch, caplog, run_dir=resumed)
    assert (r.ok, r.generated_here, r.failed, r.complete) == (PROMPTS, 4, 0, True), figures["resume"]
    images["resume"] = shard_images(resumed)
    for way in ("auto-main", "compiled", "resume"):
        assert figures[way]["graphs"] > 0 or "compiled" in figures[way]["summary"], (way, figures[way])
        # a way that compiles more graphs than compile=true compiled one for shapes or strides it never runs
        assert figures[way]["graphs"] <= COMPILED_GRAPHS[model], (way, figures[way])
    assert "eager" in figures["auto-eager"]["summary"] and figures["auto-eager"]["graphs"] == 0
    assert figures["compiled"]["graphs"] == COMPILED_GRAPHS[model], figures["compiled"]
    # eager calls replay CUDA graphs where the family declares them (a full batch's shape, and a short one at most),
    # to the bit of the calls they replay
    declared = family_of(compose_cfg(f"model={model}").model.pipeline).cuda_graphs
    assert (figures["eager"]["cuda_graphs"] > 0) == declared and figures["ungraphed"]["cuda_graphs"] == 0, figures
    assert sorted(images["ungraphed"]) == sorted(images["eager"])
    assert all((images["ungraphed"][i] == images["eager"][i]).all() for i in images["eager"]), "graphs changed pixels"

    floor = {i: psnr(images["floor"][i], images["eager"][i]) for i in images["eager"]}
    worst = {}
    for way, imgs in images.items():
        assert sorted(imgs) == list(range(PROMPTS)), way
        worst[way] = min(psnr(imgs[i], images["eager"][i]) - min(floor[i], 60.0) for i in imgs)
    report = {"model": model, "ways": figures, "psnr_floor_min": min(floor.values()),
              "worst_psnr_minus_floor": worst}
    print(json.dumps(report, indent=1, default=str))
    if os.environ.get("SHARDGEN_MATRIX_OUT"):
        out = os.path.join(os.environ["SHARDGEN_MATRIX_OUT"], f"{model}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    assert all(w >= -3.0 for w in worst.values()), worst
    rep = verify_run(load_plan(RunDir(resumed)))
    assert rep.ok, rep.defects
