"""The in-job quality gate (``calibrate_samples``): before a lossy run spends its GPU hours, its first prompts are
made losslessly and lossily, compared (PSNR, SSIM), and the run goes on, stops in one line, or goes on losslessly
(``calibrate_fallback``) as the bounds say. The figures join every sample's provenance and
``RUN_DIR/calibration.json``.

The lossless samples come first, while the weights are still the lossless ones: fp8 converts the transformer in
place, so the lossy pass needs no second copy of the model. Every rank of a replica runs the same rows in the same
order (model-parallel ranks compute together) and reaches the same verdict from the same pixels. The lossless
samples are not committed; the lossy ones are the run's own when it goes on with their settings, and a one-rank
replica whose first batches are those rows commits them instead of making them again (2N samples of extra work,
N on the replica that takes them). The replicas of one job (one torch.distributed world) split the rows, each
making every k-th row both ways, and judge the figures of all of them alike: a job's first launch costs each of its
k replicas 2N/k samples, not 2N. A later launch of the run (a requeue, a resume) for which the passed
verdict still holds (``made_for``: the same settings, rows, strategy, bounds, GPU model and code) takes it from
calibration.json instead of calibrating again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any, Callable

from shardgen.errors import UserError
from shardgen.pick import pick
from shardgen.quality.metrics import psnr, ssim, summarize

log = logging.getLogger("shardgen.quality")

FALLBACKS = ("stop", "lossless")
CONFIG_KEYS = {"sdpa": "sdpa_backend"}  # a lossy option's config key where it differs from its AccelOptions field


class CalibrationFailed(UserError, RuntimeError):
    """The lossy setting's calibration samples are below a bound and ``calibrate_fallback=stop``; ``record``: the
    figures (written into the run before the job ends)."""

    record: dict | None = None


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The gate's settings (QualityConfig's keys)."""

    calibrate_samples: int = 0
    calibrate_min_psnr: float = 0.0
    calibrate_min_ssim: float = 0.0
    calibrate_max_lpips: float = 0.0
    calibrate_lpips_backbone: str | None = None
    calibrate_lpips_layers: str | None = None
    calibrate_fallback: str = "stop"

    @property
    def lpips(self) -> bool:
        """Whether the calibration measures LPIPS (both weight files given)."""
        return bool(self.calibrate_lpips_backbone and self.calibrate_lpips_layers)


LPIPS_OPTIONS = ("calibrate_lpips_backbone", "calibrate_lpips_layers")


def load_gate_lpips(bounds: Bounds, device: str | None = None):
    """The LPIPS model of the gate's weight files (None without them); LpipsWeightsError naming the config key and
    the file when one cannot be used."""
    if not bounds.lpips:
        return None
    from shardgen.quality.lpips import load_lpips

    return load_lpips(bounds.calibrate_lpips_backbone, bounds.calibrate_lpips_layers, device, options=LPIPS_OPTIONS)


def lossless(accel: Any) -> Any:
    """``accel`` (AccelOptions) with every lossy option at its default (off)."""
    defaults = {f.name: f.default for f in dataclasses.fields(accel)}
    return dataclasses.replace(accel, **{name: defaults[name] for name in accel.lossy})


def first_rows(plan: Any, n: int) -> list:
    """The plan's first ``n`` rows that are made (no rejected row), from shard 0 on."""
    from shardgen.dataio.resume import checked_rows

    rows = []
    for shard in range(plan.num_shards):
        rows += [r for r in checked_rows(plan, shard) if r.reject is None]
        if len(rows) >= n:
            break
    return rows[:n]


def _eager(settings: Any) -> Any:
    """``settings`` with the transformer's blocks not compiled."""
    return dataclasses.replace(settings, accel=dataclasses.replace(settings.accel, compile=False))


def _batches(pipe: Any, settings: Any, rows: list, ranks: int) -> list[tuple[tuple, list, float]]:
    """The rows made with ``settings`` a batch at a time: (the batch's row indices, its samples, the seconds it
    took) each."""
    import time

    from shardgen.run.generation import generate_batch

    out = []
    for a in range(0, len(rows), settings.batch_size):
        t0 = time.perf_counter()
        batch = rows[a:a + settings.batch_size]
        samples = generate_batch(pipe, settings, batch, ranks)
        out.append((tuple(r.index for r in batch), samples, time.perf_counter() - t0))
    return out


def _pixels(batches: list[tuple[tuple, list, float]]) -> dict[int, Any]:
    """Row index -> pixels of the samples made (failed samples left out)."""
    return {smp.index: smp.pixels for _, samples, _ in batches for smp in samples if smp.pixels is not None}


def verdict(figures: dict, bounds: Bounds) -> list[str]:
    """The bounds the worst sample misses, as phrases (empty: it passes)."""
    if not figures["psnr_db"]["n"]:
        return ["no calibration sample could be made both ways"]
    missed = []
    if bounds.calibrate_min_psnr and figures["psnr_db"]["worst"] < bounds.calibrate_min_psnr:
        missed.append(f"PSNR {figures['psnr_db']['worst']:.2f} dB < calibrate_min_psnr={bounds.calibrate_min_psnr:g}")
    if bounds.calibrate_min_ssim and figures["ssim"]["worst"] < bounds.calibrate_min_ssim:
        missed.append(f"SSIM {figures['ssim']['worst']:.4f} < calibrate_min_ssim={bounds.calibrate_min_ssim:g}")
    lpips = figures.get("lpips")
    if bounds.calibrate_max_lpips and lpips and lpips["worst"] > bounds.calibrate_max_lpips:
        missed.append(f"LPIPS {lpips['worst']:.3g} > calibrate_max_lpips={bounds.calibrate_max_lpips:g}")
    return missed


def record_bytes(record: dict) -> bytes:
    """The calibration record as calibration.json's bytes: indented, keys sorted, and, as in jobs.compare's
    compare.json, identical samples' PSNR written as ``Infinity`` (Python's json reads it back as inf)."""
    return (json.dumps(record, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def provenance_summary(record: dict) -> dict:
    """The calibration record as each sample's provenance keeps it: without the per-sample figures, and in standard
    JSON (a sample's json is read by any tool): an infinite PSNR (identical samples) as the string "inf"."""
    def finite(x):
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        return "inf" if x == float("inf") else x

    return {k: finite(v) for k, v in record.items() if k not in ("per_sample", "made_for")}


RECORD_LIMIT = 64 << 20  # calibration.json and compare.json are summaries of a few kilobytes whatever the run
MADE_WITH = ("torch", "triton", "diffusers", "fa3-fwd", "sageattention")  # whose kernels make the samples


def read_fidelity_record(run: Any, path: Any, limit: int = RECORD_LIMIT, follow: bool = True) -> bytes | None:
    """A fidelity record's bytes (None: there is none): a bucket run's copy in the bucket (the gate and jobs.compare
    put theirs there, so any machine reads them), else the file in the run's folder on this machine (a regular file
    only; ``follow=False``: not through a symlink). OSError or RunDirError when it cannot be read."""
    from shardgen.dataio.rundir.fileio import read_regular

    if run.store and (data := run.files.read(path, limit=limit)) is not None:
        return data
    if not path.exists() and not path.is_symlink():
        return None
    return read_regular(path, limit=limit, follow=follow)


def made_for(plan: Any, pipe: Any, settings: Any, ranks: int, bounds: Bounds) -> dict:
    """What a calibration's verdict holds for: the run's pixel settings (a hash of its fingerprint: model, weights,
    sizes, steps, the lossy settings), the rows compared, the strategy and the replica's ranks (a tp rank quantises
    its own shard of each layer), the gate's bounds and weight files, the GPU model, and the code that made the
    samples (the kernels' package versions, a hash of shardgen's own sources). A later launch for which all of them
    are the same takes the verdict (``earlier_verdict``)."""
    import hashlib
    from importlib import metadata

    from shardgen.dataio.resume.fingerprint import read_fingerprint

    fingerprint = json.dumps(read_fingerprint(plan.run), sort_keys=True, default=str).encode()
    versions = {}
    for name in MADE_WITH:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    gate = {k: v for k, v in dataclasses.asdict(bounds).items() if k != "calibrate_fallback"}
    rows = first_rows(plan, bounds.calibrate_samples)
    return {"run": hashlib.sha256(fingerprint).hexdigest(), "rows": [r.index for r in rows], "gate": gate,
            "strategy": settings.strategy, "ranks": ranks, "device": _device_name(pipe),
            "versions": versions | {"shardgen": _sources_sha256()}}


@functools.cache
def _sources_sha256() -> str:
    """A hash of shardgen's and its parallel package's Python sources (its kernels and blocks are among them): a
    code change between launches is a change of what made the samples, whatever the package version says."""
    import hashlib

    import parallel
    import shardgen

    digest = hashlib.sha256()
    for package in (shardgen, parallel):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _device_name(pipe: Any) -> str:
    """The GPU model the pipeline runs on ("NVIDIA H100 80GB HBM3"), else its device type ("cpu")."""
    import torch

    device = getattr(pipe, "device", None)
    if getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_name(device)
    return str(getattr(device, "type", device))


def earlier_verdict(plan: Any, settings: Any, now: dict) -> dict | None:
    """The calibration record an earlier launch of this run left in RUN_DIR/calibration.json, when it passed and
    holds for this launch (the same lossy settings, and ``now``, this launch's ``made_for``): a requeued or resumed
    launch takes it instead of calibrating again. None when there is none, it did not pass, it was made for
    something else (another GPU model, other code or bounds), or it cannot be read: the launch then calibrates and
    writes its own (the log says why)."""
    record, why, damaged = _passed_record(plan.run, settings.accel.lossy)
    if record is not None and record.get("made_for") != now:
        record, why = None, f"{plan.run.calibration_path} was made for other settings, rows, bounds, GPU or code"
    if why:
        log.log(logging.WARNING if damaged else logging.INFO, "calibration: %s; calibrating again", why)
    return record


def _passed_record(run: Any, lossy: dict) -> tuple[dict | None, str | None, bool]:
    """(the run's calibration record, None, False) when it passed with ``lossy``; else (None, why it is not taken,
    whether the file is damaged); (None, None, False) where the run has none."""
    path = run.calibration_path
    try:
        data = read_fidelity_record(run, path, follow=False)  # a link is not this run's verdict
        record = None if data is None else json.loads(data)
    except (OSError, UserError, ValueError, RecursionError) as e:
        return None, f"{path} cannot be read ({e})", True
    if record is None:
        return None, None, False
    if not isinstance(record, dict) or not isinstance(record.get("passed"), bool) or not _figures(record) \
            or not isinstance(record.get("made_for"), dict):
        return None, f"{path} is not a calibration record", True
    if not record["passed"]:
        return None, "the earlier launch's did not pass", False
    if record.get("lossy") != json.loads(json.dumps(lossy)):
        return None, f"{path} is of other lossy settings ({record.get('lossy')})", False
    return record, None, False


def _figures(record: dict) -> bool:
    """Whether ``record`` has the worst PSNR and SSIM as numbers (a record that lacks them is no verdict)."""
    try:
        return all(isinstance(record[k]["worst"], (int, float)) for k in ("psnr_db", "ssim"))
    except (KeyError, TypeError):
        return False


def preview(cfg: Any, run: Any, settings: Any) -> str | None:
    """What the gate would do at a launch, as ``dry_run=true`` says it (None: no calibration asked, or nothing
    lossy): calibrate, or take the earlier launch's passed verdict where it holds. Reads only."""
    if not calibrates(cfg, settings):
        return None
    bounds, lossy = pick(Bounds, cfg), settings.accel.lossy
    limits = [f"PSNR >= {bounds.calibrate_min_psnr:g} dB" if bounds.calibrate_min_psnr else "",
              f"SSIM >= {bounds.calibrate_min_ssim:g}" if bounds.calibrate_min_ssim else "",
              f"LPIPS <= {bounds.calibrate_max_lpips:g}" if bounds.calibrate_max_lpips else ""]
    limits = ", ".join(filter(None, limits)) or "none (the figures are recorded)"
    make = (f"{bounds.calibrate_samples} samples made losslessly and with {lossy} before the run (the replicas of "
            f"one job split them); bounds {limits}; below one: {bounds.calibrate_fallback}")
    record, _, _ = _passed_record(run, lossy)
    if record is None:
        return make
    return (f"the earlier launch's calibration passed (PSNR worst {_db(record['psnr_db']['worst'])} dB on "
            f"{record['made_for'].get('device')}): a launch on that GPU model with the same bounds and package "
            f"versions takes it; otherwise {make}")


def calibrates(cfg: Any, settings: Any) -> bool:
    """Whether a run of ``cfg`` with ``settings`` calibrates: samples asked for, and a lossy setting on."""
    return pick(Bounds, cfg).calibrate_samples > 0 and bool(settings.accel.lossy)


def calibrate(cfg: Any, plan: Any, pipe: Any, settings: Any, ranks: int = 1, first_batch: Any = None,
              earlier: dict | None = None, now: dict | None = None, share: tuple[int, int] = (0, 1),
              gather: Callable[[Callable[[], Any]], list] | None = None) -> tuple[Any, dict | None, Any]:
    """(the settings the run goes on with, the calibration record or None when none was asked or nothing is
    lossy, the lossy samples as ``MadeAhead`` when the run goes on with them, else None). CalibrationFailed when a
    bound is missed and the fallback is ``stop``. ``first_batch``: the settings the
    run's first batch takes (``compile: auto``'s choice: often eager whatever ``settings.accel.compile`` says), which
    the lossy pass runs with; None: ``settings``. The lossless pass, made only to compare against, is always eager:
    compiling the lossless blocks (about a minute for FLUX.1-dev on an H100) costs more than a few samples win
    back. ``earlier``: an earlier launch's passed record that holds for this one (``earlier_verdict``), which the
    run goes on with, nothing made. ``now``: this launch's ``made_for``, which a new record keeps (None: worked out
    here). ``share``: (this replica's index, the replicas) among those that split the rows, each making every
    that-many-th row both ways, and ``gather`` the collective that runs a function on every rank and hands each
    the list of the results (``parallel.world.on_every_rank_then_gather``): every replica then judges all the
    rows' figures alike."""
    from shardgen.run.shardrun import MadeAhead
    from shardgen.speed import accel as A

    bounds = pick(Bounds, cfg)
    lossy = settings.accel.lossy
    if not calibrates(cfg, settings):
        return settings, None, None
    if earlier is not None:
        log.info("calibration of %s: the earlier launch's passed (PSNR worst %s dB, SSIM worst %s on %s); not made "
                 "again (remove RUN_DIR/calibration.json to calibrate again)", lossy,
                 _db(earlier["psnr_db"]["worst"]), _num(earlier["ssim"]["worst"]), earlier["made_for"]["device"])
        return settings, earlier, None
    rows = first_rows(plan, bounds.calibrate_samples)
    mine = rows[share[0]::share[1]]
    exact = dataclasses.replace(settings, accel=lossless(settings.accel))
    transformer = getattr(pipe, "transformer", None)
    if bounds.calibrate_fallback == "lossless" and settings.accel.fp8 and transformer is not None:
        A.make_reversible(transformer)  # to switch back if the gate says so
    if share[1] > 1:
        log.info("calibration: %d of its %d samples on this replica (the job's %d replicas split them), lossless, "
                 "then with %s", len(mine), len(rows), share[1], lossy)
    else:
        log.info("calibration: %d samples lossless, then with %s", len(rows), lossy)
    lossy_settings = dataclasses.replace(settings if first_batch is None else first_batch, latents=None)
    made_here: list = []

    def measure() -> dict:
        figures, batches = _measure(pipe, exact, lossy_settings, mine, ranks, load_gate_lpips(bounds))
        made_here.extend(batches)
        return figures

    shares = gather(measure) if gather is not None else [measure()]
    per_sample = {k: v for one in shares for k, v in one["per_sample"].items()}
    failed = sorted({i for one in shares for i in one["failed"]})
    made_losslessly = len({i for one in shares for i in one["lossless"]})  # a model-parallel replica's ranks: alike
    figures = {"psnr_db": summarize([s["psnr"] for s in per_sample.values()]),
               "ssim": summarize([s["ssim"] for s in per_sample.values()])}
    if bounds.lpips:
        figures["lpips"] = summarize([s["lpips"] for s in per_sample.values()], worst=max)
    missed = verdict(figures, bounds)
    # a sample the lossless pass made and the lossy one failed (non-finite pixels) is the worst miss there is
    if failed:
        missed.insert(0, f"{len(failed)} of the {made_losslessly} samples made losslessly failed with {lossy}")
    record = dict(figures, lossy=lossy, samples=len(rows), per_sample=per_sample,
                  made_for=now if now is not None else made_for(plan, pipe, settings, ranks, bounds),
                  **({"failed_lossy": [str(i) for i in failed]} if failed else {}),
                  bounds={"min_psnr": bounds.calibrate_min_psnr, "min_ssim": bounds.calibrate_min_ssim,
                          **({"max_lpips": bounds.calibrate_max_lpips} if bounds.lpips else {})},
                  passed=not missed, action="continue" if not missed else bounds.calibrate_fallback)
    line = (f"calibration of {lossy} over {len(per_sample)} samples against lossless: PSNR median "
            f"{_db(figures['psnr_db']['median'])} dB, worst {_db(figures['psnr_db']['worst'])} dB; SSIM median "
            f"{_num(figures['ssim']['median'])}, worst {_num(figures['ssim']['worst'])}")
    if "lpips" in figures:
        line += f"; LPIPS median {figures['lpips']['median']:.3g}, worst {figures['lpips']['worst']:.3g}"
    if not missed:
        log.info("%s: passed", line)
        # a replica's share of the rows is not a batch the run makes (every share-th row): made again there
        if share[1] > 1:
            return settings, record, None
        return settings, record, MadeAhead(lossy_settings, {key: (smps, secs) for key, smps, secs in made_here})
    if bounds.calibrate_fallback == "stop":
        err = CalibrationFailed(f"{line}: {'; '.join(missed)}. Nothing was made. Turn the lossy setting off "
                                f"({', '.join(CONFIG_KEYS.get(k, k) for k in lossy)}), lower the bound, or set "
                                "calibrate_fallback=lossless")
        err.record = record
        raise err
    log.warning("%s: %s; the run goes on lossless", line, "; ".join(missed))
    A.prepare(pipe, exact.accel)  # fp8 switched back to the bf16 layers kept on the CPU
    return exact, record, None


def _measure(pipe: Any, exact: Any, lossy_settings: Any, rows: list, ranks: int,
             lpips: Any) -> tuple[dict, list]:
    """``rows`` made losslessly (eager), then with ``lossy_settings``, and compared: ({"per_sample": row -> its
    figures, "failed": the rows made losslessly whose lossy sample failed, "lossless": the rows made losslessly},
    the lossy batches as ``_batches`` gives them)."""
    # neither pass resumes from, nor leaves, mid-sample latent checkpoints: they are named by rows alone, so one of
    # a pass stopped half-way would feed the other pass's samples
    reference = _pixels(_batches(pipe, dataclasses.replace(_eager(exact), latents=None), rows, ranks))
    lossy_batches = _batches(pipe, lossy_settings, rows, ranks)
    made = _pixels(lossy_batches)
    per_sample = {str(i): {"psnr": psnr(made[i], reference[i]), "ssim": ssim(made[i], reference[i])}
                  for i in sorted(set(reference) & set(made))}
    if lpips is not None:
        for i, figures in per_sample.items():
            figures["lpips"] = lpips(made[int(i)], reference[int(i)])
    return ({"per_sample": per_sample, "failed": sorted(set(reference) - set(made)), "lossless": sorted(reference)},
            lossy_batches)


def _db(x: float | None) -> str:
    return "n/a" if x is None else ("inf" if x == float("inf") else f"{x:.2f}")


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"
