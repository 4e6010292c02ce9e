"""A run's report as one self-contained HTML page (inline SVG charts, inline thumbnails).

Counts, throughput over time per replica of each launch (from ``logs/events.*.jsonl``; the shards' stats files
where a run has none), launches, failures by reason, truncation, signal histograms and a contact
sheet. Everything comes from the run directory: the plan, the parquet indexes, the stats, the
tars (only for the thumbnails). A committed shard whose files are not whole is named at the top of the page
(``damaged_shards``): the report shows what can be read, never a damaged run as a sound one.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from shardgen.dataio.prompts.plan import Plan
from shardgen.dataio.prompts.rowsettings import shape_label
from shardgen.dataio.resume.ledger import read_ledger, read_status_ledger
from shardgen.dataio.resume.repair import committed_shard_problem
from shardgen.dataio.rundir.fileio import map_io
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.shards.formats import OUTPUT_FORMATS, image_ext
from shardgen.dataio.shards.shardwork import committed_stats
from shardgen.quality.gate import RECORD_LIMIT, read_fidelity_record
from shardgen.tools.runfiles import (REPAIR_HINT, committed_shard_members, launch_label, launch_of, read_events,
                                     read_index_columns, read_launches, refuse_foreign_out, safe_write)

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
W, H, PAD = 560, 220, 40
REPORT_HEAD = "<!doctype html><html><head><meta charset='utf-8'><title>shardgen run "
"""How every page this tool writes begins: an existing --out that does not is someone's file (``check_report_out``)."""
_COLUMNS = ("key", "prompt", "status", "error", "truncated", "tokens", "gen_s", "phash", "watermark_ok", "clip_score",
            "width", "height")


def _index_rows(plan: Plan) -> dict[str, list]:
    """The index columns the report uses, over every committed shard, as lists."""
    return read_index_columns(plan.run, list(_COLUMNS))


def _throughput_series(plan: Plan) -> dict[str, list[tuple[float, int]]]:
    """A line per replica of each launch ("REPLICA on HOST pid PID job JOB") -> [(time, cumulative samples)] of its
    committed shards (two launches on one run each have a replica 0); by replica number, then by first commit."""
    events = read_events(plan.run)
    if not events:  # a run from before the events files: the stats have no replica
        events = [dict(t=s["finished"], replica="all", samples=s["count"]) for s in _stats(plan)
                  if isinstance(s.get("finished"), (int, float)) and isinstance(s.get("count"), int)]
    by_replica: dict[tuple, list] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["t"]):
        series = by_replica[(str(e["replica"]), launch_of(e))]
        series.append((e["t"], (series[-1][1] if series else 0) + e["samples"]))
    order = sorted(by_replica, key=lambda k: (k[0], by_replica[k][0][0]))
    return {" ".join(filter(None, (replica, launch_label(*launch)))): by_replica[(replica, launch)]
            for replica, launch in order}


def line_chart(series: dict[str, list[tuple[float, int]]], x_label: str, y_label: str) -> str:
    """An SVG chart: one polyline per series (x: seconds from the earliest point)."""
    points = [p for s in series.values() for p in s]
    if not points:
        return "<p>no committed shard yet</p>"
    t0 = min(t for t, _ in points)
    xmax = max(max(t for t, _ in points) - t0, 1e-9)
    ymax = max(max(v for _, v in points), 1)
    out = [_axes(f"{x_label} (0-{xmax:.0f} s)", f"{y_label} (0-{ymax})")]
    if not all(np.isfinite([t for t, _ in points] + [v for _, v in points])):
        return "<p>no usable times in the logs</p>"
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = [(PAD, H - PAD)] + [(PAD + (t - t0) / xmax * (W - 2 * PAD), H - PAD - v / ymax * (H - 2 * PAD))
                                     for t, v in pts]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                   + " ".join(f"{x:.1f},{y:.1f}" for x, y in coords) + '"/>')
        out.append(f'<text x="{W - PAD + 4}" y="{PAD + 14 * i}" fill="{color}" font-size="11">replica '
                   f'{html.escape(str(name))}</text>')  # from the run's logs: never markup
    return _svg(out)


def histogram(values: list[float], label: str, bins: int = 20) -> str:
    """An SVG histogram of ``values``."""
    vals = np.asarray([v for v in values if isinstance(v, (int, float))], dtype=float)
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        return "<p>no values</p>"
    counts, edges = np.histogram(vals, bins=bins)
    bar_w = (W - 2 * PAD) / bins
    top = max(counts.max(), 1)
    out = [_axes(f"{label} ({edges[0]:.3g} to {edges[-1]:.3g})", f"samples (max {top})")]
    for i, c in enumerate(counts):
        h = c / top * (H - 2 * PAD)
        out.append(f'<rect x="{PAD + i * bar_w:.1f}" y="{H - PAD - h:.1f}" width="{bar_w - 1:.1f}" height="{h:.1f}" '
                   f'fill="{COLORS[0]}"><title>{edges[i]:.3g}-{edges[i + 1]:.3g}: {c}</title></rect>')
    return _svg(out)


def _axes(x_label: str, y_label: str) -> str:
    return (f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#333"/>'
            f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>'
            f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="11">{html.escape(x_label)}</text>'
            f'<text x="12" y="{H / 2}" transform="rotate(-90 12 {H / 2})" text-anchor="middle" '
            f'font-size="11">{html.escape(y_label)}</text>')


def _svg(parts: list[str]) -> str:
    return f'<svg width="{W + 80}" height="{H}" xmlns="http://www.w3.org/2000/svg">' + "".join(parts) + "</svg>"


def _table(rows: list[tuple], head: tuple) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" + cells + "</table>"


def damaged_shards(plan: Plan) -> dict[int, str]:
    """shard -> why its committed files are not whole, over every committed shard. Cheap, as a launch checks them
    (the stats parse, the tar has the size they record, the index their rows): jobs.verify reads every byte."""
    done = sorted(plan.run.done_shards())
    problems = map_io(lambda shard: committed_shard_problem(plan.run, shard), done)
    return {shard: why for shard, why in zip(done, problems) if why is not None}


def contact_sheet(plan: Plan, n: int = 24, size: int = 160, damaged: dict[int, str] | None = None) -> str:
    """Thumbnails (inline JPEG) of the first ``n`` images with their keys and prompts; a shard file among those
    read that cannot be, or holds an image that does not decode, is added to ``damaged`` (shard -> why)."""
    from PIL import Image

    damaged = {} if damaged is None else damaged
    cells = []
    for shard, key, mem in committed_shard_members(plan.run, damaged):
        if len(cells) >= n:  # (an uploaded shard's tar is fetched from the bucket: no more than needed)
            break
        ext = image_ext(mem)
        if ext is not None:
            try:
                img = Image.fromarray(OUTPUT_FORMATS[ext].decode(mem[ext]))
            except Exception:  # no thumbnail; the shard is named (jobs.verify says more)
                damaged.setdefault(shard, f"{key}.{ext} does not decode as an image")
                continue
            img.thumbnail((size, size))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=85)
            data = base64.b64encode(buf.getvalue()).decode()
            prompt = html.escape(mem.get("txt", b"").decode("utf-8", "replace")[:90])
            cells.append(f'<figure><img src="data:image/jpeg;base64,{data}" width="{size}"><figcaption>'
                         f"<b>{html.escape(key)}</b> {prompt}</figcaption></figure>")
    return '<div class="sheet">' + "".join(cells) + "</div>" if cells else "<p>no image yet</p>"


def reason_class(error: str | None) -> str:
    """The kind of a failure or reject, for grouping: "nonfinite", "exception: RuntimeError",
    "malformed JSON", "empty prompt" (the details and the "rejected: " prefix dropped)."""
    text = (error or "").removeprefix("rejected: ")
    parts = text.split(": ")
    head = ": ".join(parts[:2]) if parts[0] == "exception" and len(parts) > 1 else parts[0]
    return head.split(" (")[0][:80]


def _failures(rows: dict[str, list]) -> list[tuple]:
    reasons = Counter((s, reason_class(e)) for s, e in zip(rows["status"], rows["error"]) if s != "ok")
    return [(s, r, n) for (s, r), n in reasons.most_common(20)]


def _truncation(rows: dict[str, list]) -> list[tuple]:
    longest: Counter = Counter()
    for tokens in rows["tokens"]:
        try:
            counts = json.loads(tokens) if tokens else {}
        except ValueError:
            continue
        for encoder, n in counts.items() if isinstance(counts, dict) else ():
            if isinstance(n, int):
                longest[encoder] = max(longest[encoder], n)
    return [("truncated prompts", sum(bool(t) for t in rows["truncated"]))] + \
        [(f"longest prompt, {encoder} tokens", n) for encoder, n in sorted(longest.items())]


def _shapes(plan: Plan, rows: dict[str, list]) -> list[tuple]:
    """(shape, images, mean generation s per image) of each shape the ok samples have, most common first: a run
    whose rows set their own size, aspect ratio or frames (prompts.row_settings) makes several. The images are
    counted once, in each shard's stats (what jobs.status sums too); the times come from the index, by size."""
    times: dict[str, list] = defaultdict(list)
    for st, w, h, t in zip(rows["status"], rows["width"], rows["height"], rows["gen_s"]):
        if st == "ok" and t is not None:
            times[shape_label(w, h)].append(t)
    shapes = read_status_ledger(plan).done.shapes
    size = {shape: "x".join(shape.split("x")[:2]) for shape in shapes}  # a video's frames are not in the index
    return [(shape, n, _num(sum(times[size[shape]]) / len(times[size[shape]]), 3) if times[size[shape]] else "?")
            for shape, n in shapes.most_common()]


def _signal_sections(rows: dict[str, list]) -> list[tuple[str, str]]:
    out = []
    if any(v is not None for v in rows["clip_score"]):
        out.append(("CLIP score", histogram(rows["clip_score"], "clip_score")))
    if any(v is not None for v in rows["phash"]):
        dup = Counter(h for h in rows["phash"] if h)
        facts = [("images hashed", sum(dup.values())), ("distinct phash", len(dup)),
                 ("in an exact-duplicate group", sum(n for n in dup.values() if n > 1))]
        out.append(("Perceptual hashes (python -m jobs.dedup for near duplicates)", _table(facts, ("what", "count"))))
    if any(v is not None for v in rows["watermark_ok"]):
        decoded = [("watermark decodes", sum(bool(v) for v in rows["watermark_ok"]))]
        out.append(("Watermark", _table(decoded, ("what", "count"))))
    return out


def build_report(plan: Plan) -> str:
    """The report of ``plan``'s run as a self-contained HTML page."""
    return report_page(plan)[0]


def report_page(plan: Plan) -> tuple[str, dict[int, str]]:
    """The report of ``plan``'s run as a self-contained HTML page, and the committed shards found damaged
    (shard -> why; the page names them at its top)."""
    rows = _index_rows(plan)
    status = Counter(rows["status"])
    launches = read_launches(plan.run)
    damaged = damaged_shards(plan)
    sheet = contact_sheet(plan, damaged=damaged)  # before the page's top is written: reading may find more
    done = len(plan.run.done_shards())
    state = "complete" if done == plan.num_shards else (
        f"in progress: {read_ledger(plan).done_samples} of {plan.num_rows} samples durable; the figures below are "
        "the committed shards'")
    if damaged:  # "complete" alone would call a damaged run sound
        state += f"; {len(damaged)} damaged shard(s), named above"
    counts = [("state", state), ("prompts", plan.num_rows), ("shards committed", f"{done} of {plan.num_shards}"),
              ("images (ok)", status["ok"]), ("failed", status["failed"]), ("rejected", status["rejected"]),
              ("truncated prompts", sum(bool(t) for t in rows["truncated"])), ("launches", len(launches))]
    sections = [("Counts", _table(counts, ("what", "count"))),
                ("Throughput over time, per replica of each launch",
                 line_chart(_throughput_series(plan), "time", "samples")),
                ("Launches", _table([(i + 1, l.get("world_size"), l.get("generated_here"), _num(l.get("wall_s"), 1),
                                      _num(l.get("images_per_s"), 2), l.get("complete"))
                                     for i, l in enumerate(launches)],
                                    ("launch", "ranks", "generated", "wall s", "images/s", "complete"))),
                ("Failures by reason", _table(_failures(rows), ("status", "reason", "samples"))
                 if status["failed"] + status["rejected"] else "<p>none</p>"),
                ("Truncation", _table(_truncation(rows), ("what", "count"))),
                ("Images per shape", _table(_shapes(plan, rows), ("width x height [x frames]", "images",
                                                                   "mean gen s (this size)"))),
                ("Generation time per sample (s)", histogram(rows["gen_s"], "gen_s"))]
    sections += _signal_sections(rows)
    if fidelity := _fidelity(plan.run):
        sections.append(("Fidelity against lossless", _fidelity_table(fidelity)))
    sections.append(("Contact sheet", sheet))
    body = _damaged_section(plan, damaged) + "".join(f"<h2>{html.escape(t)}</h2>{b}" for t, b in sections)
    name = plan.run.name.rstrip("/").rsplit("/", 1)[-1]  # a run kept in a bucket: its URL's last folder
    title = html.escape(f"shardgen run {name}")
    page = (f"{REPORT_HEAD}{html.escape(name)}</title><style>{_CSS}</style></head>"
            f"<body><h1>{title}</h1><p class='path'>{html.escape(plan.run.name)}</p>{body}</body></html>")
    return page, damaged


FIDELITY_LIMIT = RECORD_LIMIT


FIDELITY_HEAD = ("measured by", "samples", "PSNR median dB", "PSNR worst dB", "SSIM median", "SSIM worst")
PERCEPTUAL_HEAD = ("LPIPS median", "LPIPS worst", "CLIP score run / reference")
"""The columns of the figures jobs.compare adds when asked (--lpips-*, --clip): shown when a record has them."""


def _fidelity(run: RunDir) -> list[tuple]:
    """A row per fidelity record of the run (the columns of FIDELITY_HEAD, PERCEPTUAL_HEAD, then a verdict): the
    quality gate's (calibration.json, written by the job) and jobs.compare's (compare.json); a damaged one is named
    as such, never read as figures."""
    out = []
    for path, what in ((run.calibration_path, "calibration (calibrate_samples)"),
                       (run.compare_path, "jobs.compare")):
        try:
            data = read_fidelity_record(run, path, FIDELITY_LIMIT)
            if data is None:
                continue
            rec = json.loads(data)
            psnr, ssim = rec["psnr_db"], rec["ssim"]
            if what.startswith("calibration"):
                if not isinstance(rec["passed"], bool):  # "false" is truthy: no verdict is read from it
                    raise TypeError("passed is not true or false")
                verdict = ("passed" if rec["passed"] else f"below a bound: {rec['action']}") + f" ({rec['lossy']})"
            else:
                verdict = f"against {rec['reference']}"
            out.append((what, psnr["n"], _num(psnr["median"], 2), _num(psnr["worst"], 2), _num(ssim["median"], 4),
                        _num(ssim["worst"], 4), *_perceptual(rec), verdict))
        except (RunDirError, OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # nested past the parser
            out.append((what, *[""] * (len(FIDELITY_HEAD) + len(PERCEPTUAL_HEAD) - 1),
                        f"{path.name} is unreadable ({type(e).__name__}); not shown"))
    return out


def _perceptual(rec: dict) -> tuple[str, str, str]:
    """A record's LPIPS median and worst and its CLIP scores (run / reference), "" for those it has not."""
    lpips, clip = rec.get("lpips"), rec.get("clip_score")
    cells = (_num(lpips["median"], 3, "g"), _num(lpips["worst"], 3, "g")) if lpips is not None else ("", "")
    if clip is None:
        return (*cells, "")
    return (*cells, f"{_num(clip['run'], 1)} / {_num(clip['reference'], 1)}")


def _fidelity_table(rows: list[tuple]) -> str:
    """The fidelity rows as a table, the perceptual columns left out when no record has them."""
    n = len(FIDELITY_HEAD)
    if all(not any(r[n:n + len(PERCEPTUAL_HEAD)]) for r in rows):
        return _table([r[:n] + r[n + len(PERCEPTUAL_HEAD):] for r in rows], (*FIDELITY_HEAD, "verdict"))
    return _table(rows, (*FIDELITY_HEAD, *PERCEPTUAL_HEAD, "verdict"))


def _damaged_section(plan: Plan, damaged: dict[int, str]) -> str:
    """The page's warning about ``damaged`` shards (empty when there is none): which files and the fix."""
    if not damaged:
        return ""
    rows = [(f"shards/{plan.run.shard_file(shard).name}", why) for shard, why in sorted(damaged.items())]
    text = (f"{len(damaged)} committed shard(s) could not be read whole: this report leaves out what of them could "
            f"not be read (their images are missing from the contact sheet). To repair: "
            + REPAIR_HINT.format(root=plan.run.name))
    return (f"<div class='damaged'><h2>Damaged shards</h2><p>{html.escape(text)}</p>"
            f"{_table(rows, ('shard file', 'why'))}</div>")


_CSS = ("body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f0f0f0}"
        ".sheet{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0;width:160px;font-size:11px}"
        "img{image-rendering:pixelated;display:block}.path{color:#666}"
        ".damaged{border:2px solid #d62728;background:#fdecea;padding:4px 12px}")


def check_report_out(out: Path, run: RunDir) -> None:
    """RunDirError when ``out`` exists and is not a page this tool wrote (``refuse_foreign_out``)."""
    refuse_foreign_out(out, run.report_path, REPORT_HEAD.encode(), "jobs.report")


def write_report(plan: Plan, out: Path) -> dict[int, str]:
    """Write the report to ``out`` (whole, never through a symlink); return the committed shards it found damaged
    (shard -> why), which the page names too: the caller says so as well."""
    page, damaged = report_page(plan)
    safe_write(out, page.encode("utf-8"), plan.run)
    return damaged


def _num(value, digits: int, style: str = "f") -> str:
    """A number from the logs, formatted (``style`` "f": ``digits`` decimals, "g": significant digits); anything
    else as "?"."""
    return f"{value:.{digits}{style}}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _stats(plan: Plan) -> list[dict]:
    """The readable stats of the committed shards."""
    out = []
    for shard in sorted(plan.run.done_shards()):
        try:
            out.append(committed_stats(plan.run, shard))  # keep_local=false: from the upload record
        except RunDirError:
            continue
    return [s for s in out if isinstance(s, dict)]

