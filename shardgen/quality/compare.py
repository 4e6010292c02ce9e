"""A run against a reference run of the same plan, sample by sample: PSNR and SSIM of each sample both runs made,
and when asked (with weights the user gives) its LPIPS and the CLIP score of both runs' sample against its prompt.
Written into the run as ``compare.json``, a summary of a few kilobytes whatever the run's size (totals, median, mean,
worst and quantiles of the tail, the worst samples by PSNR; ``jobs.report`` shows it), and
``compare_samples.jsonl``, every sample's figures, one line each.

"The same plan" is checked per sample, not assumed: a sample is compared only when both runs made it from the same
prompt, seed and size; a key whose prompt or seed differs is a refusal (two different plans), and a sample one run
failed, rejected or has not made yet is counted as missing, not compared.
"""

from __future__ import annotations

import json
import logging
import math
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from shardgen.errors import UserError
from shardgen.quality.metrics import psnr, ssim, summarize

if TYPE_CHECKING:
    from shardgen.dataio.shards.signals import ClipScorer
    from shardgen.quality.lpips import Lpips, LpipsQueue

log = logging.getLogger("shardgen.quality")

SAME = ("prompt", "seed", "height", "width", "num_frames", "model")
"""What must agree between two samples of one key for their pixels to be comparable."""


class PlanMismatch(UserError, ValueError):
    """The two runs are not made from one plan: their samples cannot be compared."""


WORST_SAMPLES = 32
"""How many of the lowest-PSNR samples ``compare.json`` names."""

QUANTILES = (0.01, 0.05, 0.1, 0.25)
"""The low quantiles ``compare.json`` gives of PSNR and SSIM (the tail a lossy setting spoils)."""

HIGH_QUANTILES = (0.75, 0.9, 0.95, 0.99)
"""The high quantiles it gives of LPIPS, where higher is worse."""


@dataclass
class Comparison:
    """Per-sample figures, in ascending key order, and what could not be compared. ``lpips`` and the CLIP scores
    are None when not asked for; an LPIPS is NaN until its batch is computed (``set_lpips``), a CLIP score NaN for
    a sample without a prompt."""

    run: str
    reference: str
    keys: list[str] = field(default_factory=list)
    psnr: array = field(default_factory=lambda: array("d"))
    ssim: array = field(default_factory=lambda: array("d"))
    missing: int = 0
    damaged: dict[str, list[str]] = field(default_factory=dict)  # run name -> its shards that could not be read
    lpips: array | None = None
    clip_run: array | None = None
    clip_reference: array | None = None

    def add(self, key: str, psnr_db: float, ssim_value: float,
            clip: tuple[float, float] | None = None) -> int:
        """Record a compared sample (``clip``: its CLIP score in the run and in the reference); its index."""
        self.keys.append(key)
        self.psnr.append(psnr_db)
        self.ssim.append(ssim_value)
        if self.lpips is not None:
            self.lpips.append(math.nan)
        if self.clip_run is not None:
            run, reference = clip or (math.nan, math.nan)
            self.clip_run.append(run)
            self.clip_reference.append(reference)
        return len(self.keys) - 1

    def set_lpips(self, done: list[tuple[int, float]]) -> None:
        """Fill in the LPIPS of samples (index, value) whose batch was computed."""
        for i, value in done:
            self.lpips[i] = value

    def record(self, i: int) -> dict:
        """The ``i``-th compared sample's figures (a CLIP score it has none of is None)."""
        out = {"key": self.keys[i], "psnr": self.psnr[i], "ssim": self.ssim[i]}
        if self.lpips is not None:
            out["lpips"] = self.lpips[i]
        if self.clip_run is not None:
            out["clip_run"], out["clip_reference"] = _or_none(self.clip_run[i]), _or_none(self.clip_reference[i])
        return out

    @property
    def samples(self) -> dict[str, dict]:
        """key -> {"psnr", "ssim"[, "lpips"][, "clip_run", "clip_reference"]} of every compared sample."""
        return {k: {f: v for f, v in self.record(i).items() if f != "key"} for i, k in enumerate(self.keys)}

    def summary(self) -> dict:
        """Totals and each figure's median, mean, worst and tail quantiles; its size does not grow with the run."""
        out = {"run": self.run, "reference": self.reference, "compared": len(self.keys), "missing": self.missing,
               "psnr_db": _figure(self.psnr), "ssim": _figure(self.ssim)}
        if self.damaged:
            out["damaged_shards"] = self.damaged
        if self.lpips is not None:
            out["lpips"] = _figure(self.lpips, higher_is_worse=True)
        if self.clip_run is not None:
            out["clip_score"] = _clip_summary(self.clip_run, self.clip_reference)
        return out

    def worst(self, n: int = WORST_SAMPLES) -> list[dict]:
        """The ``n`` samples of lowest PSNR (then lowest SSIM, then key), worst first."""
        if not self.keys:
            return []
        order = np.lexsort((np.arange(len(self.keys)), np.asarray(self.ssim), np.asarray(self.psnr)))[:n]
        return [self.record(i) for i in order.tolist()]

    def to_json(self, samples_file: str | None = None) -> dict:
        """``compare.json``: the summary, the worst samples and the name of the file with every sample's figures."""
        return dict(self.summary(), worst_samples=self.worst(), samples_file=samples_file)

    def sample_lines(self) -> Iterable[bytes]:
        """``compare_samples.jsonl`` (``RunDir.compare_samples_path``): a JSON object per compared sample, in key
        order."""
        for i in range(len(self.keys)):
            yield (json.dumps(self.record(i)) + "\n").encode()

    def line(self) -> str:
        """One line a user reads: median and worst of each figure."""
        s = self.summary()
        damaged = "".join(f"; damaged shards not read in {name}: {', '.join(shards)} (jobs.verify {name} names them)"
                          for name, shards in self.damaged.items())
        if not s["compared"]:
            return (f"no sample in common with {self.reference} ({self.missing} missing in one run or the other)"
                    + damaged)
        p, q = s["psnr_db"], s["ssim"]
        text = (f"{s['compared']} samples compared with {self.reference}: PSNR median {_db(p['median'])} dB, worst "
                f"{_db(p['worst'])} dB; SSIM median {q['median']:.4f}, worst {q['worst']:.4f}")
        if "lpips" in s:
            text += f"; LPIPS median {s['lpips']['median']:.3g}, worst {s['lpips']['worst']:.3g}"  # 0 up to ~1
        if s.get("clip_score", {}).get("n"):
            c = s["clip_score"]
            text += f"; CLIP score {c['run']:.1f} vs {c['reference']:.1f} (reference)"
        return text + (f"; {self.missing} not in both runs" if self.missing else "") + damaged


def _figure(values: array, higher_is_worse: bool = False) -> dict:
    out = summarize(values, worst=max if higher_is_worse else min)
    if values:
        levels, method = (HIGH_QUANTILES, "higher") if higher_is_worse else (QUANTILES, "lower")
        qs = np.quantile(np.asarray(values), levels, method=method)  # a sample's own value (inf: identical)
        out["quantiles"] = {f"{q:g}": float(v) for q, v in zip(levels, qs)}
    return out


def _clip_summary(run: array, reference: array) -> dict:
    """The mean CLIP score of each run over the samples scored in both, and the run's score minus the
    reference's per sample (worst: the lowest, where the run's sample matches its prompt least next to the
    reference's)."""
    pairs = [(a, b) for a, b in zip(run, reference) if not (math.isnan(a) or math.isnan(b))]
    return {"n": len(pairs), "run": float(np.mean([a for a, _ in pairs])) if pairs else None,
            "reference": float(np.mean([b for _, b in pairs])) if pairs else None,
            "delta": _figure(array("d", [a - b for a, b in pairs]))}


def _or_none(x: float) -> float | None:
    return None if math.isnan(x) else x


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
                    reference_name: str = "reference", lpips: Lpips | None = None,
                    clip: ClipScorer | None = None) -> Comparison:
    """Compare two streams of (key, members) in ascending key order (as a run's committed shards give them), one
    sample of each in memory at a time (with ``lpips``, a batch of frames: ``LpipsQueue``); PlanMismatch on a key
    made from another prompt, seed or size. ``clip``: score both runs' sample against its prompt too."""
    from shardgen.quality.lpips import LpipsQueue

    out = Comparison(run_name, reference_name, lpips=array("d") if lpips is not None else None,
                     clip_run=array("d") if clip is not None else None,
                     clip_reference=array("d") if clip is not None else None)
    queue = LpipsQueue(lpips) if lpips is not None else None
    a, b = _ascending(run, run_name), _ascending(reference, reference_name)
    x, y = next(a, None), next(b, None)
    while x is not None or y is not None:
        if y is None or (x is not None and x[0] < y[0]):  # only in the run
            out.missing, x = out.missing + 1, next(a, None)
        elif x is None or y[0] < x[0]:  # only in the reference
            out.missing, y = out.missing + 1, next(b, None)
        else:
            pair = _pair(x[0], x[1], y[1], run_name, reference_name)
            if pair is None:
                out.missing += 1
            else:
                _measure(out, x[0], *pair, queue, clip, (run_name, reference_name))
            x, y = next(a, None), next(b, None)
    if queue is not None:
        out.set_lpips(queue.flush())
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


def _pair(key: str, mem: dict, ref: dict, run_name: str,
          reference_name: str) -> tuple[np.ndarray, np.ndarray, str | None] | None:
    """The sample's pixels in both runs and its prompt, checked to come from one plan; None when one does not
    decode."""
    a, b = _meta(mem), _meta(ref)
    for k in SAME:
        if a.get(k) != b.get(k):
            raise PlanMismatch(f"sample {key} was made with {k}={a.get(k)!r} in {run_name} and {b.get(k)!r} in "
                               f"{reference_name}: compare two runs of one prompt file, seed and size")
    x, y = decode(key, mem), decode(key, ref)
    if x is None or y is None:
        return None
    prompt = a.get("prompt")
    return x, y, prompt if isinstance(prompt, str) and prompt else None


def _measure(out: Comparison, key: str, x: np.ndarray, y: np.ndarray, prompt: str | None, queue: LpipsQueue | None,
             clip: ClipScorer | None, names: tuple[str, str]) -> None:
    """Add the sample's figures to ``out`` (its LPIPS once its batch is computed)."""
    try:
        figures = psnr(x, y), ssim(x, y)
    except ValueError as e:  # pixels of other sizes than their json says
        raise PlanMismatch(f"sample {key}: {e} ({names[0]} against {names[1]})") from None
    scores = (clip(x, prompt), clip(y, prompt)) if clip is not None and prompt is not None else None
    i = out.add(key, *figures, clip=scores)
    if queue is not None:
        try:
            out.set_lpips(queue.add(i, x, y))
        except ValueError as e:  # too small for AlexNet's stack
            raise UserError(f"sample {key}: {e}; compare this run without LPIPS") from None


def compare_runs(run: Any, reference: Any, lpips: Lpips | None = None, clip: ClipScorer | None = None) -> Comparison:
    """Compare two runs (``RunDir``s) over every committed sample of both, a shard of each read at a time; each is
    named as its messages name it (a bucket run by its URL). ``lpips``, ``clip``: those figures too."""
    from shardgen.tools.runfiles import committed_shard_members

    damaged: tuple[dict, dict] = ({}, {})  # filled as the shards are read: a damaged one is named, not passed over
    members = [((key, mem) for _, key, mem in committed_shard_members(r, d)) for r, d in zip((run, reference), damaged)]
    out = compare_samples(*members, run.name, reference.name, lpips, clip)
    out.damaged = {r.name: [f"{shard:06d}" for shard in sorted(d)] for r, d in zip((run, reference), damaged) if d}
    return out
