"""The run report (jobs.report) over a run with ok, failed and rejected samples, opened in a real
headless browser; per-rank log files and the launches that accumulate."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from PIL import Image

from jobs.generate import run
from jobs.report import main as report_main
from tests.conftest import compose_cfg
from tests.test_dataset import mixed_run  # noqa: F401  (the fixture: ok, failed and rejected samples)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_report_shows_counts_failures_throughput_and_thumbnails(mixed_run, tmp_path):  # noqa: F811
    out = tmp_path / "report.html"
    assert report_main([str(mixed_run), "--out", str(out)]) == 0
    page = out.read_text()
    assert "<td>failed</td><td>1</td>" in page and "<td>rejected</td><td>4</td>" in page
    assert "<td>images (ok)</td><td>3</td>" in page
    assert "<td>failed</td><td>nonfinite</td><td>1</td>" in page  # failures by reason
    assert "<td>rejected</td><td>malformed JSON</td><td>1</td>" in page
    assert "<td>rejected</td><td>the prompt is not a string</td><td>1</td>" in page
    assert page.count("data:image/jpeg;base64,") == 3  # a thumbnail per image, none for failures
    assert "<polyline" in page and "replica 0" in page
    assert "src=\"http" not in page and "href=\"http" not in page  # self-contained


def test_rank_logs_and_launches_accumulate(mixed_run, tmp_path):  # noqa: F811
    copy = tmp_path / "run"
    shutil.copytree(mixed_run, copy)
    log = (copy / "logs" / "rank000.log").read_text()
    assert "shard 000002 committed: 2 samples" in log and "planned 8 prompts" in log
    cfg = json.loads((copy / "launches.jsonl").read_text().splitlines()[0])
    assert (cfg["ok"], cfg["failed"], cfg["rejected"], cfg["complete"]) == (3, 1, 4, True)
    prompts = copy.parent / "p.jsonl"
    prompts.write_text((mixed_run.parent / "p.jsonl").read_text())
    run(compose_cfg(f"run_dir={copy}", "prompts=jsonl", f"prompts.path={mixed_run.parent / 'p.jsonl'}",
                    "prompts.on_bad_row=skip", "height=16", "width=16", "steps=1", "progress=false", "batch_size=2",
                    "samples_per_shard=3"))
    assert len((copy / "launches.jsonl").read_text().splitlines()) == 2
    events = [json.loads(l) for p in (copy / "logs").glob("events.*.jsonl") for l in p.read_text().splitlines()]
    assert sorted(e["shard"] for e in events) == [0, 1, 2]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(mixed_run, tmp_path):  # noqa: F811
    out = tmp_path / "report.html"
    report_main([str(mixed_run), "--out", str(out)])
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    f"--screenshot={shot}", "--window-size=900,1400", out.as_uri()], check=True, timeout=120,
                   capture_output=True)
    img = Image.open(shot).convert("L")
    assert img.size == (900, 1400)
    assert len(set(img.getdata())) > 20  # text, charts and thumbnails, not a blank page
