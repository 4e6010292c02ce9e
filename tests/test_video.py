"""Video runs (model=tiny_video): mp4 shards webdataset reads back, frames decoded with PyAV, verify,
preview, fingerprint and settings checks, and a SIGKILL-ed run resumed to the uninterrupted bytes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from jobs.generate import run
from shardgen.dataio.ledger import read_ledger
from shardgen.dataio.plan import load_plan
from shardgen.dataio.rundir import RunDir
from shardgen.dataio.verify import read_shard_members, verify_run
from shardgen.dataio.video import check_video_member, decode_video, encode_video
from tests.conftest import ROOT, compose_cfg

# 32x32, 5 frames (2 latent frames), 2 steps: a batch of 2 videos in well under a second
FAST = ("model=tiny_video", "height=32", "width=32", "num_frames=5", "steps=2", "batch_size=2", "progress=false")


def shard_videos(run_dir: Path) -> dict[str, bytes]:
    """key -> mp4 bytes over every committed shard."""
    return {key: mem["mp4"] for tar in sorted((run_dir / "shards").glob("*.tar"))
            for key, mem in read_shard_members(tar).items()}


@pytest.fixture(scope="module")
def video_run(tmp_path_factory) -> Path:
    """A finished 6-prompt video run in 2 shards."""
    d = tmp_path_factory.mktemp("video") / "run"
    result = run(compose_cfg(f"run_dir={d}", "prompts.limit=6", "samples_per_shard=4", *FAST))
    assert (result.ok, result.failed, result.complete) == (6, 0, True)
    return d


def test_mp4_shards_read_back_with_webdataset_and_pyav(video_run):
    tars = sorted(str(t) for t in (video_run / "shards").glob("*.tar"))
    samples = list(wds.WebDataset(tars, shardshuffle=False).decode())
    assert len(samples) == 6
    prompts = (ROOT / "examples" / "prompts.txt").read_text().splitlines()
    firsts = set()
    for s in samples:
        assert set(s) >= {"mp4", "txt", "json"} and not {"png", "jpg", "webp"} & set(s)
        frames, info = decode_video(s["mp4"])
        meta = s["json"]
        assert frames.shape == (5, 32, 32, 3) and frames.dtype == np.uint8
        assert (info.codec, info.fps) == ("h264", 16.0)
        assert s["txt"] == prompts[meta["index"]] == meta["prompt"]
        assert (meta["frames"], meta["fps"], meta["duration"], meta["size"], meta["codec"]) == (5, 16, 0.3125, [32, 32],
                                                                                                "libx264")
        assert (meta["model"], meta["steps"], meta["status"], meta["height"]) == ("tiny_video", 2, "ok", 32)
        firsts.add(frames[0].tobytes())
    assert len(firsts) == 6  # every sample its own seed


def test_verify_decodes_every_video_and_preview_shows_frames(video_run, capsys):
    from jobs import preview, verify

    assert verify.main([str(video_run)]) == 0
    assert "6/6 samples (6 ok)" in capsys.readouterr().out
    out = video_run / "sheet.png"
    assert preview.main([str(video_run), "--size", "64", "--out", str(out)]) == 0
    sheet = np.asarray(Image.open(out).convert("RGB"))
    cell = sheet[:64, :64]
    assert cell.std() > 0 and not (cell == 255).all()  # the first cell holds frames, not the blank sheet


def test_verify_counts_frames_against_the_json():
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    mp4 = encode_video(frames, 16)
    assert check_video_member("k", mp4, dict(frames=5, size=[32, 32])) == []
    assert check_video_member("k", mp4, dict(frames=9)) == ["k: mp4 has 5 frames, its json says 9"]
    assert "video does not decode" in check_video_member("k", mp4[: len(mp4) // 3], dict(frames=5))[0]


def test_encoding_is_deterministic_and_crf_0_is_near_lossless():
    """Resumes compare bytes: the same frames must give the same mp4 (one x264 thread)."""
    smooth = np.tile(np.linspace(0, 255, 32).astype(np.uint8)[None, None, :, None], (5, 32, 1, 3))
    assert encode_video(smooth, 16, crf=0) == encode_video(smooth, 16, crf=0)
    back, _ = decode_video(encode_video(smooth, 16, crf=0))
    assert np.abs(back.astype(int) - smooth).max() <= 2  # yuv420p rounding only


def test_changed_fps_or_frames_are_refused_on_resume(video_run):
    with pytest.raises(Exception) as e:
        run(compose_cfg(f"run_dir={video_run}", "prompts.limit=6", "samples_per_shard=4", *FAST, "fps=24",
                        "num_frames=9"))
    assert "fps: run has 16, this launch has 24" in str(e.value)
    assert "num_frames: run has 5, this launch has 9" in str(e.value)


@pytest.mark.parametrize("override,needle", [
    ("num_frames=8", "num_frames=8: Wan's VAE compresses time 4x, so use 4k+1 frames"),
    ("video_codec=nope", "video_codec='nope' is not an FFmpeg encoder"),
    ("video_crf=60", "video_crf=60: use 0 (lossless) .. 51"),
    ("fps=0", "fps=0: use a positive frame rate"),
])
def test_bad_video_settings_fail_before_anything_is_written(tmp_path, override, needle):
    with pytest.raises(ValueError) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *FAST, override))
    assert needle in str(e.value)
    assert not (tmp_path / "run").exists()


def _durable(run_dir: Path) -> int:
    plan = load_plan(RunDir(run_dir))
    return 0 if plan is None else read_ledger(plan).done_samples


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, video_run):
    """Kill the whole job (SIGKILL) once its first batch is durable; the rerun's mp4 bytes equal video_run's."""
    args = [sys.executable, "-m", "jobs.generate", "prompts.limit=6", "samples_per_shard=4", *FAST]
    for attempt in range(3):  # if the job finishes before the kill lands, start over on a fresh run
        run_dir = tmp_path / f"run{attempt}"
        with open(tmp_path / "log", "ab") as log:
            p = subprocess.Popen(args + [f"run_dir={run_dir}"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=dict(os.environ))
        while p.poll() is None and _durable(run_dir) < 2:
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if 0 < _durable(run_dir) < 6:
            break
    else:
        pytest.fail("the kill never landed mid-run: " + (tmp_path / "log").read_text()[-2000:])
    result = run(compose_cfg(f"run_dir={run_dir}", "prompts.limit=6", "samples_per_shard=4", *FAST))
    assert result.complete and result.generated_here < 6
    assert verify_run(load_plan(RunDir(run_dir))).ok
    assert shard_videos(run_dir) == shard_videos(video_run)
