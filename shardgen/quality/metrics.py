"""PSNR and SSIM of 8-bit RGB images (HxWx3) or videos (FxHxWx3, the mean over frames).

SSIM is Wang et al. (2004) as scikit-image computes it with ``gaussian_weights=True, sigma=1.5,
use_sample_covariance=False, data_range=255, channel_axis=-1``: an 11x11 Gaussian window, the mean over the pixels
whose window lies inside the image and over the channels. The window is separable, so each local mean is two
1-D passes; numpy only (no scipy or scikit-image at run time).
"""

from __future__ import annotations

import math

import numpy as np

SIGMA = 1.5
RADIUS = 5  # scikit-image's truncate=3.5: int(3.5 * 1.5 + 0.5)
C1, C2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 arrays of one shape; inf when they are equal."""
    _same_shape(a, b)
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def _window() -> np.ndarray:
    x = np.arange(-RADIUS, RADIUS + 1, dtype=np.float64)
    w = np.exp(-0.5 * (x / SIGMA) ** 2)
    return w / w.sum()


def _local_mean(x: np.ndarray) -> np.ndarray:
    """The Gaussian-weighted mean around each pixel whose window is inside the image (H-10 x W-10 x C)."""
    w = _window()
    n = 2 * RADIUS + 1
    rows = sum(w[k] * x[k:x.shape[0] - n + 1 + k] for k in range(n))
    return sum(w[k] * rows[:, k:x.shape[1] - n + 1 + k] for k in range(n))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Structural similarity in [-1, 1] of two uint8 HxWx3 images (or FxHxWx3 videos: the mean over frames)."""
    _same_shape(a, b)
    if a.ndim == 4:
        return float(np.mean([ssim(fa, fb) for fa, fb in zip(a, b)]))
    if min(a.shape[:2]) < 2 * RADIUS + 1:
        raise ValueError(f"SSIM needs images of at least {2 * RADIUS + 1}x{2 * RADIUS + 1} pixels, not "
                         f"{a.shape[0]}x{a.shape[1]}")
    x, y = a.astype(np.float64), b.astype(np.float64)
    ux, uy = _local_mean(x), _local_mean(y)
    vx = _local_mean(x * x) - ux * ux
    vy = _local_mean(y * y) - uy * uy
    vxy = _local_mean(x * y) - ux * uy
    s = ((2 * ux * uy + C1) * (2 * vxy + C2)) / ((ux * ux + uy * uy + C1) * (vx + vy + C2))
    return float(s.mean())


def _same_shape(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ValueError(f"cannot compare a {'x'.join(map(str, a.shape))} sample with a "
                         f"{'x'.join(map(str, b.shape))} one")


def summarize(values: list[float], worst=min) -> dict:
    """median, mean, worst and n of a figure over samples; ``worst`` picks it: ``min`` where lower is worse (PSNR,
    SSIM), ``max`` where higher is (LPIPS). PSNR's inf, identical samples, counts as 99 dB in the mean so one exact
    sample does not make it inf."""
    if not values:
        return {"n": 0, "median": None, "mean": None, "worst": None}
    finite = [min(v, 99.0) for v in values]
    return {"n": len(values), "median": float(np.median(values)), "mean": float(np.mean(finite)),
            "worst": float(worst(values))}
