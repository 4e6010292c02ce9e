"""LPIPS in plain torch (shardgen/quality/lpips.py) equals the lpips package's v0.1 "alex" on the same weights,
is 0 for identical images and grows with the distortion; a weight file it cannot use is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shardgen.quality.lpips import LpipsQueue, LpipsWeightsError, load_lpips

ALEXNET = ((0, 3, 64, 11), (3, 64, 192, 5), (6, 192, 384, 3), (8, 384, 256, 3), (10, 256, 256, 3))
"""torchvision's alexnet().features: (index, in, out, kernel) of each convolution."""


def write_weights(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """Random LPIPS weights in the two files' formats: an AlexNet state dict (``features.*``, plus a classifier
    tensor as a whole model's file has, which LPIPS ignores) and lpips's ``lin{n}.model.1.weight`` (non-negative, as
    lpips's training keeps them)."""
    torch.manual_seed(seed)
    net = {}
    for i, ci, co, k in ALEXNET:
        net[f"features.{i}.weight"] = torch.randn(co, ci, k, k) / math.sqrt(ci * k * k)
        net[f"features.{i}.bias"] = torch.randn(co) * 0.1
    net["classifier.6.bias"] = torch.randn(1000)
    lins = {f"lin{n}.model.1.weight": torch.rand(1, co, 1, 1) for n, (_, _, co, _) in enumerate(ALEXNET)}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(net, folder / "alexnet.pth")
    torch.save(lins, folder / "alex.pth")
    return folder / "alexnet.pth", folder / "alex.pth"


def pairs() -> list[tuple[np.ndarray, np.ndarray]]:
    """Seeded image pairs: a smooth 64x64 image against itself with noise of sigma 8 and 32, shifted by 3 pixels,
    and against an unrelated random image; a random 48x40 pair; a pair of 2-frame 40x40 videos."""
    rng = np.random.default_rng(0)
    smooth = np.kron(rng.integers(0, 256, (8, 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)
    noisy = [np.clip(smooth + rng.normal(0, s, smooth.shape), 0, 255).astype(np.uint8) for s in (8, 32)]
    other = rng.integers(0, 256, smooth.shape).astype(np.uint8)
    small = rng.integers(0, 256, (2, 48, 40, 3)).astype(np.uint8)
    video = rng.integers(0, 256, (2, 2, 40, 40, 3)).astype(np.uint8)
    return [(smooth, noisy[0]), (smooth, noisy[1]), (smooth, np.roll(smooth, 3, axis=1)), (smooth, other),
            (small[0], small[1]), (video[0], video[1])]


# The lpips package's figures for pairs() on write_weights(folder, seed=0), computed once (lpips 0.1.4,
# torchvision 0.28.0, torch 2.13.0+cpu, float32 on the CPU) by a script that ran, with lpips installed beside:
#   model = lpips.LPIPS(net="alex", version="0.1", pretrained=True, pnet_rand=True, model_path=str(alex.pth))
#   model.net.load_state_dict({"slice{s}.{i}.{p}": v for alexnet.pth's "features.{i}.{p}": v}, strict=True)
#   (s = 1 + the number of lpips's slice bounds 2, 5, 8, 10 that i reaches; pnet_rand=True so that nothing
#   downloads; the lins, loaded from model_path, checked equal to alex.pth's tensors)
#   with torch.no_grad(): model(lpips.im2tensor(a), lpips.im2tensor(b)).item()   (a video: mean over its frames)
# torchvision's PyPI wheel is a CUDA build whose compiled ops do not load against a CPU torch, so the script imported
# torchvision.models (pure Python, its real alexnet) through a bare package module that skips torchvision/__init__.
# shardgen's figures differ from these by less than 1e-8.
REFERENCE = [0.012133531272411346, 0.1570376306772232, 0.46632471680641174, 1.0734385251998901,
             0.9579386115074158, 0.9392379522323608]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_weights(tmp_path_factory.mktemp("lpips"))


def test_lpips_equals_the_lpips_package_on_the_same_weights(weights):
    model = load_lpips(*weights, device="cpu")
    got = [model(a, b) for a, b in pairs()]
    assert got == pytest.approx(REFERENCE, abs=1e-5)


def test_identical_images_give_0_and_a_stronger_distortion_more(weights):
    model = load_lpips(*weights, device="cpu")
    (smooth, light), (_, heavy) = pairs()[:2]
    assert model(smooth, smooth.copy()) == 0.0
    assert 0 < model(smooth, light) < model(smooth, heavy)
    assert model(smooth, light) == pytest.approx(model(light, smooth), abs=1e-7)


def test_the_queue_batches_frames_and_gives_each_sample_the_mean_over_its_frames(weights):
    model = load_lpips(*weights, device="cpu")
    video_a, video_b = pairs()[-1]
    queue = LpipsQueue(model, batch_pixels=40 * 40 * 3)  # 3 frames of 40x40 per forward pass
    assert queue.add("video", video_a, video_b) == []  # 2 frames wait for the batch to fill
    done = queue.add("image", video_a[0], video_b[1])  # the third: the batch runs
    assert [tag for tag, _ in done] == ["video", "image"]
    assert queue.add("again", video_a[1], video_a[1]) == []
    done = dict(done + queue.flush())
    per_frame = [model(x, y) for x, y in zip(video_a, video_b)]
    assert done["video"] == pytest.approx(np.mean(per_frame), abs=1e-7)
    assert done["image"] == pytest.approx(model(video_a[0], video_b[1]), abs=1e-7) and done["again"] == 0.0


def test_the_queue_keeps_frames_of_many_sizes_waiting_within_its_bound(weights):
    model = load_lpips(*weights, device="cpu")
    rng = np.random.default_rng(1)
    queue = LpipsQueue(model, batch_pixels=3 * 40 * 40)  # 3 frames of 40x40, 2 of 40x44 per batch
    small, wide = (rng.integers(0, 256, (2, 2, h, w, 3)).astype(np.uint8) for h, w in ((40, 40), (40, 44)))
    assert queue.add("a", small[0][0], small[1][0]) == []
    assert queue.add("b", wide[0][0], wide[1][0]) == []  # 3,360 pixels wait, of 4,800
    done = dict(queue.add("c", small[0][1], small[1][1]))  # 4,960: no batch is full, yet all run
    assert sorted(done) == ["a", "b", "c"] and not any(queue.waiting.values())
    assert done["b"] == pytest.approx(model(wide[0][0], wide[1][0]), abs=1e-7)


def test_images_too_small_or_of_two_sizes_are_refused():
    from shardgen.quality.lpips import _check

    with pytest.raises(ValueError, match="at least 31x31 pixels, not 30x64"):
        _check(np.zeros((30, 64, 3), np.uint8), np.zeros((30, 64, 3), np.uint8))
    with pytest.raises(ValueError, match="a 32x32x3 sample with a 32x33x3 one"):
        _check(np.zeros((32, 32, 3), np.uint8), np.zeros((32, 33, 3), np.uint8))


def _damaged(kind: str, good: Path, tmp: Path) -> Path:
    bad = tmp / f"{kind}.pth"
    if kind == "missing":
        return bad
    if kind == "garbage":
        bad.write_bytes(np.random.default_rng(0).bytes(4096))
    elif kind == "truncated":
        data = good.read_bytes()
        bad.write_bytes(data[:len(data) // 2])
    elif kind == "empty":
        bad.write_bytes(b"")
    elif kind == "not a dict":
        torch.save([torch.zeros(3)], bad)
    elif kind == "wrong keys":
        torch.save({"conv1.weight": torch.zeros(64, 3, 11, 11)}, bad)
    elif kind == "wrong shape":
        state = torch.load(good, weights_only=True)
        key = next(iter(state))
        state[key] = state[key].flatten()[1:]
        torch.save(state, bad)
    return bad


@pytest.mark.parametrize("which", ["backbone", "layers"])
@pytest.mark.parametrize("kind, needle", [
    ("missing", ": no such file"),
    ("garbage", ": not a readable torch weights file, or a truncated one (UnpicklingError: "),
    ("truncated", ": not a readable torch weights file, or a truncated one (RuntimeError: "),
    ("empty", ": not a readable torch weights file, or a truncated one (EOFError: "),
    ("not a dict", ": holds a list, not a state dict"),
    ("wrong keys", ": has no "),
    ("wrong shape", " is "),
])
def test_a_weight_file_lpips_cannot_use_is_named_in_one_line(weights, tmp_path, which, kind, needle):
    backbone, layers = weights
    bad = _damaged(kind, backbone if which == "backbone" else layers, tmp_path)
    with pytest.raises(LpipsWeightsError) as err:
        load_lpips(bad, layers) if which == "backbone" else load_lpips(backbone, bad)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"--lpips-{which} {bad}: ") and needle in message
    if kind in ("wrong keys", "wrong shape"):
        assert ("not torchvision's AlexNet" if which == "backbone" else "not lpips's v0.1 alex.pth") in message


def test_the_two_files_swapped_are_refused(weights):
    backbone, layers = weights
    with pytest.raises(LpipsWeightsError, match=r"has no features\.0\.weight \(found lin0\.model\.1\.weight"):
        load_lpips(layers, backbone)


def test_a_weight_file_replaced_since_it_was_read_is_read_again(tmp_path):
    """The checked weights are kept per process (the job checks the files, then its gate uses them), but a file
    replaced in between is not taken from that memory."""
    backbone, layers = write_weights(tmp_path / "w")
    load_lpips(backbone, layers, "cpu")
    layers.write_bytes(b"garbage")
    with pytest.raises(LpipsWeightsError, match="--lpips-layers .*alex.pth: not a readable torch weights file"):
        load_lpips(backbone, layers, "cpu")
