"""A run's report as one self-contained HTML page (inline SVG charts, inline thumbnails).

Counts, throughput over time per replica (from ``logs/events.*.jsonl``; the shards' stats files
where a run has none), launches, failures by reason, truncation, signal histograms and a contact
sheet. Everything comes from the run directory: the plan, the parquet indexes, the stats, the
tars (only for the thumbnails).
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
from shardgen.dataio.rundir.layout import RunDirError
from shardgen.dataio.shards.formats import OUTPUT_FORMATS, image_ext
from shardgen.dataio.shards.shardwork import committed_stats
from shardgen.tools.runfiles import committed_members, read_events, read_index_columns, read_launches, safe_write

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
W, H, PAD = 560, 220, 40
_COLUMNS = ("key", "prompt", "status", "error", "truncated", "tokens", "gen_s", "phash", "watermark_ok", "clip_score",
            "width", "height")


def _index_rows(plan: Plan) -> dict[str, list]:
    """The index columns the report uses, over every committed shard, as lists."""
    return read_index_columns(plan.run, list(_COLUMNS))


def _throughput_series(plan: Plan) -> dict[str, list[tuple[float, int]]]:
    """replica -> [(time, cumulative samples)] of its committed shards."""
    events = read_events(plan.run)
    if not events:  # a run from before the events files: the stats have no replica
        events = [dict(t=s["finished"], replica="all", samples=s["count"]) for s in _stats(plan)
                  if isinstance(s.get("finished"), (int, float)) and isinstance(s.get("count"), int)]
    by_replica: dict[str, list] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["t"]):
        series = by_replica[str(e["replica"])]
        series.append((e["t"], (series[-1][1] if series else 0) + e["samples"]))
    return dict(sorted(by_replica.items()))


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


def contact_sheet(plan: Plan, n: int = 24, size: int = 160) -> str:
    """Thumbnails (inline JPEG) of the first ``n`` images with their keys and prompts."""
    from PIL import Image

    cells = []
    for key, mem in committed_members(plan.run):
        if len(cells) >= n:  # (an uploaded shard's tar is fetched from the bucket: no more than needed)
            break
        ext = image_ext(mem)
        if ext is not None:
            try:
                img = Image.fromarray(OUTPUT_FORMATS[ext].decode(mem[ext]))
            except Exception:  # an image that does not decode (jobs.verify reports it): no thumbnail
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
    rows = _index_rows(plan)
    status = Counter(rows["status"])
    launches = read_launches(plan.run)
    done = len(plan.run.done_shards())
    state = "complete" if done == plan.num_shards else (
        f"in progress: {read_ledger(plan).done_samples} of {plan.num_rows} samples durable; the figures below are "
        "the committed shards'")
    counts = [("state", state), ("prompts", plan.num_rows), ("shards committed", f"{done} of {plan.num_shards}"),
              ("images (ok)", status["ok"]), ("failed", status["failed"]), ("rejected", status["rejected"]),
              ("truncated prompts", sum(bool(t) for t in rows["truncated"])), ("launches", len(launches))]
    sections = [("Counts", _table(counts, ("what", "count"))),
                ("Throughput over time, per replica", line_chart(_throughput_series(plan), "time", "samples")),
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
    sections.append(("Contact sheet", contact_sheet(plan)))
    body = "".join(f"<h2>{html.escape(t)}</h2>{b}" for t, b in sections)
    title = html.escape(f"shardgen run {plan.run.root.name}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{_CSS}</style></head>"
            f"<body><h1>{title}</h1><p class='path'>{html.escape(str(plan.run.root))}</p>{body}</body></html>")


_CSS = ("body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f0f0f0}"
        ".sheet{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0;width:160px;font-size:11px}"
        "img{image-rendering:pixelated;display:block}.path{color:#666}")


def write_report(plan: Plan, out: Path) -> Path:
    """Write the report to ``out`` (whole, never through a symlink); return it."""
    safe_write(out, build_report(plan).encode("utf-8"), plan.run)
    return out


def _num(value, digits: int) -> str:
    """A number from the logs, formatted; anything else as "?"."""
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _stats(plan: Plan) -> list[dict]:
    """The readable stats of the committed shards."""
    out = []
    for shard in sorted(plan.run.done_shards()):
        try:
            out.append(committed_stats(plan.run, shard))  # keep_local=false: from the upload record
        except RunDirError:
            continue
    return [s for s in out if isinstance(s, dict)]

