"""Video runs (model=tiny_video): mp4 shards webdataset reads back, frames decoded with PyAV, verify,
preview, fingerprint and settings checks, and a SIGKILL-ed run resumed to the uninterrupted bytes."""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.resume.ledger import read_ledger
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.shards.video import check_video_member, decode_video, encode_video, yuv420p
from shardgen.tools.verify import read_shard_members, verify_run
from tests.conftest import ROOT, compose_cfg, rank_environment, start_process, start_ranks

# 32x32, 5 frames (2 latent frames), 2 steps: a batch of 2 videos in well under a second. Lossless (crf 0): a video
# decodes to the frames the job made, so runs are compared by those frames (see assert_same_videos)
FAST = ("model=tiny_video", "height=32", "width=32", "num_frames=5", "steps=2", "batch_size=2", "progress=false",
        "video_crf=0")


def shard_videos(run_dir: Path) -> dict[str, bytes]:
    """key -> mp4 bytes over every committed shard."""
    return {key: mem["mp4"] for tar in sorted((run_dir / "shards").glob("*.tar"))
            for key, mem in read_shard_members(tar).items()}


# x264 (FFmpeg as PyAV bundles it) does not always make the same bytes from the same frames: on a loaded machine about
# 1 encode in 10 to 50 takes other decisions. Lossless, those decisions never change the decoded frames.


def assert_same_videos(run_dir: Path, reference: Path) -> None:
    """The two runs (lossless: FAST) hold the same samples: each mp4 byte for byte the reference's, or another
    encode of the same frames (decoding to them exactly); the message names the samples that are not, by how much
    their frames differ, with their prompts and seeds (what a rare mismatch needs to be traced)."""
    got, want = shard_videos(run_dir), shard_videos(reference)
    assert sorted(got) == sorted(want)
    differ = []
    for k in sorted(k for k in got if got[k] != want[k]):
        a, b = decode_video(got[k])[0].astype(int), decode_video(want[k])[0].astype(int)
        if a.shape != b.shape or not np.array_equal(a, b):
            differ.append((k, np.abs(a - b).max() if a.shape == b.shape else f"shapes {a.shape} vs {b.shape}"))
    if differ:
        meta = {key: json.loads(mem["json"]) for tar in sorted((run_dir / "shards").glob("*.tar"))
                for key, mem in read_shard_members(tar).items()}
        lines = [f"{k}: {len(got[k])} vs {len(want[k])} bytes, max pixel diff {diff}, "
                 f"{ {n: meta[k].get(n) for n in ('index', 'prompt', 'seed')} }" for k, diff in differ]
        raise AssertionError("videos differ:\n" + "\n".join(lines))


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
    out = video_run.parent / "sheet.png"  # a tool's output outside the run directory
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


def test_crf_0_is_near_lossless_and_decodes_to_the_same_frames_each_encode():
    """Lossless x264 (crf=0): whatever bitstream decisions an encode takes, the same frames decode back the same."""
    smooth = np.tile(np.linspace(0, 255, 32).astype(np.uint8)[None, None, :, None], (5, 32, 1, 3))
    first, second = (decode_video(encode_video(smooth, 16, crf=0))[0] for _ in range(2))
    assert np.array_equal(first, second)
    assert np.abs(first.astype(int) - smooth).max() <= 2  # yuv420p rounding only


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
    ("latent_checkpoint_every=0", "latent_checkpoint_every=0: use N >= 1 steps, with a video model and strategy=dp"),
    ("latent_checkpoint_every=often", "latent_checkpoint_every=often: use N >= 1 steps"),
    ("latent_checkpoint_s=0", "latent_checkpoint_s=0.0: use a positive number of seconds"),
])
def test_bad_video_settings_fail_before_anything_is_written(tmp_path, override, needle):
    with pytest.raises(ValueError) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *FAST, override))
    assert needle in str(e.value)
    assert not (tmp_path / "run").exists()


def _durable(run_dir: Path) -> int:
    plan = load_plan(RunDir(run_dir))
    return 0 if plan is None else read_ledger(plan).done_samples


def _generate_logged(args: tuple[str, ...], log: str) -> None:
    """The job (jobs.generate.run) in this process, its output appended to ``log``."""
    import logging

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO)
    run(compose_cfg(*args))


def _kill_job_when(tmp_path: Path, args: tuple[str, ...], ready, landed) -> Path:
    """Start the job on a fresh run in a process of its own, SIGKILL it once ``ready(run_dir)``; start over (at most 3
    times) unless ``landed(run_dir)`` (the job may finish before the kill). The run dir."""
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        p = start_process(_generate_logged, ((*args, f"run_dir={run_dir}"), str(tmp_path / "log")))
        while p.is_alive() and not ready(run_dir):
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):  # it may have finished and been reaped
            os.kill(p.pid, signal.SIGKILL)
        p.join()
        if landed(run_dir):
            return run_dir
    pytest.fail("the kill never landed mid-run: " + (tmp_path / "log").read_text()[-2000:])


def test_frames_reach_the_encoder_as_bt601_yuv_computed_here_and_decode_back():
    """The RGB -> yuv420p conversion is shardgen's own (BT.601 limited range, 2x2 chroma means): white, black and
    red have their textbook values, and flat colours come back from the mp4 within 8-bit YUV rounding."""
    colours = np.array([[255, 255, 255], [0, 0, 0], [255, 0, 0]], dtype=np.uint8)
    planes = [yuv420p(np.broadcast_to(c, (4, 6, 3))) for c in colours]
    assert [(p[0, 0], p[4, 0], p[5, 0]) for p in planes] == [(235, 128, 128), (16, 128, 128), (81, 90, 240)]
    assert planes[0].shape == (6, 6)
    for c in colours:
        frames = np.broadcast_to(c, (3, 32, 48, 3)).copy()
        decoded, info = decode_video(encode_video(frames, 16))
        assert (info.frames, info.width, info.height) == (3, 48, 32)
        assert np.abs(decoded.astype(int) - frames).max() <= 2, c  # 8-bit YUV rounds red to 253


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, video_run):
    """Kill the whole job (SIGKILL) once its first batch is durable; the rerun's videos are video_run's."""
    args = ("prompts.limit=6", "samples_per_shard=4", *FAST)
    run_dir = _kill_job_when(tmp_path, args, lambda d: _durable(d) >= 2, lambda d: 0 < _durable(d) < 6)
    result = run(compose_cfg(f"run_dir={run_dir}", *args))
    assert result.complete and result.generated_here < 6
    assert verify_run(load_plan(RunDir(run_dir))).ok
    assert_same_videos(run_dir, video_run)


# --- the real Wan architectures (model.weights=dummy) ---------------------------------------------------------

def test_wan_dummy_architectures_have_the_published_sizes():
    """Built on the meta device (no memory): Wan 2.1 1.3B = 1.419B, 14B = 14.288B transformer parameters (what the
    released safetensors hold), UMT5-XXL encoder 5.68B; Wan 2.2 A14B = two 14B experts."""
    from shardgen.models.dummy import construct_meta, dummy_architecture

    def params(arch):
        return {n: sum(p.numel() for p in construct_meta(s).parameters()) for n, s in dummy_architecture(arch).items()
                if s.library in ("diffusers", "transformers") and not s.cls.endswith("Scheduler")}

    small, big, moe = params("wan21_t2v_1_3b"), params("wan21_t2v_14b"), params("wan22_t2v_a14b")
    assert small["transformer"] == 1_418_996_800 and big["transformer"] == 14_288_491_584
    assert moe["transformer"] == moe["transformer_2"] == big["transformer"]
    assert small["text_encoder"] == big["text_encoder"] == 5_680_910_336


def test_wan22_dummy_scaled_down_runs_both_experts_through_the_job_path():
    """The dummy path builds Wan 2.2's pipeline with its boundary_ratio and second expert; both experts run."""
    import torch

    from shardgen.models.dummy import build_dummy_pipeline

    tiny_tr = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=1, text_dim=32, freq_dim=32)
    pipe = build_dummy_pipeline("wan22_t2v_a14b", "cpu", torch.float32, overrides=dict(
        transformer=tiny_tr, transformer_2=tiny_tr, text_encoder=dict(d_model=32, d_ff=37, d_kv=8, num_layers=1,
                                                                      num_heads=4, vocab_size=1000),
        vae=dict(base_dim=4, decoder_base_dim=2, dim_mult=[1, 1, 2, 2], num_res_blocks=1)))
    assert pipe.config.boundary_ratio == 0.875 and pipe.tokenizer.model_max_length == 512
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    out = pipe(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=4.0,
               guidance_scale_2=3.0, max_sequence_length=16, output_type="pt")
    assert out.frames.shape == (1, 5, 3, 32, 32)
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0  # the high- and the low-noise expert


# --- context parallel: Ulysses-2 under gloo on the tiny video model -------------------------------------------

def _ulysses_video_rank(rank: int, cfg_yaml: str, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks: the tiny video pipeline alone, then split by strategy=cp_ulysses; the largest difference."""
    rank_environment(rank, port)
    import torch
    from omegaconf import OmegaConf

    from parallel import world as W
    from parallel.strategies import apply_strategy, parallel_dims
    from shardgen.models.loader import load_pipeline, torch_dtype
    from shardgen.run.generation import GenSettings, pipeline_kwargs

    cfg = OmegaConf.create(cfg_yaml)

    def video(pipe):  # two prompts with their seeds, as the job calls the pipeline
        kw = pipeline_kwargs(pipe, GenSettings.from_cfg(cfg), ["a cat", "an astronaut riding a horse"], [11, 12])
        return pipe(**kw).frames

    torch.set_num_threads(1)
    world = W.init_world("cpu")
    with torch.no_grad():
        ref_frames = video(load_pipeline(cfg.model, torch_dtype(cfg.dtype), world.device))
        dims = parallel_dims(cfg, 2)
        dims.build_mesh(world.device.type)
        pipe = apply_strategy(cfg, world, dims)
        seen = []  # video tokens each block sees on this rank: half of them under Ulysses-2
        pipe.transformer.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        frames = video(pipe)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(
        diff=(frames - ref_frames).abs().max().item(), shape=list(frames.shape), spread=ref_frames.std().item(),
        tokens=sorted(set(seen)))))
    W.shutdown()


@pytest.mark.slow
def test_ulysses2_equals_one_process_on_the_tiny_video_model(tmp_path):
    """float64: the split computation differs from one process only in summation order (~1e-15); any real mistake
    (a wrong shard of the video tokens or of RoPE, a misordered gather) gives differences of 1e-2 and more."""
    from omegaconf import OmegaConf

    from shardgen.launch.local import free_port

    cfg = compose_cfg("model=tiny_video", "strategy=cp_ulysses", "ulysses_degree=2", "steps=2", "launcher=local",
                      "launcher.nprocs=2")
    start_ranks(_ulysses_video_rank, (OmegaConf.to_yaml(cfg), free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: {res}")
        assert res["shape"] == [2, 9, 3, 64, 64] and res["spread"] > 1e-3
        assert res["tokens"] == [48 // 2]  # 3 latent frames x 4 x 4 patches, split over the 2 ranks
        assert res["diff"] <= 1e-10, res


@pytest.mark.slow
def test_whole_ulysses2_job_writes_the_one_rank_mp4_bytes(tmp_path, video_run):
    """The video job with `strategy=cp_ulysses ulysses_degree=2 launcher=local launcher.nprocs=2`: a run jobs.verify
    accepts, byte for byte the one-rank run's videos."""
    run_dir = tmp_path / "run"
    run(compose_cfg("strategy=cp_ulysses", "ulysses_degree=2", "launcher=local", "launcher.nprocs=2",
                    f"run_dir={run_dir}", "prompts.limit=6", "samples_per_shard=4", *FAST))
    assert verify_run(load_plan(RunDir(run_dir))).ok
    assert_same_videos(run_dir, video_run)


@pytest.mark.parametrize("override,needle", [
    ("ulysses_degree=3", "ulysses_degree=3 does not divide the 4 attention heads of WanTransformer3DModel"),
    ("num_frames=1", "image tokens = 9 (1 latent frames of num_frames=1 x 48/16 x 48/16) do not divide by the CP "
                     "degree 2"),
])
def test_bad_video_cp_degrees_fail_before_any_weight_is_read(tmp_path, override, needle):
    from parallel.strategies import parallel_dims
    from parallel.world import ParallelConfigError

    cfg = compose_cfg("model=tiny_video", "strategy=cp_ulysses", "ulysses_degree=2", "height=48", "width=48",
                      f"model.cache_dir={tmp_path / 'nothing'}", override)
    with pytest.raises(ParallelConfigError) as e:
        parallel_dims(cfg, cfg.ulysses_degree)
    assert needle in str(e.value)
    assert not (tmp_path / "nothing").exists()  # the model was never built nor read


@pytest.mark.slow
def test_the_tiny_models_tokenizers_are_the_same_in_every_process(tmp_path):
    """Two fresh processes build the same vocabularies, CLIP's and T5's (a trained unigram T5 one differed in each
    process), so two machines that each build model=tiny or model=tiny_video get the same model."""
    code = ("import hashlib, json, pathlib, sys; from shardgen.models.tiny import train_tokenizers as t; "
            "toks = t(pathlib.Path(sys.argv[1])); "
            "print(hashlib.sha256(json.dumps([sorted(k.get_vocab().items()) for k in toks]).encode()).hexdigest())")
    outs = set()
    for seed in (1, 2):
        (tmp_path / str(seed)).mkdir()
        outs.add(subprocess.run([sys.executable, "-c", code, str(tmp_path / str(seed))], cwd=ROOT, capture_output=True,
                                text=True, check=True, env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout)
    assert len(outs) == 1


# --- mid-sample checkpoints (latent_checkpoint_every) ----------------------------------------------------------

def test_latent_checkpoints_are_on_by_default_for_video_batches_that_take_a_minute():
    from shardgen.run.latent_ckpt import LatentCheckpoints

    video = LatentCheckpoints.from_cfg(compose_cfg(*FAST))
    assert video.interval_s == 60.0 and video.every is None
    assert not video.due(done=3, since_save_s=59.0) and video.due(done=3, since_save_s=60.0)
    assert LatentCheckpoints.from_cfg(compose_cfg("model=tiny")) is None  # images: a sample takes seconds
    assert LatentCheckpoints.from_cfg(compose_cfg(*FAST), strategy="cp_ulysses") is None  # dp only
    assert LatentCheckpoints.from_cfg(compose_cfg(*FAST, "latent_checkpoint_every=null")) is None
    assert LatentCheckpoints.from_cfg(compose_cfg(*FAST, "latent_checkpoint_every=4")).due(8, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("every", [("latent_checkpoint_every=2",),
                                   # the same resume path as every-2-steps; only when a checkpoint is due differs
                                   # (tests LatentCheckpoints.due directly above)
                                   pytest.param(("latent_checkpoint_every=auto", "latent_checkpoint_s=0.05"),
                                                marks=pytest.mark.soak)],
                         ids=["every-2-steps", "auto-by-time"])
def test_sigkill_between_denoising_steps_resumes_from_the_saved_step(tmp_path, caplog, every):
    """A real SIGKILL once the batch's first latent checkpoint exists (every 2 steps of 8, or the default auto
    with a tiny interval: whenever that much denoising time passed); the rerun says from which step it resumes
    and writes the uninterrupted run's mp4 bytes."""
    args = ("prompts.limit=2", "samples_per_shard=2", *FAST, "steps=8", *every)
    run(compose_cfg(f"run_dir={tmp_path / 'whole'}", *args))
    saved = lambda d: any((d / "latents").glob("*.pt")) if (d / "latents").is_dir() else False  # noqa: E731
    run_dir = _kill_job_when(tmp_path, args, saved, lambda d: saved(d) and _durable(d) == 0)
    with caplog.at_level("INFO", logger="shardgen.latents"):
        assert run(compose_cfg(f"run_dir={run_dir}", *args)).complete
    assert re.search(r"samples 0..1: resuming from step [1-7] of 8", caplog.text), caplog.text
    assert_same_videos(run_dir, tmp_path / "whole")
    assert not list((run_dir / "latents").iterdir())  # removed once the batch went to the writer


@pytest.mark.parametrize("damage", ["garbage", "empty", "a tensor", "step out of range", "wrong batch", "symlink"])
def test_a_damaged_latent_checkpoint_is_ignored_with_a_warning(tmp_path, caplog, damage):
    """The latents/ file of a batch is untrusted: anything but a state save() wrote for that batch is ignored,
    said so in the log, and the batch starts from step 0 instead of crashing every rerun."""
    import torch

    from shardgen.run.latent_ckpt import LatentCheckpoints

    ckpt = LatentCheckpoints(tmp_path / "latents", every=2)
    ckpt.directory.mkdir()
    path, good = ckpt.path([0, 1]), dict(indices=[0, 1], step=2, latents=torch.zeros(2, 3), scheduler={})
    if damage == "garbage":
        path.write_bytes(b"not a checkpoint")
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "a tensor":
        torch.save(torch.zeros(3), path)
    elif damage == "step out of range":
        torch.save(dict(good, step=8), path)
    elif damage == "wrong batch":
        torch.save(dict(good, latents=torch.zeros(5, 3)), path)
    else:
        torch.save(good, tmp_path / "elsewhere.pt")
        path.symlink_to(tmp_path / "elsewhere.pt")
    with caplog.at_level("WARNING", logger="shardgen.latents"):
        assert ckpt.load([0, 1], steps=8) is None
    assert "the batch starts from step 0" in caplog.text
    if damage != "symlink":
        torch.save(good, path)
        assert ckpt.load([0, 1], steps=8)["step"] == 2  # the intact state of the same batch is used


def test_a_run_with_a_garbage_latent_checkpoint_completes_with_the_plain_bytes(tmp_path, video_run):
    """End to end: a garbage file where batch 0's checkpoint goes; the rerun ignores it, and its mp4s equal a
    clean run's."""
    run_dir = tmp_path / "run"
    RunDir(run_dir).start()  # a run's directory (shardgen writes into no other): its owner record
    (run_dir / "latents").mkdir(parents=True)
    (run_dir / "latents" / "0000000000+2.pt").write_bytes(b"\x80garbage")
    assert run(compose_cfg(f"run_dir={run_dir}", "prompts.limit=6", "samples_per_shard=4", *FAST,
                           "latent_checkpoint_every=2")).complete
    assert_same_videos(run_dir, video_run)


def test_the_attention_kernel_is_chosen_for_the_videos_own_token_count(tmp_path, monkeypatch):
    """sdpa_backend=auto times the kernels at the shape of a video transformer's self-attention: every latent
    frame's tokens (a 33-frame 480x832 Wan video has 14,040, not one frame's 1,560 plus the text)."""
    from shardgen.speed import accel

    shapes, seen = [], []

    def context(pipe, opts, shape):
        shapes.append(shape)
        if not seen:  # the tokens the transformer gets: latent (frames, height, width) in its patches
            pt, ph, pw = pipe.transformer.config.patch_size
            pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(
                (kw["hidden_states"].shape[0], kw["hidden_states"].shape[2] // pt * (kw["hidden_states"].shape[3] // ph)
                 * (kw["hidden_states"].shape[4] // pw))), with_kwargs=True)
        return contextlib.nullcontext()

    monkeypatch.setattr(accel, "sdpa_context", context)
    r = run(compose_cfg(f"run_dir={tmp_path}", *FAST, "prompts.limit=2"))
    assert r.ok == 2
    batch, tokens = seen[0]
    assert (batch, tokens) == (2, 2 * 2 * 2)  # 5 frames -> 2 latent frames of 4x4 latents in 1x2x2 patches
    assert [(s[0], s[2]) for s in shapes] == [(batch, tokens)]


def _audio_only_mp4() -> bytes:
    """A valid mp4 whose one stream is audio: a sample's mp4 member a user could have swapped in."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as f:
        stream = f.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            f.mux(packet)
    return buf.getvalue()


def test_an_mp4_without_a_video_stream_does_not_decode_for_verify_compare_and_preview(monkeypatch, capsys):
    """Not an IndexError from deep inside the tools: verify names the sample, compare counts it missing, preview
    shows its cell without a picture."""
    from jobs import preview
    from shardgen.quality.compare import decode

    data = _audio_only_mp4()
    with pytest.raises(ValueError, match="no video stream"):
        decode_video(data)
    assert check_video_member("k", data, {"frames": 4}) == ["k: video does not decode (the file holds no video stream)"]
    assert decode("k", {"mp4": data}) is None
    monkeypatch.setattr(preview, "_members", lambda run, n: iter([("k", {"mp4": data, "txt": b"a prompt"})]))
    assert preview.collect(None, 1) == [("a prompt", None, {})]
    assert "sample k: its video does not decode (the file holds no video stream)" in capsys.readouterr().err
