"""Fidelity figures: PSNR/SSIM equal a reference implementation; jobs.compare compares two runs of one plan sample
by sample, writes its figures into the run and refuses two different plans."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

import jobs.compare
from jobs.generate import run
from shardgen.quality.metrics import psnr, ssim
from tests.conftest import compose_cfg, write_lines

ARGS = ("height=32", "width=32", "steps=2", "progress=false", "samples_per_shard=4", "batch_size=2")


def _pairs():
    rng = np.random.default_rng(0)
    smooth = np.kron(rng.integers(0, 256, (8, 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)  # 64x64 blocks
    noisy = np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
    shifted = np.roll(smooth, 3, axis=1)
    flat = np.full((40, 56, 3), 128, np.uint8)
    return [(smooth, noisy), (smooth, shifted), (flat, flat.copy()), (noisy, 255 - noisy),
            (rng.integers(0, 256, (23, 31, 3)).astype(np.uint8), rng.integers(0, 256, (23, 31, 3)).astype(np.uint8))]


@pytest.mark.parametrize("a, b", _pairs())
def test_psnr_and_ssim_equal_scikit_image(a, b):
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    ref_ssim = structural_similarity(a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
                                     data_range=255, channel_axis=-1)
    assert ssim(a, b) == pytest.approx(ref_ssim, abs=1e-9)
    if np.array_equal(a, b):
        assert psnr(a, b) == math.inf
    else:
        assert psnr(a, b) == pytest.approx(peak_signal_noise_ratio(a, b, data_range=255), abs=1e-9)


def test_a_video_is_the_mean_over_its_frames_and_shapes_must_agree():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (3, 16, 16, 3)).astype(np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-9, 10, a.shape), 0, 255).astype(np.uint8)
    assert ssim(a, b) == pytest.approx(np.mean([ssim(x, y) for x, y in zip(a, b)]))
    with pytest.raises(ValueError, match="16x16x3 sample with a 16x17x3"):
        ssim(a[0], np.zeros((16, 17, 3), np.uint8))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A lossless run, the same plan with fp8, the same plan again, and a run of other prompts."""
    tmp = tmp_path_factory.mktemp("quality")
    f = write_lines(tmp / "p.txt", [f"a picture of thing {i}" for i in range(6)])
    other = write_lines(tmp / "q.txt", [f"something else {i}" for i in range(6)])
    for name, extra in (("ref", ()), ("fp8", ("fp8=true",)), ("again", ()), ("other", ())):
        run(compose_cfg(f"run_dir={tmp / name}", f"prompts.path={other if name == 'other' else f}", *ARGS, *extra))
    return tmp


def test_compare_gives_per_sample_figures_and_writes_them_into_the_run(runs, capsys):
    assert jobs.compare.main([str(runs / "fp8"), str(runs / "ref")]) == 0
    line = capsys.readouterr().out
    assert line.startswith("6 samples compared with ") and "PSNR median" in line and "SSIM median" in line
    written = json.loads((runs / "fp8" / "compare.json").read_text())
    samples = [json.loads(line) for line in (runs / "fp8" / "compare_samples.jsonl").read_text().splitlines()]
    assert written["compared"] == 6 and [s["key"] for s in samples] == [f"{i:010d}" for i in range(6)]
    worst = min(s["psnr"] for s in samples)
    assert 10 < worst < math.inf and written["psnr_db"]["worst"] == worst  # fp8 changed pixels, not all of them
    assert all(0 < s["ssim"] < 1 for s in samples)
    assert written["worst_samples"] == sorted(samples, key=lambda s: (s["psnr"], s["ssim"], s["key"]))

    assert jobs.compare.main([str(runs / "again"), str(runs / "ref"), "--json"]) == 0  # a lossless rerun: exact
    exact = json.loads(capsys.readouterr().out)
    assert exact["psnr_db"]["worst"] == math.inf and exact["ssim"]["worst"] == 1.0


def test_a_bound_the_worst_sample_misses_exits_1(runs, capsys):
    assert jobs.compare.main([str(runs / "fp8"), str(runs / "ref"), "--min-psnr", "200"]) == 1
    worst = json.loads((runs / "fp8" / "compare.json").read_text())["psnr_db"]["worst"]
    assert capsys.readouterr().err.endswith(f"below the bound: worst PSNR {worst:.2f} dB < 200\n")
    assert jobs.compare.main([str(runs / "fp8"), str(runs / "ref"), "--min-psnr", "5", "--min-ssim", "0.01"]) == 0


def test_runs_of_different_prompts_are_refused_in_one_line(runs, capsys):
    assert jobs.compare.main([str(runs / "other"), str(runs / "ref")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "sample 0000000000 was made with prompt=" in err and "one prompt file" in err
    assert not (runs / "other" / "compare.json").exists()


def _corrupt_one_layer(monkeypatch):
    """fp8 that damages one quantised layer (its scales x-20), as a broken kernel or a bad checkpoint would."""
    from shardgen.speed import fp8

    real = fp8.enable_fp8

    def damaged(transformer):
        n = real(transformer)
        layer = [m for m in transformer.modules() if isinstance(m, fp8.Float8Linear)][-1]  # the last block's output
        layer.weight_scale.mul_(-20)
        return n

    monkeypatch.setattr(fp8, "enable_fp8", damaged)


def _provenance(run_dir):
    from tests.test_generate import shard_images  # noqa: F401 (same reader family)
    from shardgen.tools.verify import read_shard_members

    metas = [json.loads(m["json"]) for tar in sorted((run_dir / "shards").glob("*.tar"))
             for m in read_shard_members(tar).values()]
    return metas


GATE = ("fp8=true", "calibrate_samples=3", "calibrate_min_psnr=40", "calibrate_min_ssim=0.99")


def test_the_gate_passes_a_good_setting_and_records_it_without_changing_the_samples(runs, tmp_path):
    from tests.test_generate import shard_images

    f = runs / "p.txt"
    run(compose_cfg(f"run_dir={tmp_path / 'gated'}", f"prompts.path={f}", *ARGS, *GATE))
    assert shard_images(tmp_path / "gated") == shard_images(runs / "fp8")  # the gate changes no pixel
    record = json.loads((tmp_path / "gated" / "calibration.json").read_text())
    assert record["passed"] and record["samples"] == 3 and record["lossy"] == {"fp8": True}
    assert record["psnr_db"]["worst"] >= 40 and len(record["per_sample"]) == 3
    metas = _provenance(tmp_path / "gated")
    assert len(metas) == 6 and all(m["provenance"]["calibration"]["passed"] for m in metas)
    assert all(m["lossy"] == {"fp8": True} for m in metas)


def test_the_run_commits_the_calibration_s_lossy_samples_instead_of_making_them_again(runs, tmp_path, monkeypatch):
    from shardgen.run import generation, shardrun
    from tests.test_generate import shard_images

    def counting(real, rows_made):
        return lambda pipe, s, rows, *a: rows_made.extend(r.index for r in rows) or real(pipe, s, rows, *a)

    made_by_the_run, calibrated = [], []
    monkeypatch.setattr(shardrun, "generate_batch", counting(shardrun.generate_batch, made_by_the_run))
    monkeypatch.setattr(generation, "generate_batch", counting(generation.generate_batch, calibrated))
    out = tmp_path / "gated"
    summary = run(compose_cfg(f"run_dir={out}", f"prompts.path={runs / 'p.txt'}", *ARGS, "fp8=true",
                              "calibrate_samples=4", "calibrate_min_psnr=40"))
    assert calibrated == [0, 1, 2, 3] * 2  # lossless, then lossy
    assert made_by_the_run == [4, 5]  # the first shard's rows came from the calibration
    assert shard_images(out) == shard_images(runs / "fp8")  # the same pixels as a run without the gate
    assert (summary.ok, summary.generated_here) == (6, 6) and all(m["lossy"] == {"fp8": True} for m in _provenance(out))


RELAUNCH = ("fp8=true", "calibrate_samples=4", "calibrate_min_psnr=40")


@pytest.fixture(scope="module")
def cut_gated_run(runs):
    """A gated fp8 run of p.txt stopped as its second shard starts: the calibration passed, shard 0 committed."""
    from shardgen.run.runner import run_rank

    def stop(event, worker):
        if event == "start":
            raise KeyboardInterrupt

    d = runs / "cut-gated"
    with pytest.raises(KeyboardInterrupt):
        run_rank(compose_cfg(f"run_dir={d}", f"prompts.path={runs / 'p.txt'}", *ARGS, *RELAUNCH), on_batch=stop)
    assert json.loads((d / "calibration.json").read_text())["passed"]
    return d


def _relaunch(runs, cut, to, monkeypatch, *extra) -> tuple[list, list]:
    """``cut`` copied to ``to`` and launched again: (the rows the calibration made, the rows the run made)."""
    import shutil

    from shardgen.run import generation, shardrun
    from tests.test_generate import shard_images

    def counting(real, rows_made):
        return lambda pipe, s, rows, *a: rows_made.extend(r.index for r in rows) or real(pipe, s, rows, *a)

    if not to.exists():
        shutil.copytree(cut, to, symlinks=True)
    calibrated, made = [], []
    monkeypatch.setattr(shardrun, "generate_batch", counting(shardrun.generate_batch, made))
    monkeypatch.setattr(generation, "generate_batch", counting(generation.generate_batch, calibrated))
    summary = run(compose_cfg(f"run_dir={to}", f"prompts.path={runs / 'p.txt'}", *ARGS, *RELAUNCH, *extra))
    assert summary.ok == 6 and shard_images(to) == shard_images(runs / "fp8")
    assert all(m["provenance"]["calibration"]["passed"] for m in _provenance(to))
    return calibrated, made


def test_a_relaunch_takes_the_earlier_launch_s_passed_calibration_instead_of_making_it_again(
        runs, cut_gated_run, tmp_path, monkeypatch, caplog):
    record = (cut_gated_run / "calibration.json").read_bytes()
    with caplog.at_level("INFO", logger="shardgen.quality"):
        calibrated, made = _relaunch(runs, cut_gated_run, tmp_path / "r", monkeypatch)
    assert (calibrated, made) == ([], [4, 5])
    assert "the earlier launch's passed (PSNR worst" in caplog.text and "not made again" in caplog.text
    assert (tmp_path / "r" / "calibration.json").read_bytes() == record
    assert all("made_for" not in m["provenance"]["calibration"] for m in _provenance(tmp_path / "r"))  # no paths


def _gated_rank(rank: int, cfg_yaml: str, port: int, out: str, damaged: bool) -> None:
    """A rank of a two-replica dp job (gloo): the rows its calibration made, and those its run made, go to
    OUT/rank{rank}.json."""
    from omegaconf import OmegaConf

    from shardgen.run import generation, shardrun
    from shardgen.run.runner import run_rank
    from tests.conftest import rank_environment

    def counting(real, rows_made):
        return lambda pipe, s, rows, *a: rows_made.extend(r.index for r in rows) or real(pipe, s, rows, *a)

    rank_environment(rank, port)
    mp, calibrated, made = pytest.MonkeyPatch(), [], []
    mp.setattr(shardrun, "generate_batch", counting(shardrun.generate_batch, made))
    mp.setattr(generation, "generate_batch", counting(generation.generate_batch, calibrated))
    if damaged:
        _corrupt_one_layer(mp)
    try:
        run_rank(OmegaConf.create(cfg_yaml))
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps([calibrated, made]))


@pytest.mark.slow
def test_the_replicas_of_a_job_split_the_calibration_and_judge_all_of_its_rows_alike(runs, cut_gated_run, tmp_path):
    """Two dp replicas: each makes every other row of the four both ways (2 + 2 samples, not 4 + 4), and the record
    holds the figures of all four rows, those a one-process launch measured; a damaged setting stops both replicas
    with the gate's line."""
    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port
    from tests.conftest import start_ranks

    def launch(run_dir, damaged):
        cfg = compose_cfg(f"run_dir={run_dir}", f"prompts.path={runs / 'p.txt'}", *ARGS, *RELAUNCH)
        start_ranks(_gated_rank, (OmegaConf.to_yaml(cfg), free_port(), str(tmp_path), damaged), nprocs=2)
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    (calibrated0, made0), (calibrated1, made1) = launch(tmp_path / "r", damaged=False)
    assert (calibrated0, calibrated1) == ([0, 2, 0, 2], [1, 3, 1, 3])  # lossless, then lossy: its share of the rows
    assert sorted(made0 + made1) == [0, 1, 2, 3, 4, 5]  # the run: every row once (no share is a batch of the run)
    record = json.loads((tmp_path / "r" / "calibration.json").read_text())
    alone = json.loads((cut_gated_run / "calibration.json").read_text())  # the same rows, one process
    assert record["passed"] and record["per_sample"] == alone["per_sample"] and len(record["per_sample"]) == 4
    assert (record["psnr_db"], record["ssim"]) == (alone["psnr_db"], alone["ssim"])

    with pytest.raises(mp.ProcessRaisedException) as stopped:
        launch(tmp_path / "damaged", damaged=True)
    assert "calibration of {'fp8': True} over 4 samples against lossless" in str(stopped.value)
    assert "Nothing was made" in str(stopped.value)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [[[0, 2, 0, 2], []],
                                                                                        [[1, 3, 1, 3], []]]
    assert not json.loads((tmp_path / "damaged" / "calibration.json").read_text())["passed"]
    assert not list((tmp_path / "damaged" / "shards").glob("*.tar"))


def _failing_share_rank(rank: int, cfg_yaml: str, port: int, out: str) -> None:
    """A rank of a two-replica dp job whose calibration share fails on rank 1 alone; writes what the rank raised."""
    from omegaconf import OmegaConf

    from parallel.world import echo_of_rank0
    from shardgen.quality import gate
    from shardgen.run.runner import run_rank
    from tests.conftest import rank_environment

    def lost(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rank_environment(rank, port)
    if rank == 1:
        pytest.MonkeyPatch().setattr(gate, "_measure", lost)
    try:
        run_rank(OmegaConf.create(cfg_yaml))
        said = {"raised": None}
    except Exception as e:  # noqa: BLE001 - what the rank stops with is the finding
        said = {"raised": type(e).__name__, "message": str(e), "echo": echo_of_rank0(e)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(said))


def test_a_calibration_share_failing_on_one_replica_stops_every_replica_with_its_error(runs, tmp_path):
    """The other replica does not go on alone with half the figures, nor wait for them: it stops with the same
    error (printed once: the failing rank says it), and nothing is made."""
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port
    from tests.conftest import start_ranks

    cfg = compose_cfg(f"run_dir={tmp_path / 'r'}", f"prompts.path={runs / 'p.txt'}", *ARGS, *RELAUNCH)
    start_ranks(_failing_share_rank, (OmegaConf.to_yaml(cfg), free_port(), str(tmp_path)), nprocs=2)
    other, failing = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert failing == {"raised": "RuntimeError", "message": "CUDA error: an illegal memory access was encountered",
                       "echo": False}
    assert other == dict(failing, echo=True)
    assert not (tmp_path / "r" / "calibration.json").exists() and not list((tmp_path / "r" / "shards").glob("*.tar"))


def test_a_change_to_shardgen_s_own_code_is_a_change_of_what_made_the_samples(tmp_path, monkeypatch):
    import shutil

    import parallel
    import shardgen
    from shardgen.quality import gate

    for package in (shardgen, parallel):  # copies of the sources, one of which the test changes
        copy = tmp_path / package.__name__
        shutil.copytree(Path(package.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
        monkeypatch.setattr(package, "__file__", str(copy / "__init__.py"))
    gate._sources_sha256.cache_clear()
    before = gate._sources_sha256()
    gate._sources_sha256.cache_clear()
    kernel = tmp_path / "shardgen" / "speed" / "fp8.py"
    kernel.write_text(kernel.read_text() + "\n# a change\n")
    assert gate._sources_sha256() != before
    gate._sources_sha256.cache_clear()


def test_a_dry_run_says_whether_the_launch_calibrates_or_takes_the_earlier_verdict(runs, cut_gated_run, tmp_path):
    from shardgen.run.dryrun import describe, dry_run

    def quality(run_dir, *extra):
        args = (f"run_dir={run_dir}", f"prompts.path={runs / 'p.txt'}", *ARGS, *RELAUNCH, *extra, "dry_run=true")
        return [line for line in describe(dry_run(compose_cfg(*args))).splitlines() if line.startswith("  quality")]

    make = ("4 samples made losslessly and with {'fp8': True} before the run (the replicas of one job split them); "
            "bounds PSNR >= 40 dB; below one: stop")
    assert quality(tmp_path / "new") == [f"  quality   {make}"]
    worst = json.loads((cut_gated_run / "calibration.json").read_text())["psnr_db"]["worst"]
    assert quality(cut_gated_run) == [f"  quality   the earlier launch's calibration passed (PSNR worst {worst:.2f} dB "
                                      "on cpu): a launch on that GPU model with the same bounds and package versions "
                                      f"takes it; otherwise {make}"]
    assert quality(tmp_path / "lossless", "fp8=false") == []  # nothing lossy: nothing to calibrate


def _edit_record(**made_for):
    def edit(path):
        record = json.loads(path.read_text())
        record["made_for"].update(made_for)
        path.write_text(json.dumps(record))
    return edit


def _symlinked(path):
    (path.parent.parent / "elsewhere.json").write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(path.parent.parent / "elsewhere.json")


@pytest.mark.parametrize("damage, extra, warned", [
    (_edit_record(device="NVIDIA B200"), (), ""),  # another GPU model's kernels
    (_edit_record(versions={"torch": "0.1"}), (), ""),  # other kernels' versions
    (_edit_record(strategy="tp", ranks=2), (), ""),  # each rank quantised its own shard of every layer
    (lambda path: None, ("calibrate_min_psnr=41",), ""),  # another bound
    (lambda path: path.write_text(path.read_text().replace('"passed": true', '"passed": false')), (), ""),
    (lambda path: path.write_bytes(path.read_bytes()[:100]), (), "cannot be read"),  # truncated
    (lambda path: path.write_bytes(b""), (), "cannot be read"),
    (lambda path: path.write_text('{"passed": true}'), (), "is not a calibration record"),  # no figures: no verdict
    (_symlinked, (), "symlink"),
], ids=["other-gpu", "other-versions", "other-strategy", "other-bound", "not-passed", "truncated", "empty",
        "no-figures", "symlink"])
def test_a_relaunch_calibrates_again_where_the_earlier_verdict_does_not_hold_or_cannot_be_read(
        runs, cut_gated_run, tmp_path, monkeypatch, caplog, damage, extra, warned):
    import shutil

    to = tmp_path / "r"
    shutil.copytree(cut_gated_run, to)
    damage(to / "calibration.json")
    with caplog.at_level("INFO", logger="shardgen.quality"):
        calibrated, made = _relaunch(runs, cut_gated_run, to, monkeypatch, *extra)
    assert calibrated == [0, 1, 2, 3] * 2 and made == [4, 5]  # shard 0 was committed: the lossy four are not taken
    assert "calibrating again" in caplog.text
    if warned:  # a damaged record is a warning; a verdict that does not hold here is news, not a fault
        assert [r for r in caplog.records if r.levelname == "WARNING" and warned in r.getMessage()]
    record = json.loads((to / "calibration.json").read_text())
    assert record["passed"] and record["made_for"]["rows"] == [0, 1, 2, 3]
    assert not (to / "calibration.json").is_symlink()


def test_the_gate_stops_a_damaged_setting_before_any_sample_in_one_line(runs, tmp_path, monkeypatch):
    from shardgen.quality.gate import CalibrationFailed

    _corrupt_one_layer(monkeypatch)
    with pytest.raises(CalibrationFailed) as err:
        run(compose_cfg(f"run_dir={tmp_path / 'bad'}", f"prompts.path={runs / 'p.txt'}", *ARGS, *GATE))
    message = str(err.value)
    assert "\n" not in message and "< calibrate_min_psnr=40" in message and "Nothing was made" in message
    assert "calibrate_fallback=lossless" in message and "fp8" in message
    assert not list((tmp_path / "bad" / "shards").glob("*.tar"))
    record = json.loads((tmp_path / "bad" / "calibration.json").read_text())
    assert not record["passed"] and record["action"] == "stop" and record["psnr_db"]["worst"] < 40


def test_the_lossless_fallback_makes_the_lossless_run(runs, tmp_path, monkeypatch):
    from tests.test_generate import shard_images

    _corrupt_one_layer(monkeypatch)
    run(compose_cfg(f"run_dir={tmp_path / 'fallback'}", f"prompts.path={runs / 'p.txt'}", *ARGS, *GATE,
                    "calibrate_fallback=lossless"))
    assert shard_images(tmp_path / "fallback") == shard_images(runs / "ref")
    metas = _provenance(tmp_path / "fallback")
    assert all("lossy" not in m and m["provenance"]["calibration"]["action"] == "lossless" for m in metas)


@pytest.mark.parametrize("first_compiled", [False, True])  # compile=auto's first batches eager; compile=true
def test_the_calibration_never_compiles_its_lossless_pass_and_runs_the_lossy_one_as_the_first_batch(
        monkeypatch, first_compiled):
    import dataclasses

    from shardgen.dataio.shards import Sample
    from shardgen.quality import gate
    from shardgen.run.generation import GenSettings

    cfg = compose_cfg(*ARGS, "fp8=true", "calibrate_samples=2")
    settings = GenSettings.from_cfg(cfg, "dp")
    settings = dataclasses.replace(settings, compile_auto=True, accel=dataclasses.replace(settings.accel, compile=True),
                                   latents="mid-sample checkpoints")
    first = dataclasses.replace(settings, accel=dataclasses.replace(settings.accel, compile=first_compiled))
    passes = []

    def batches(pipe, s, rows, ranks):
        assert s.latents is None  # a checkpoint named by its rows alone would pass from one pass to the other
        passes.append((s.accel.fp8, s.accel.compile))
        pixels = np.zeros((16, 16, 3), np.uint8)
        return [((0, 1), [Sample("0", 0, "a", {}, pixels), Sample("1", 1, "b", {}, pixels + 9)], 1.0)]

    monkeypatch.setattr(gate, "_batches", batches)
    monkeypatch.setattr(gate, "first_rows", lambda plan, n: [object()] * n)
    monkeypatch.setattr(gate, "made_for", lambda *a: {})
    went_on, record, made = gate.calibrate(cfg, None, object(), settings, 1, first_batch=first)
    assert passes == [(False, False), (True, first_compiled)]
    assert went_on == settings and record["passed"]  # the run's own settings go on: its decider sets compile
    assert made.settings == dataclasses.replace(first, latents=None) and list(made.batches) == [(0, 1)]


@pytest.mark.parametrize("records, first_compiled", [
    ({}, False),  # nothing measured yet: eager until the first batches show what compiling saves
    ({"eager_s": 3.0, "compiled_s": 1.5, "compiled_before": True, "compile_warm_s": 5.0}, True),  # pays at once
    ({"eager_s": 3.0, "compiled_s": 2.9, "compiled_before": True, "compile_warm_s": 60.0}, False),  # never pays
])
def test_the_first_batch_settings_are_compile_auto_s_choice_for_the_work_left(tmp_path, monkeypatch, records,
                                                                             first_compiled):
    """What the quality gate's lossy pass runs with: the decider's choice as the worker then keeps it."""
    import dataclasses
    from types import SimpleNamespace

    from shardgen.run import runner
    from shardgen.run.generation import GenSettings
    from shardgen.speed import autocompile

    settings = GenSettings.from_cfg(compose_cfg(*ARGS, "fp8=true"), "dp")
    settings = dataclasses.replace(settings, compile_auto=True, accel=dataclasses.replace(settings.accel, compile=True))
    plan = SimpleNamespace(num_shards=30, samples_per_shard=8, run=SimpleNamespace(done_shards=lambda: {0, 1}))
    if records:  # an earlier process's figures for these settings
        autocompile.write_record(tmp_path / "records.json", "key", records)
    auto = autocompile.AutoCompile("key", remaining=lambda: 0, path=tmp_path / "records.json", force=None)
    first = runner._first_batch_settings(auto, plan, SimpleNamespace(count=2), settings)
    assert first.accel.compile is first_compiled and auto.remaining() == 28 * 8 // 2
    assert auto.settings(settings) == first  # the worker's first batch: the same choice, made once
    assert runner._first_batch_settings(None, plan, SimpleNamespace(count=2), settings) is settings


@pytest.mark.parametrize("override, message", [
    ("calibrate_fallback=retry", "calibrate_fallback='retry': use one of ['stop', 'lossless']"),
    ("calibrate_min_ssim=2", "calibrate_min_ssim=2: use 0..1"),
    ("calibrate_min_psnr=30", "set calibrate_samples=N"),
])
def test_gate_settings_are_checked_before_any_work(tmp_path, override, message):
    from shardgen.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)):
        run(compose_cfg(f"run_dir={tmp_path / 'r'}", *ARGS, override))


def test_the_fast_profile_turns_on_fp8_with_a_calibration_and_default_is_lossless():
    fast, plain = compose_cfg("speed=fast"), compose_cfg()
    assert (fast.fp8, fast.calibrate_samples, fast.compile) == (True, 4, plain.compile)
    assert (plain.fp8, plain.calibrate_samples, plain.first_block_cache) == (False, 0, 0.0)
    assert compose_cfg("speed=fast", "fp8=false").fp8 is False  # a key on the command line wins over the profile


def test_a_lossy_setting_that_changes_no_pixel_passes_with_an_infinite_psnr_the_report_shows(runs, tmp_path):
    """first_block_cache (lossy) at a threshold no step ever falls under skips nothing: every calibration sample is
    identical to its lossless one, PSNR inf (Infinity in calibration.json, as in compare.json)."""
    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.tools.report import build_report

    result = run(compose_cfg(f"run_dir={tmp_path / 'cached'}", f"prompts.path={runs / 'p.txt'}", *ARGS,
                             "first_block_cache=1e-12", "calibrate_samples=2", "calibrate_min_psnr=40"))
    assert (result.ok, result.complete) == (6, True)
    text = (tmp_path / "cached" / "calibration.json").read_text()
    record = json.loads(text)
    assert record["passed"] and record["psnr_db"]["worst"] == float("inf") and '"worst": Infinity' in text
    assert record["lossy"] == {"first_block_cache": 1e-12}
    metas = _provenance(tmp_path / "cached")  # each sample's json: standard JSON, the infinity named
    assert len(metas) == 6 and all(m["provenance"]["calibration"]["psnr_db"]["worst"] == "inf" for m in metas)
    page = build_report(load_plan(RunDir(tmp_path / "cached")))
    assert "calibration (calibrate_samples)" in page and ">inf<" in page


def test_the_report_shows_the_figures_and_names_a_damaged_record(runs, tmp_path):
    import shutil

    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.tools.report import build_report

    run_dir = tmp_path / "copy"
    shutil.copytree(runs / "fp8", run_dir)
    assert jobs.compare.main([str(run_dir), str(runs / "ref")]) == 0
    page = build_report(load_plan(RunDir(run_dir)))
    assert "Fidelity against lossless" in page and "jobs.compare" in page
    worst = json.loads((run_dir / "compare.json").read_text())["psnr_db"]["worst"]
    assert f"{worst:.2f}" in page and "LPIPS median" not in page  # no perceptual figure asked: no empty columns
    (run_dir / "compare.json").write_bytes(b"\x00garbage{")
    page = build_report(load_plan(RunDir(run_dir)))
    assert "compare.json is unreadable (" in page and "); not shown" in page


def test_a_compare_of_many_samples_keeps_compare_json_small_and_the_report_shows_it(runs, tmp_path, monkeypatch,
                                                                                    capsys):
    """compare.json is a summary of a few kilobytes whatever the number of samples (every sample's figures go to
    compare_samples.jsonl), so the report's read bound holds for any run: 20,000 samples against a 1 MB bound stand
    for millions against its 64 MB."""
    import shutil

    import shardgen.quality.compare as qc
    import shardgen.tools.report as report
    import shardgen.tools.runfiles as runfiles
    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir

    n = 20_000
    rng = np.random.default_rng(0)
    psnrs, ssims = iter(rng.uniform(30, 60, n).tolist()), iter(rng.uniform(0.9, 1.0, n).tolist())
    monkeypatch.setattr(runfiles, "committed_shard_members",
                        lambda run, damaged=None: ((i // 100, f"{i:010d}", {}) for i in range(n)))
    monkeypatch.setattr(qc, "decode", lambda key, members: np.zeros(1, np.uint8))  # the figures come from above
    monkeypatch.setattr(qc, "psnr", lambda a, b: next(psnrs))
    monkeypatch.setattr(qc, "ssim", lambda a, b: next(ssims))
    monkeypatch.setattr(report, "FIDELITY_LIMIT", 1 << 20)
    run_dir = tmp_path / "big"
    shutil.copytree(runs / "fp8", run_dir)
    assert jobs.compare.main([str(run_dir), str(runs / "ref")]) == 0
    assert capsys.readouterr().out.startswith(f"{n} samples compared with ")

    assert (run_dir / "compare.json").stat().st_size < 16 << 10
    summary = json.loads((run_dir / "compare.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "compare_samples.jsonl").read_text().splitlines()]
    assert summary["compared"] == len(lines) == n and summary["samples_file"] == "compare_samples.jsonl"
    worst = min(lines, key=lambda s: s["psnr"])
    assert summary["worst_samples"][0] == worst and summary["psnr_db"]["worst"] == worst["psnr"]
    assert len(summary["worst_samples"]) == qc.WORST_SAMPLES
    assert worst["psnr"] <= summary["psnr_db"]["quantiles"]["0.01"] <= summary["psnr_db"]["median"]
    page = report.build_report(load_plan(RunDir(run_dir)))
    assert "Fidelity against lossless" in page and f"{worst['psnr']:.2f}" in page and "unreadable" not in page


def test_the_verdict_names_a_calibration_that_made_nothing_and_each_missed_bound():
    from shardgen.quality.gate import Bounds, verdict
    from shardgen.quality.metrics import summarize

    bounds = Bounds(calibrate_samples=2, calibrate_min_psnr=30, calibrate_min_ssim=0.9)
    assert verdict({"psnr_db": summarize([]), "ssim": summarize([])}, bounds) == [
        "no calibration sample could be made both ways"]
    missed = verdict({"psnr_db": summarize([40.0, 20.0]), "ssim": summarize([0.95, 0.5])}, bounds)
    assert missed == ["PSNR 20.00 dB < calibrate_min_psnr=30", "SSIM 0.5000 < calibrate_min_ssim=0.9"]
    assert verdict({"psnr_db": summarize([float("inf")]), "ssim": summarize([1.0])}, bounds) == []


def _members(seed: int, meta: dict, media: bytes | None = None) -> dict:
    import io

    from PIL import Image

    if media is None:
        pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3)).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        media = buf.getvalue()
    return {"json": json.dumps(meta).encode(), "png": media}


def test_a_run_compared_with_itself_is_refused_in_one_line(runs, tmp_path, capsys):
    (tmp_path / "link").symlink_to(runs / "fp8")
    for reference in (runs / "fp8", tmp_path / "link"):
        assert jobs.compare.main([str(runs / "fp8"), str(reference)]) == 2
        err = capsys.readouterr().err
        assert f"{runs / 'fp8'} is compared with itself" in err and "Traceback" not in err


def test_samples_in_one_run_only_or_not_decodable_are_counted_missing_not_compared():
    from shardgen.quality.compare import compare_samples

    meta = dict(prompt="p", seed=1, height=16, width=16)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nshowpage\n"
    run = [("0000000000", _members(0, meta)), ("0000000001", _members(1, meta)), ("0000000003", _members(3, meta, eps))]
    ref = [("0000000001", _members(1, meta)), ("0000000002", _members(2, meta)), ("0000000003", _members(3, meta))]
    out = compare_samples(iter(run), iter(ref))
    assert list(out.samples) == ["0000000001"] and out.samples["0000000001"]["psnr"] == math.inf
    assert out.missing == 3  # 0 and 2 in one run only; 3 is PostScript, never opened


def test_a_stream_out_of_sample_order_is_refused():
    from shardgen.quality.compare import PlanMismatch, compare_samples

    meta = dict(prompt="p", seed=1, height=16, width=16)
    run = [("0000000002", _members(0, meta)), ("0000000001", _members(1, meta))]
    with pytest.raises(PlanMismatch, match="sample 0000000001 comes after 0000000002"):
        compare_samples(iter(run), iter([]), "run")


@pytest.fixture(scope="module")
def lpips_weights(tmp_path_factory):
    from tests.test_lpips import write_weights

    return write_weights(tmp_path_factory.mktemp("lpips"))


def _decoded(run_dir) -> dict:
    """key -> (pixels, prompt) of every sample of a run."""
    from shardgen.quality.compare import decode
    from shardgen.tools.verify import read_shard_members

    return {k: (decode(k, m), json.loads(m["json"])["prompt"]) for tar in sorted((run_dir / "shards").glob("*.tar"))
            for k, m in read_shard_members(tar).items()}


def test_compare_with_lpips_gives_each_sample_its_lpips_the_bound_and_the_report(runs, lpips_weights, tmp_path,
                                                                                 capsys):
    import shutil

    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.quality.lpips import load_lpips
    from shardgen.tools.report import build_report

    run_dir = tmp_path / "fp8"
    shutil.copytree(runs / "fp8", run_dir)
    weights = ["--lpips-backbone", str(lpips_weights[0]), "--lpips-layers", str(lpips_weights[1])]
    assert jobs.compare.main([str(run_dir), str(runs / "ref"), *weights]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    written = json.loads((run_dir / "compare.json").read_text())
    samples = [json.loads(s) for s in (run_dir / "compare_samples.jsonl").read_text().splitlines()]
    model, run_px, ref_px = load_lpips(*lpips_weights, device="cpu"), _decoded(run_dir), _decoded(runs / "ref")
    for s in samples:
        assert s["lpips"] == pytest.approx(model(run_px[s["key"]][0], ref_px[s["key"]][0]), abs=1e-6)
    lp = written["lpips"]
    assert lp["worst"] == max(s["lpips"] for s in samples) > 0 and lp["n"] == 6  # fp8 changed pixels
    assert lp["median"] == pytest.approx(np.median([s["lpips"] for s in samples]))
    assert list(lp["quantiles"]) == ["0.75", "0.9", "0.95", "0.99"] and lp["quantiles"]["0.99"] == lp["worst"]
    assert f"; LPIPS median {lp['median']:.3g}, worst {lp['worst']:.3g}" in line
    assert all("lpips" in s for s in written["worst_samples"]) and "clip_score" not in written
    assert (run_dir / "compare.json").stat().st_size < 16 << 10

    page = build_report(load_plan(RunDir(run_dir)))
    assert "LPIPS worst" in page and f"<td>{lp['worst']:.3g}</td>" in page

    assert jobs.compare.main([str(run_dir), str(runs / "ref"), *weights, "--max-lpips", str(lp["worst"] / 2)]) == 1
    assert f"below the bound: worst LPIPS {lp['worst']:.3g} > " in capsys.readouterr().err
    assert jobs.compare.main([str(run_dir), str(runs / "ref"), *weights, "--max-lpips", str(lp["worst"])]) == 0
    capsys.readouterr()
    assert jobs.compare.main([str(runs / "again"), str(runs / "ref"), *weights, "--json"]) == 0  # a lossless rerun
    assert json.loads(capsys.readouterr().out)["lpips"]["worst"] == 0.0


def test_compare_with_clip_scores_both_runs_against_the_prompts(runs, tmp_path, capsys):
    import shutil

    from shardgen.dataio.shards.signals import ClipScorer
    from tests.test_signals import _tiny_clip

    clip = _tiny_clip(tmp_path / "clip")
    run_dir = tmp_path / "fp8"
    shutil.copytree(runs / "fp8", run_dir)
    assert jobs.compare.main([str(run_dir), str(runs / "ref"), "--clip", str(clip)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    written = json.loads((run_dir / "compare.json").read_text())
    samples = [json.loads(s) for s in (run_dir / "compare_samples.jsonl").read_text().splitlines()]
    scorer, run_px, ref_px = ClipScorer(str(clip)), _decoded(run_dir), _decoded(runs / "ref")
    for s in samples:
        pixels, prompt = run_px[s["key"]]
        assert s["clip_run"] == pytest.approx(scorer(pixels, prompt), abs=1e-3)
        assert s["clip_reference"] == pytest.approx(scorer(ref_px[s["key"]][0], prompt), abs=1e-3)
    c = written["clip_score"]
    assert c["n"] == 6 and c["run"] == pytest.approx(np.mean([s["clip_run"] for s in samples]))
    assert c["reference"] == pytest.approx(np.mean([s["clip_reference"] for s in samples]))
    assert c["delta"]["worst"] == pytest.approx(min(s["clip_run"] - s["clip_reference"] for s in samples))
    assert len({s["clip_reference"] for s in samples}) > 1  # each prompt and image scored, not one figure
    assert f"; CLIP score {c['run']:.1f} vs {c['reference']:.1f} (reference)" in line and "lpips" not in written

    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.tools.report import build_report

    page = build_report(load_plan(RunDir(run_dir)))
    assert "CLIP score run / reference" in page and f"<td>{c['run']:.1f} / {c['reference']:.1f}</td>" in page


@pytest.mark.parametrize("options, needle", [
    (["--lpips-backbone", "a.pth"], "--lpips-backbone without --lpips-layers: LPIPS needs both files"),
    (["--lpips-layers", "a.pth"], "--lpips-layers without --lpips-backbone: LPIPS needs both files"),
    (["--max-lpips", "0.1"], "--max-lpips needs LPIPS: give --lpips-backbone PATH and --lpips-layers PATH"),
    (["--clip", "/nonexistent/clip"], "--clip /nonexistent/clip: no such directory"),
    (["--lpips-backbone", "{garbage}", "--lpips-layers", "{layers}"],
     "--lpips-backbone {garbage}: not a readable torch weights file, or a truncated one (UnpicklingError"),
    (["--lpips-backbone", "{layers}", "--lpips-layers", "{layers}"],
     "--lpips-backbone {layers}: has no features.0.weight (found lin0.model.1.weight"),
    (["--clip", "{clip}"], "--clip '{clip}': cannot load a CLIP model there (Error while deserializing header"),
])
def test_weights_that_cannot_be_used_are_refused_in_one_line_before_any_comparison(runs, lpips_weights, tmp_path,
                                                                                     capsys, options, needle):
    import shutil

    paths = {"garbage": tmp_path / "garbage.pth", "layers": lpips_weights[1], "clip": tmp_path / "clip"}
    paths["garbage"].write_bytes(np.random.default_rng(0).bytes(1000))
    paths["clip"].mkdir()
    (paths["clip"] / "config.json").write_text("{}")
    (paths["clip"] / "model.safetensors").write_bytes(b"garbage")  # a damaged weights file
    run_dir = tmp_path / "fp8"
    shutil.copytree(runs / "fp8", run_dir, ignore=shutil.ignore_patterns("compare*"))
    assert jobs.compare.main([str(run_dir), str(runs / "ref"), *[o.format(**paths) for o in options]]) == 2
    err, expected = capsys.readouterr().err.strip(), needle.format(**paths)
    assert "\n" not in err and expected in err, err
    assert not (run_dir / "compare.json").exists()


def test_lpips_of_images_too_small_for_alexnet_is_refused_in_one_line(lpips_weights):
    from shardgen.errors import UserError
    from shardgen.quality.compare import compare_samples
    from shardgen.quality.lpips import load_lpips

    meta = dict(prompt="p", seed=1, height=16, width=16)
    run = [("0000000000", _members(0, meta))]
    with pytest.raises(UserError, match=r"^sample 0000000000: LPIPS needs images of at least 31x31 pixels, not "
                                        r"16x16; compare this run without LPIPS$"):
        compare_samples(iter(run), iter(run), lpips=load_lpips(*lpips_weights, device="cpu"))


@pytest.fixture(scope="module")
def lpips_files(tmp_path_factory):
    """Seeded random LPIPS weight files (tests/test_lpips.py): the gate's figures are numerical, not perceptual."""
    from tests.test_lpips import write_weights

    backbone, layers = write_weights(tmp_path_factory.mktemp("lpips"))
    return (f"calibrate_lpips_backbone={backbone}", f"calibrate_lpips_layers={layers}")


def test_the_gate_measures_lpips_and_stops_a_damaged_setting_on_its_bound(runs, tmp_path, monkeypatch, lpips_files):
    from shardgen.quality.gate import CalibrationFailed

    gate = ("fp8=true", "calibrate_samples=3", "calibrate_max_lpips=0.01", *lpips_files)
    run(compose_cfg(f"run_dir={tmp_path / 'good'}", f"prompts.path={runs / 'p.txt'}", *ARGS, *gate))
    record = json.loads((tmp_path / "good" / "calibration.json").read_text())
    assert record["passed"] and record["bounds"]["max_lpips"] == 0.01
    assert 0 < record["lpips"]["worst"] <= 0.01 and all("lpips" in s for s in record["per_sample"].values())
    _corrupt_one_layer(monkeypatch)
    with pytest.raises(CalibrationFailed, match=r"; LPIPS median [\d.e-]+, worst [\d.e-]+: LPIPS [\d.e-]+ > "
                                                r"calibrate_max_lpips=0.01\. Nothing was made"):
        run(compose_cfg(f"run_dir={tmp_path / 'bad'}", f"prompts.path={runs / 'p.txt'}", *ARGS, *gate))
    assert not list((tmp_path / "bad" / "shards").glob("*.tar"))


@pytest.mark.parametrize("overrides, message", [
    (("calibrate_max_lpips=0.1",), "calibrate_max_lpips=0.1 needs the LPIPS weight files: set "
                                   "calibrate_lpips_backbone and calibrate_lpips_layers"),
    (("calibrate_lpips_backbone=/x.pth",), "LPIPS needs both weight files: set calibrate_lpips_backbone"),
    (("calibrate_lpips_backbone=/nowhere/alexnet.pth", "calibrate_lpips_layers=/nowhere/alex.pth"),
     "calibrate_lpips_backbone /nowhere/alexnet.pth"),
    (("calibrate_max_lpips=-1",), "calibrate_max_lpips=-1: use a number >= 0"),
])
def test_the_gates_lpips_settings_are_checked_before_any_work(tmp_path, overrides, message):
    from shardgen.errors import UserError

    with pytest.raises(UserError) as err:
        run(compose_cfg(f"run_dir={tmp_path / 'r'}", *ARGS, "fp8=true", "calibrate_samples=2", *overrides))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "r").exists()


def test_lpips_in_the_gate_needs_samples_alexnet_can_take(tmp_path, lpips_files):
    from shardgen.errors import UserError

    with pytest.raises(UserError, match="LPIPS needs samples of at least 31x31 pixels .*not 16x32"):
        run(compose_cfg(f"run_dir={tmp_path / 'r'}", *ARGS, "height=16", "fp8=true", "calibrate_samples=2",
                        *lpips_files))


def test_the_gate_does_not_pass_a_setting_that_fails_samples_the_lossless_pass_made(runs, tmp_path, monkeypatch):
    """A sample the lossy pass makes non-finite has no pixels to compare: it is a miss, not a sample left out."""
    from shardgen.quality import gate

    made = gate._batches

    def lossy_fails_all_but_one(pipe, settings, rows, ranks):
        out = made(pipe, settings, rows, ranks)
        for smp in [smp for _, samples, _ in out for smp in samples][1:] if settings.accel.lossy else []:
            smp.pixels, smp.status, smp.failure = None, "failed", "non-finite pixels"
        return out

    monkeypatch.setattr(gate, "_batches", lossy_fails_all_but_one)
    with pytest.raises(gate.CalibrationFailed) as err:
        run(compose_cfg(f"run_dir={tmp_path / 'r'}", f"prompts.path={runs / 'p.txt'}", *ARGS, "fp8=true",
                        "calibrate_samples=3", "calibrate_min_psnr=1"))
    assert "2 of the 3 samples made losslessly failed with {'fp8': True}" in str(err.value)
    record = json.loads((tmp_path / "r" / "calibration.json").read_text())
    assert not record["passed"] and record["failed_lossy"] == ["1", "2"]


def test_a_calibration_json_that_is_a_directory_is_named_before_the_calibration(runs, tmp_path, monkeypatch):
    from shardgen.dataio.rundir.storage import RunDirError
    from shardgen.quality import gate

    args = (f"run_dir={tmp_path / 'r'}", f"prompts.path={runs / 'p.txt'}", *ARGS, "fp8=true", "calibrate_samples=1")
    with pytest.raises(gate.CalibrationFailed):  # the record written, no sample made
        run(compose_cfg(*args, "calibrate_min_psnr=200"))
    (tmp_path / "r" / "calibration.json").unlink()
    (tmp_path / "r" / "calibration.json").mkdir()
    monkeypatch.setattr(gate, "_batches", lambda *a: pytest.fail("calibrated before naming the directory"))
    with pytest.raises(RunDirError, match="calibration.json is a directory"):
        run(compose_cfg(*args))


@pytest.mark.parametrize("record", [b"[" * 200_000, json.dumps(
    {"psnr_db": {"n": 3, "median": 40.0, "worst": 30.0}, "ssim": {"n": 3, "median": 0.99, "worst": 0.98},
     "passed": "false", "action": "stop", "lossy": {"fp8": True}}).encode()])
def test_the_report_names_a_calibration_record_too_deep_or_with_a_passed_that_is_no_verdict(runs, tmp_path, record):
    import shutil

    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.tools.report import build_report

    run_dir = tmp_path / "copy"
    shutil.copytree(runs / "fp8", run_dir)
    (run_dir / "calibration.json").write_bytes(record)
    page = build_report(load_plan(RunDir(run_dir)))
    assert "calibration.json is unreadable (" in page and "passed (" not in page


def test_a_damaged_shard_is_named_by_compare_and_fails_its_bound_not_passed_over(runs, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(runs / "fp8", run_dir)
    tar = run_dir / "shards" / "000000.tar"
    tar.write_bytes(tar.read_bytes()[:tar.stat().st_size // 2])
    assert jobs.compare.main([str(run_dir), str(runs / "ref"), "--min-psnr", "1"]) == 1
    out = capsys.readouterr()
    assert f"damaged shards not read in {run_dir}: 000000 (jobs.verify {run_dir} names them)" in out.out
    assert "below the bound: worst damaged shards were not compared" in out.err
    assert json.loads((run_dir / "compare.json").read_text())["damaged_shards"] == {str(run_dir): ["000000"]}
    assert jobs.compare.main([str(run_dir), str(runs / "ref")]) == 0  # no bound asked: the figures, and the names
