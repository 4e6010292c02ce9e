"""Fidelity figures: PSNR/SSIM equal a reference implementation; jobs.compare compares two runs of one plan sample
by sample, writes its figures into the run and refuses two different plans."""

from __future__ import annotations

import json
import math

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
    assert written["compared"] == 6 and sorted(written["samples"]) == [f"{i:010d}" for i in range(6)]
    worst = min(s["psnr"] for s in written["samples"].values())
    assert 10 < worst < math.inf and written["psnr_db"]["worst"] == worst  # fp8 changed pixels, not all of them
    assert all(0 < s["ssim"] < 1 for s in written["samples"].values())

    assert jobs.compare.main([str(runs / "again"), str(runs / "ref"), "--json"]) == 0  # a lossless rerun: exact
    exact = json.loads(capsys.readouterr().out)
    assert exact["psnr_db"]["worst"] == math.inf and exact["ssim"]["worst"] == 1.0


def test_a_bound_the_worst_sample_misses_exits_1(runs, capsys):
    assert jobs.compare.main([str(runs / "fp8"), str(runs / "ref"), "--min-psnr", "200"]) == 1
    assert "below the bound: worst PSNR" in capsys.readouterr().err
    assert jobs.compare.main([str(runs / "fp8"), str(runs / "ref"), "--min-psnr", "5", "--min-ssim", "0.01"]) == 0


def test_runs_of_different_prompts_are_refused_in_one_line(runs, capsys):
    assert jobs.compare.main([str(runs / "other"), str(runs / "ref")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "sample 0000000000 was made with prompt=" in err and "one prompt file" in err
    assert not (runs / "other" / "compare.json").exists()
