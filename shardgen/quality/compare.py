"""A run against a reference run of the same plan, sample by sample: PSNR and SSIM of each sample both runs made.
Written into the run as ``compare.json``, a summary of a few kilobytes whatever the run's size (totals, median, mean,
worst and low quantiles, the worst samples by PSNR; ``jobs.report`` shows it), and ``compare_samples.jsonl``, every
sample's figures, one line each.

"The same plan" is checked per sample, not assumed: a sample is compared only when both runs made it from the same
prompt, seed and size; a key whose prompt or seed differs is a refusal (two different plans), and a sample one run
failed, rejected or has not made yet is counted as missing, not compared.
"""

from __future__ import annotations

import json
import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from shardgen.errors import UserError
from shardgen.quality.metrics import psnr, ssim, summarize

log = logging.getLogger("shardgen.quality")

SAME = ("prompt", "seed", "height", "width", "num_frames", "model")
"""What must agree between two samples of one key for their pixels to be comparable."""


class PlanMismatch(UserError, ValueError):
    """The two runs are not made from one plan: their samples cannot be compared."""


WORST_SAMPLES = 32
"""How many of the lowest-PSNR samples ``compare.json`` names."""

QUANTILES = (0.01, 0.05, 0.1, 0.25)
"""The low quantiles ``compare.json`` gives of each figure (the tail a lossy setting spoils)."""


@dataclass
class Comparison:
    """Per-sample figures, in ascending key order, and what could not be compared."""

    run: str
    reference: str
    keys: list[str] = field(default_factory=list)
    psnr: array = field(default_factory=lambda: array("d"))
    ssim: array = field(default_factory=lambda: array("d"))
    missing: int = 0

    def add(self, key: str, psnr_db: float, ssim_value: float) -> None:
        self.keys.append(key)
        self.psnr.append(psnr_db)
        self.ssim.append(ssim_value)

    @property
    def samples(self) -> dict[str, dict]:
        """key -> {"psnr", "ssim"} of every compared sample."""
        return {k: {"psnr": p, "ssim": s} for k, p, s in zip(self.keys, self.psnr, self.ssim)}

    def summary(self) -> dict:
        """Totals and each figure's median, mean, worst and low quantiles; its size does not grow with the run."""
        return {"run": self.run, "reference": self.reference, "compared": len(self.keys), "missing": self.missing,
                "psnr_db": _figure(self.psnr), "ssim": _figure(self.ssim)}

    def worst(self, n: int = WORST_SAMPLES) -> list[dict]:
        """The ``n`` samples of lowest PSNR (then lowest SSIM, then key), worst first."""
        if not self.keys:
            return []
        order = np.lexsort((np.arange(len(self.keys)), np.asarray(self.ssim), np.asarray(self.psnr)))[:n]
        return [{"key": self.keys[i], "psnr": self.psnr[i], "ssim": self.ssim[i]} for i in order.tolist()]

    def to_json(self, samples_file: str | None = None) -> dict:
        """``compare.json``: the summary, the worst samples and the name of the file with every sample's figures."""
        return dict(self.summary(), worst_samples=self.worst(), samples_file=samples_file)

    def sample_lines(self) -> Iterable[bytes]:
        """``compare_samples.jsonl`` (``RunDir.compare_samples_path``): a JSON object per compared sample, in key
        order."""
        for k, p, s in zip(self.keys, self.psnr, self.ssim):
            yield (json.dumps({"key": k, "psnr": p, "ssim": s}) + "\n").encode()

    def line(self) -> str:
        """One line a user reads: median and worst of each figure."""
        s = self.summary()
        if not s["compared"]:
            return f"no sample in common with {self.reference} ({self.missing} missing in one run or the other)"
        p, q = s["psnr_db"], s["ssim"]
        return (f"{s['compared']} samples compared with {self.reference}: PSNR median {_db(p['median'])} dB, worst "
                f"{_db(p['worst'])} dB; SSIM median {q['median']:.4f}, worst {q['worst']:.4f}"
                + (f"; {self.missing} not in both runs" if self.missing else ""))


def _figure(values: array) -> dict:
    out = summarize(values)
    if values:
        qs = np.quantile(np.asarray(values), QUANTILES, method="lower")  # a sample's own value (inf: identical)
        out["quantiles"] = {f"{q:g}": float(v) for q, v in zip(QUANTILES, qs)}
    return out


def _db(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2f}"


def decode(key: str, members: dict[str, bytes]) -> np.ndarray | None:
    """The sample's pixels (HxWx3, or FxHxWx3 for a video) as uint8, or None for a sample with no media (failed,
    rejected) or media that does not decode (counted as missing: ``jobs.verify`` names a damaged shard). Images
    open only in the raster formats shardgen writes (shardgen/rasters.py)."""
    from shardgen.dataio.shards import decode_video
    from shardgen.rasters import NotARaster, decode_rgb

    img = next(((k, v) for k, v in members.items() if k in ("png", "jpg", "jpeg", "webp")), None)
    try:
        if img is not None:
            return decode_rgb(img[1], f"sample {key}'s {img[0]}")
        if "mp4" in members:
            return decode_video(members["mp4"])[0]
    except (NotARaster, OSError, ValueError) as e:
        log.warning("sample %s: its media does not decode (%s); not compared", key, e)
    return None


def _meta(members: dict[str, bytes]) -> dict:
    try:
        meta = json.loads(members.get("json", b"{}"))
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def compare_samples(run: Iterable[tuple[str, dict]], reference: Iterable[tuple[str, dict]], run_name: str = "run",
                    reference_name: str = "reference") -> Comparison:
    """Compare two streams of (key, members) in ascending key order (as a run's committed shards give them), one
    sample of each in memory at a time; PlanMismatch on a key made from another prompt, seed or size."""
    out = Comparison(run_name, reference_name)
    a, b = _ascending(run, run_name), _ascending(reference, reference_name)
    x, y = next(a, None), next(b, None)
    while x is not None or y is not None:
        if y is None or (x is not None and x[0] < y[0]):  # only in the run
            out.missing, x = out.missing + 1, next(a, None)
        elif x is None or y[0] < x[0]:  # only in the reference
            out.missing, y = out.missing + 1, next(b, None)
        else:
            figures = _compare_one(x[0], x[1], y[1], run_name, reference_name)
            if figures is None:
                out.missing += 1
            else:
                out.add(x[0], *figures)
            x, y = next(a, None), next(b, None)
    return out


def _ascending(stream: Iterable[tuple[str, dict]], name: str):
    """``stream`` as given, checked to be in ascending key order (the merge above relies on it)."""
    last = None
    for key, members in stream:
        if last is not None and key <= last:
            raise PlanMismatch(f"{name}: sample {key} comes after {last}; its shards are not in sample order "
                               f"(run python -m jobs.verify {name})")
        last = key
        yield key, members


def _compare_one(key: str, mem: dict, ref: dict, run_name: str, reference_name: str) -> tuple[float, float] | None:
    a, b = _meta(mem), _meta(ref)
    for k in SAME:
        if a.get(k) != b.get(k):
            raise PlanMismatch(f"sample {key} was made with {k}={a.get(k)!r} in {run_name} and {b.get(k)!r} in "
                               f"{reference_name}: compare two runs of one prompt file, seed and size")
    x, y = decode(key, mem), decode(key, ref)
    if x is None or y is None:
        return None
    try:
        return psnr(x, y), ssim(x, y)
    except ValueError as e:  # pixels of other sizes than their json says
        raise PlanMismatch(f"sample {key}: {e} ({run_name} against {reference_name})") from None


def compare_runs(run: Any, reference: Any) -> Comparison:
    """Compare two runs (``RunDir``s) over every committed sample of both, a shard of each read at a time; each is
    named as its messages name it (a bucket run by its URL)."""
    from shardgen.tools.runfiles import committed_members

    return compare_samples(committed_members(run), committed_members(reference), run.name, reference.name)
