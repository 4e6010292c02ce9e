"""The run report (jobs.report) over a run with ok, failed and rejected samples, opened in a real
headless browser; per-rank log files and the launches that accumulate."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize("damage", ["truncated", "garbage, same size"])
def test_a_damaged_shard_is_named_on_stderr_and_in_the_page_and_exits_1(mixed_run, tmp_path, capsys,  # noqa: F811
                                                                        damage):
    """The report is still written for what is readable, but never shows a damaged run as fine: a truncated tar
    (its size is not its stats') and one as long as before whose bytes do not read as a tar."""
    d = tmp_path / "run"
    shutil.copytree(mixed_run, d)
    tar = d / "shards" / "000000.tar"
    if damage == "truncated":
        os.truncate(tar, 100)
    else:
        with open(tar, "r+b") as f:
            f.write(b"not a tar header " * 30)
    out = tmp_path / "report.html"
    assert report_main([str(d), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == f"wrote {out}\n"
    assert "shards/000000.tar" in captured.err and f"python -m jobs.verify {d} --repair" in captured.err
    assert "Traceback" not in captured.err
    page = out.read_text()
    assert "Damaged shards" in page and "000000.tar" in page and f"python -m jobs.verify {d} --repair" in page
    assert page.count("data:image/jpeg;base64,") == 2  # the other shards' images, not shard 0's


def test_out_never_replaces_a_file_that_is_not_a_report_without_force(mixed_run, tmp_path, capsys):  # noqa: F811
    mine = tmp_path / "prompts.txt"
    mine.write_text("a cat\na dog\n")
    link = tmp_path / "link.html"
    link.symlink_to(mine)
    for out in (mine, link):
        assert report_main([str(mixed_run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {out} exists") and "--force" in err and err.count("\n") == 1
    assert mine.read_text() == "a cat\na dog\n" and link.is_symlink()
    new = tmp_path / "new.html"
    assert report_main([str(mixed_run), "--out", str(new)]) == 0  # a new file
    assert report_main([str(mixed_run), "--out", str(new)]) == 0  # a report it wrote: replaced
    assert report_main([str(mixed_run), "--out", str(mine), "--force"]) == 0
    assert mine.read_text().startswith("<!doctype html>")


def test_preview_out_never_replaces_a_file_that_is_not_a_sheet_without_force(mixed_run, tmp_path, capsys):  # noqa: F811
    from jobs.preview import main as preview_main

    mine = tmp_path / "notes.png"
    mine.write_bytes(b"\x89PNG my own picture")
    assert preview_main([str(mixed_run), "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {mine} exists and is not a file jobs.preview wrote") and "--force" in err
    assert mine.read_bytes() == b"\x89PNG my own picture"
    sheet = tmp_path / "sheet.png"
    assert preview_main([str(mixed_run), "--out", str(sheet)]) == 0
    assert preview_main([str(mixed_run), "--out", str(sheet)]) == 0  # a sheet it wrote: replaced
    assert report_main([str(mixed_run), "--out", str(sheet)]) == 2  # a sheet is no report
    assert preview_main([str(mixed_run), "--out", str(mine), "--force"]) == 0
    assert mine.read_bytes().startswith(b"\x89PNG\r\n")


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


def test_throughput_has_a_line_per_replica_of_each_launch(mixed_run, tmp_path):  # noqa: F811
    """Two launches on one run (each with its replica 0) are two lines, told apart by host, pid and SLURM job."""
    copy = tmp_path / "run"
    shutil.copytree(mixed_run, copy)
    for p in (copy / "logs").glob("events.*.jsonl"):
        p.unlink()
    for host, pid, job, t0 in (("node1", 11, "77", 1000.0), ("node2", 22, None, 2000.0)):
        lines = [dict(t=t0 + 10 * i, replica=0, shard=i, samples=3, host=host, pid=pid, job=job) for i in range(2)]
        (copy / "logs" / f"events.{host}.{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    out = tmp_path / "report.html"
    assert report_main([str(copy), "--out", str(out)]) == 0
    page = out.read_text()
    assert page.count("<polyline") == 2
    assert "replica 0 on node1 pid 11 job 77" in page and "replica 0 on node2 pid 22<" in page


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
