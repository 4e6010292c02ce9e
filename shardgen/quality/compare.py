"""A run against a reference run of the same plan, sample by sample: PSNR and SSIM of each sample both runs made,
their median and worst, written into the run as ``compare.json`` (``jobs.report`` shows it).

"The same plan" is checked per sample, not assumed: a sample is compared only when both runs made it from the same
prompt, seed and size; a key whose prompt or seed differs is a refusal (two different plans), and a sample one run
failed, rejected or has not made yet is counted as missing, not compared.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from shardgen.errors import UserError
from shardgen.quality.metrics import psnr, ssim, summarize

SAME = ("prompt", "seed", "height", "width", "num_frames", "model")
"""What must agree between two samples of one key for their pixels to be comparable."""


class PlanMismatch(UserError, ValueError):
    """The two runs are not made from one plan: their samples cannot be compared."""


@dataclass
class Comparison:
    """Per-sample figures (key -> {"psnr", "ssim"}) and what could not be compared."""

    run: str
    reference: str
    samples: dict[str, dict] = field(default_factory=dict)
    missing: int = 0

    def summary(self) -> dict:
        return {"run": self.run, "reference": self.reference, "compared": len(self.samples), "missing": self.missing,
                "psnr_db": summarize([s["psnr"] for s in self.samples.values()]),
                "ssim": summarize([s["ssim"] for s in self.samples.values()])}

    def to_json(self) -> dict:
        return dict(self.summary(), samples=self.samples)

    def line(self) -> str:
        """One line a user reads: median and worst of each figure."""
        s = self.summary()
        if not s["compared"]:
            return f"no sample in common with {self.reference} ({self.missing} missing in one run or the other)"
        p, q = s["psnr_db"], s["ssim"]
        return (f"{s['compared']} samples compared with {self.reference}: PSNR median {_db(p['median'])} dB, worst "
                f"{_db(p['worst'])} dB; SSIM median {q['median']:.4f}, worst {q['worst']:.4f}"
                + (f"; {self.missing} not in both runs" if self.missing else ""))


def _db(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2f}"


def decode(members: dict[str, bytes]) -> np.ndarray | None:
    """The sample's pixels (HxWx3, or FxHxWx3 for a video) as uint8, or None for a sample with no media (failed,
    rejected)."""
    from PIL import Image

    from shardgen.dataio.shards import decode_video

    img = next((v for k, v in members.items() if k in ("png", "jpg", "jpeg", "webp")), None)
    if img is not None:
        with Image.open(io.BytesIO(img)) as im:
            return np.asarray(im.convert("RGB"))
    if "mp4" in members:
        return decode_video(members["mp4"])[0]
    return None


def _meta(members: dict[str, bytes]) -> dict:
    try:
        meta = json.loads(members.get("json", b"{}"))
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def compare_samples(run: Iterable[tuple[str, dict]], reference: dict[str, dict], run_name: str = "run",
                    reference_name: str = "reference") -> Comparison:
    """Compare ``run``'s (key, members) with ``reference``'s {key: members}; PlanMismatch on a key made from another
    prompt, seed or size."""
    out = Comparison(run_name, reference_name)
    seen = set()
    for key, mem in run:
        seen.add(key)
        ref = reference.get(key)
        if ref is None:
            out.missing += 1
            continue
        a, b = _meta(mem), _meta(ref)
        for k in SAME:
            if a.get(k) != b.get(k):
                raise PlanMismatch(f"sample {key} was made with {k}={a.get(k)!r} in {run_name} and {b.get(k)!r} in "
                                   f"{reference_name}: compare two runs of one prompt file, seed and size")
        x, y = decode(mem), decode(ref)
        if x is None or y is None:
            out.missing += 1
            continue
        out.samples[key] = {"psnr": psnr(x, y), "ssim": ssim(x, y)}
    out.missing += sum(1 for k in reference if k not in seen)
    return out


def compare_runs(run: Any, reference: Any) -> Comparison:
    """Compare two runs (``RunDir``s) over every committed sample of both."""
    from shardgen.tools.runfiles import committed_members

    ref = dict(committed_members(reference))
    return compare_samples(committed_members(run), ref, str(run.root), str(reference.root))
