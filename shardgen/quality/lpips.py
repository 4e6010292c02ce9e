"""LPIPS (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features as a Perceptual Metric"), the
``lpips`` package's v0.1 "alex" variant, in plain torch: no torchvision or lpips at run time, and nothing downloaded.

The distance of two images: both scaled to [-1, 1] and shifted/scaled per channel (lpips's ScalingLayer), through
AlexNet's convolution stack (torchvision's ``alexnet().features``); at each of its 5 ReLU outputs the features are
unit-normalised along the channels, their squared difference weighted by a learned 1x1 convolution (lpips's
``lin0`` .. ``lin4``, one output channel, no bias) and averaged over the pixels; the distance is the sum over the 5
layers. 0 for identical images; larger is more different.

Weights come from two local files the user gives: torchvision's AlexNet state dict (``alexnet-owt-7be5be79.pth``;
only its ``features.*`` tensors are used) and lpips's ``weights/v0.1/alex.pth`` (``lin{0..4}.model.1.weight``).
"""

from __future__ import annotations

import functools
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Hashable

import numpy as np

from shardgen.errors import UserError

SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
"""lpips's ScalingLayer: ImageNet's mean and std expressed for inputs in [-1, 1]."""

CONVS = {0: (3, 64, 11, 4, 2), 3: (64, 192, 5, 1, 2), 6: (192, 384, 3, 1, 1), 8: (384, 256, 3, 1, 1),
         10: (256, 256, 3, 1, 1)}
"""torchvision's ``alexnet().features``: index in the Sequential -> (in, out, kernel, stride, padding)."""

MIN_SIDE = 31
"""The smallest image side AlexNet's stack takes: conv1 (stride 4) and two 3x3/2 max-pools leave at least 1 pixel."""

BATCH_PIXELS = 1 << 23
"""How many pixels of frames one forward pass takes (both images of each pair together: 2x this many); a frame
larger than that goes alone."""

EPS = 1e-10  # lpips's normalize_tensor: added to the norm, not under the square root


class LpipsWeightsError(UserError, ValueError):
    """A weight file LPIPS cannot use; the message names the file and what is wrong with it."""


# What torch.load raises on a file that is not a (whole) torch save: a damaged zip (RuntimeError), a pickle that
# is not one or holds objects weights_only refuses (UnpicklingError), an empty file (EOFError), text or other bytes
# read as a legacy save (KeyError, ValueError, IndexError...).
_LOAD_ERRORS = (OSError, EOFError, RuntimeError, pickle.UnpicklingError, KeyError, ValueError, IndexError,
                TypeError, AttributeError)


def load_state(path: str | Path, option: str) -> dict:
    """The tensors of a torch save at ``path`` (a dict of name -> tensor), read without running code
    (``weights_only``) onto the CPU; LpipsWeightsError naming ``option`` and the file when it is missing or is not
    such a file."""
    import torch

    where = f"{option} {path}"
    p = Path(path)
    if not p.is_file():
        raise LpipsWeightsError(f"{where}: {'is not a file' if p.exists() else 'no such file'}")
    try:
        state = torch.load(p, weights_only=True, map_location="cpu")
    except _LOAD_ERRORS as e:
        raise LpipsWeightsError(f"{where}: not a readable torch weights file, or a truncated one "
                                f"({type(e).__name__}: {_first_words(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise LpipsWeightsError(f"{where}: holds a {type(state).__name__}, not a state dict (names -> tensors)")
    return state


def _first_words(e: BaseException, n: int = 100) -> str:
    """The start of an exception's message on one line (torch's run to paragraphs)."""
    text = " ".join(str(e).split()) or "no message"
    return text if len(text) <= n else text[:n - 3] + "..."


def _take(state: dict, key: str, shape: tuple, where: str, expected: str):
    """``state[key]`` as float32, checked to have ``shape``."""
    import torch

    if key not in state:
        found = ", ".join(sorted(state)[:3]) or "nothing"
        raise LpipsWeightsError(f"{where}: has no {key} (found {found}{', ...' if len(state) > 3 else ''}): "
                                f"not {expected}")
    t = state[key]
    if tuple(t.shape) != shape:
        raise LpipsWeightsError(f"{where}: {key} is {_dims(t.shape)}, not {_dims(shape)}: not {expected}")
    if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
        raise LpipsWeightsError(f"{where}: {key} is not all finite floating-point numbers ({t.dtype})")
    return t.float()


def _dims(shape) -> str:
    return "x".join(map(str, shape)) or "a scalar"


FEATURE_RELUS = (1, 4, 7, 9, 11)
"""The indices in ``features`` of the ReLUs after conv1 .. conv5, whose outputs lpips compares."""


def alexnet_features():
    """torchvision's ``alexnet().features``: the same layers at the same indices, so the same state-dict keys."""
    from torch import nn

    layers = []
    for i, (ci, co, k, stride, padding) in CONVS.items():
        if i in (3, 6):  # features.2 and features.5
            layers.append(nn.MaxPool2d(kernel_size=3, stride=2))
        layers += [nn.Conv2d(ci, co, kernel_size=k, stride=stride, padding=padding), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.MaxPool2d(kernel_size=3, stride=2))  # features.12: lpips stops before it


def _lin(channels: int):
    """lpips's NetLinLayer at inference: ``model.1`` is its 1x1 convolution (``model.0``, its dropout, has no
    weights and does nothing in eval mode)."""
    from torch import nn

    lin = nn.Module()
    lin.model = nn.Sequential(nn.Identity(), nn.Conv2d(channels, 1, kernel_size=1, bias=False))
    return lin


class Lpips:
    """LPIPS v0.1 "alex" with given weights: ``model(a, b)`` of two uint8 images (HxWx3) or videos (FxHxWx3, the
    mean over frames); ``model.distances(a, b)`` of two stacks of frames, one forward pass."""

    def __init__(self, state: dict, device: str = "cpu"):
        """``state``: ``features.*`` and ``lin{0..4}.model.1.weight`` tensors, checked (``load_lpips``)."""
        import torch
        from torch import nn

        net = nn.Module()
        net.features = alexnet_features()
        for n, (_, co, _, _, _) in enumerate(CONVS.values()):
            setattr(net, f"lin{n}", _lin(co))
        net.load_state_dict(state, strict=True)
        self.device = torch.device(device)
        self.net = net.to(self.device).eval()
        self.lins = [getattr(self.net, f"lin{n}").model for n in range(len(CONVS))]
        self.shift = torch.tensor(SHIFT, device=self.device).reshape(1, 3, 1, 1)
        self.scale = torch.tensor(SCALE, device=self.device).reshape(1, 3, 1, 1)

    def _relus(self, x) -> list:
        """The 5 ReLU outputs lpips reads (after conv1 .. conv5) of scaled images."""
        out = []
        for i, layer in enumerate(self.net.features[:FEATURE_RELUS[-1] + 1]):
            x = layer(x)
            if i in FEATURE_RELUS:
                out.append(x)
        return out

    def distances(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """LPIPS of each pair of frames of two NxHxWx3 uint8 stacks of one shape, as float64."""
        import torch

        _check(a, b)
        n = len(a)
        with torch.no_grad():
            x = torch.from_numpy(np.concatenate([a, b])).to(self.device).permute(0, 3, 1, 2).float()
            x = (x / 127.5 - 1 - self.shift) / self.scale  # lpips.im2tensor, then its ScalingLayer
            total = torch.zeros(n, 1, 1, 1, device=self.device)
            for f, lin in zip(self._relus(x), self.lins):
                f = f / (torch.sqrt((f * f).sum(dim=1, keepdim=True)) + EPS)
                total += lin((f[:n] - f[n:]) ** 2).mean(dim=(2, 3), keepdim=True)
        return total.flatten().cpu().double().numpy()

    def __call__(self, a: np.ndarray, b: np.ndarray) -> float:
        """LPIPS of two uint8 images (HxWx3), or of two videos (FxHxWx3): the mean over their frames."""
        queue = LpipsQueue(self)
        queue.add(None, a, b)
        return dict(queue.flush())[None]


def _check(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ValueError(f"cannot compare a {_dims(a.shape)} sample with a {_dims(b.shape)} one")
    if min(a.shape[-3:-1]) < MIN_SIDE:
        raise ValueError(f"LPIPS needs images of at least {MIN_SIDE}x{MIN_SIDE} pixels, not "
                         f"{a.shape[-3]}x{a.shape[-2]}")


class LpipsQueue:
    """Pairs of samples waiting for their LPIPS, computed a batch of frames at a time (frames of one size per
    batch, ``BATCH_PIXELS`` at most, and no more than that waiting over all sizes): ``add`` a pair under a tag, and
    take each tag's figure, the mean over its frames, from what ``add`` or ``flush`` return once all its frames are
    done."""

    def __init__(self, model: Lpips, batch_pixels: int = BATCH_PIXELS):
        self.model, self.batch_pixels = model, batch_pixels
        self.waiting: dict[tuple, list] = defaultdict(list)  # frame shape -> [(tag, frame a, frame b)]
        self.sums: dict[Hashable, list] = {}  # tag -> [sum of its frames' figures, frames still to do, frames]

    def add(self, tag: Hashable, a: np.ndarray, b: np.ndarray) -> list[tuple[Hashable, float]]:
        """Queue the pair (images HxWx3 or videos FxHxWx3); the (tag, LPIPS) of the samples this completed."""
        _check(a, b)
        a, b = (a, b) if a.ndim == 4 else (a[None], b[None])
        self.sums[tag] = [0.0, len(a), len(a)]
        shape = a.shape[1:]
        self.waiting[shape] += [(tag, x, y) for x, y in zip(a, b)]
        per_batch = max(1, self.batch_pixels // (shape[0] * shape[1]))
        done = []
        while len(self.waiting[shape]) >= per_batch:
            done += self._run(shape, per_batch)
        if sum(len(v) * s[0] * s[1] for s, v in self.waiting.items()) > self.batch_pixels:
            done += self.flush()  # frames of many sizes, none a full batch: bound what waits
        return done

    def flush(self) -> list[tuple[Hashable, float]]:
        """Compute every frame still waiting; the (tag, LPIPS) of the samples this completed."""
        done = []
        for shape in list(self.waiting):
            while self.waiting[shape]:
                done += self._run(shape, max(1, self.batch_pixels // (shape[0] * shape[1])))
        return done

    def _run(self, shape: tuple, n: int) -> list[tuple[Hashable, float]]:
        batch, self.waiting[shape] = self.waiting[shape][:n], self.waiting[shape][n:]
        values = self.model.distances(np.stack([x for _, x, _ in batch]), np.stack([y for _, _, y in batch]))
        done = []
        for (tag, _, _), v in zip(batch, values.tolist()):
            s = self.sums[tag]
            s[0], s[1] = s[0] + v, s[1] - 1
            if s[1] == 0:
                done.append((tag, s[0] / s[2]))
                del self.sums[tag]
        return done


def load_lpips(backbone: str | Path, layers: str | Path, device: str | None = None,
               options: tuple[str, str] = ("--lpips-backbone", "--lpips-layers")) -> Lpips:
    """LPIPS with the weights of two local files: ``backbone``, torchvision's AlexNet state dict (its
    ``features.*`` tensors; ``classifier.*`` is ignored), ``layers``, lpips's v0.1 ``alex.pth``; on CUDA when there
    is one. LpipsWeightsError naming the file (by its option in ``options``) and what is wrong with it."""
    import torch

    weights = _checked_weights(str(backbone), str(layers), options, _stamp(backbone), _stamp(layers))
    return Lpips(weights, device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _stamp(path: str | Path) -> tuple | None:
    """A file's identity for the cache below (a file replaced since is read again); None when it cannot be read."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _checked_weights(backbone: str, layers: str, options: tuple[str, str], *stamps) -> dict:
    """The LPIPS tensors of the two files, checked; read once per process for a file unchanged since (the job
    checks them before anything is built, then the gate uses them; the AlexNet file is ~230 MB, its classifier
    unused)."""
    state, where = load_state(backbone, options[0]), f"{options[0]} {backbone}"
    alexnet = "torchvision's AlexNet state dict (alexnet-owt-7be5be79.pth)"
    weights = {}
    for i, (ci, co, k, _, _) in CONVS.items():
        weights[f"features.{i}.weight"] = _take(state, f"features.{i}.weight", (co, ci, k, k), where, alexnet)
        weights[f"features.{i}.bias"] = _take(state, f"features.{i}.bias", (co,), where, alexnet)
    state, where = load_state(layers, options[1]), f"{options[1]} {layers}"
    for n, (_, co, _, _, _) in enumerate(CONVS.values()):
        key = f"lin{n}.model.1.weight"
        weights[key] = _take(state, key, (1, co, 1, 1), where, "lpips's v0.1 alex.pth")
    return weights
