"""Operating a run: jobs.status, jobs.verify (catches real defects), jobs.preview."""

from __future__ import annotations

import tarfile

import pytest
from PIL import Image

from jobs import preview, status, verify
from jobs.generate import run
from tests.conftest import compose_cfg

ARGS = ("height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=5", "prompts.limit=12")


@pytest.fixture()
def done_run(tmp_path):
    d = tmp_path / "run"
    run(compose_cfg(f"run_dir={d}", *ARGS))
    return d


def test_status_reports_progress_and_completion(done_run, capsys):
    assert status.main([str(done_run)]) == 0
    out = capsys.readouterr().out
    assert "samples  12/12 (100.0%)" in out and "3 done, 0 running" in out and "COMPLETE" in out


def test_status_of_a_half_done_run_shows_pending_shards(done_run, capsys):
    (done_run / "shards" / "000001.stats.json").unlink()
    status.main([str(done_run)])
    out = capsys.readouterr().out
    assert "2 done" in out and "1 pending" in out and "stopped (no live claim) / resumable" in out


def test_status_keeps_committed_stats_in_a_cache_and_reads_a_changed_one_again(done_run, capsys):
    """A later status call reads its figures from stats_cache.npz; a stats file rewritten since (another size or
    mtime) is read again, and a damaged cache only costs a re-read: the output is the same."""
    import json

    assert status.main([str(done_run), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["results"]["failed"] == 0 and (done_run / "stats_cache.npz").is_file()
    path = done_run / "shards" / "000001.stats.json"
    stats = json.loads(path.read_text())
    stats.update(ok=stats["ok"] - 1, failed=stats["failed"] + 1, failures_by_reason={"CUDA out of memory": 1})
    path.write_text(json.dumps(stats))
    assert status.main([str(done_run), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["results"]["failed"] == 1 and second["results"]["ok"] == first["results"]["ok"] - 1
    assert second["failures_by_reason"] == {"CUDA out of memory": 1}
    (done_run / "stats_cache.npz").write_bytes(b"not a zip")
    assert status.main([str(done_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == second


def test_verify_passes_a_complete_run(done_run, capsys):
    assert verify.main([str(done_run)]) == 0
    assert "OK: every prompt index exactly once" in capsys.readouterr().out


def test_tools_take_the_run_dir_as_jobs_generate_spells_it(done_run, capsys):
    assert verify.main([f"run_dir={done_run}"]) == 0
    assert status.main([f"run_dir={done_run}"]) == 0
    out = capsys.readouterr().out
    assert "OK: every prompt index exactly once" in out and "not a shardgen run directory" not in out


def test_verify_catches_a_truncated_tar(done_run, capsys):
    tar = done_run / "shards" / "000001.tar"
    tar.write_bytes(tar.read_bytes()[:1500])
    assert verify.main([str(done_run)]) == 1
    out = capsys.readouterr().out
    assert "shard 000001" in out and "FAILED" in out


def test_status_counts_a_tar_cut_after_its_commit_as_damaged_not_done(done_run, capsys):
    assert status.main([str(done_run)]) == 0  # the stats cached first: the cut is seen all the same
    tar = done_run / "shards" / "000001.tar"
    tar.write_bytes(tar.read_bytes()[:1500])
    status.main([str(done_run)])
    out = capsys.readouterr().out.split("run ", 2)[-1]
    assert "2 done, 0 running" in out and "COMPLETE" not in out
    assert "damaged  1 committed shard(s) whose tar is not the size its stats record (000001)" in out
    assert f"python -m jobs.verify {done_run} --repair" in out


def test_verify_catches_a_missing_and_a_duplicated_sample(done_run, capsys):
    tar = done_run / "shards" / "000000.tar"
    with tarfile.open(tar) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf]
    rebuilt = [(m, d) for m, d in members if not m.name.startswith("0000000002.")]  # drop a sample
    with tarfile.open(tar, "w") as tf:
        for m, d in rebuilt:
            import io

            tf.addfile(m, io.BytesIO(d))
    assert verify.main([str(done_run)]) == 1
    out = capsys.readouterr().out
    assert "1 prompt indices missing" in out and "stats count 5 != 4" in out


def test_verify_reports_an_unfinished_run(done_run, capsys):
    (done_run / "shards" / "000002.stats.json").unlink()  # a commit interrupted between the tar and its stats
    assert verify.main([str(done_run)]) == 0  # unfinished, not defective
    out = capsys.readouterr().out
    assert "UNFINISHED shard 000002: its commit was interrupted" in out and "DEFECT" not in out
    assert "OK so far: the run is unfinished (1 of 3 shards not committed: 1 in progress, 0 not started)" in out
    assert verify.main([str(done_run), "--repair"]) == 0 and (done_run / "shards" / "000002.stats.json").exists()


def test_preview_writes_a_contact_sheet(done_run, tmp_path):
    out = tmp_path / "sheet.png"
    assert preview.main([str(done_run), "--n", "8", "--cols", "4", "--size", "64", "--out", str(out)]) == 0
    img = Image.open(out)
    assert img.size == (4 * 64, 2 * (64 + 48))


def test_tools_refuse_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert verify.main([str(tmp_path)]) == 2
    assert status.main([str(tmp_path)]) == 2
    assert "not a shardgen run directory" in capsys.readouterr().err


def test_status_tells_the_last_error_from_the_last_warning(done_run, capsys):
    (done_run / "shards" / "000001.stats.json").unlink()  # a stopped run: its warnings are news
    with open(done_run / "logs" / "rank000.log", "a") as f:
        f.write("2030-01-01 00:00:00,000 ERROR shardgen: CUDA out of memory\n"
                "2030-01-01 00:00:01,000 WARNING shardgen: 2 prompt(s) were longer than the text encoders keep\n")
    assert status.main([str(done_run)]) == 0
    out = capsys.readouterr().out
    assert "  last error  rank 000 at 2030-01-01 00:00:00,000 (ERROR, shardgen): CUDA out of memory" in out
    assert "  last warning  rank 000 at 2030-01-01 00:00:01,000 (shardgen): 2 prompt(s) were longer" in out


def test_prometheus_exposition_of_a_run_and_its_ranks_has_the_real_counts(done_run, capsys):
    """Each writing rank's textfile (metrics/rank000.prom, rewritten at each commit) and jobs.status --prometheus
    (the run's figures plus every rank file) parse with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    def values(text: str) -> dict:
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in ("status", "state")))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    rank = values((done_run / "metrics" / "rank000.prom").read_text())
    assert rank[("shardgen_committed_samples_total", (("status", "ok"),))] == 12
    assert rank[("shardgen_committed_samples_total", (("status", "failed"),))] == 0
    assert rank[("shardgen_committed_shards_total", ())] == 3 and rank[("shardgen_claims_total", ())] == 3
    assert rank[("shardgen_generated_samples_total", ())] == 12 and rank[("shardgen_device_seconds_per_sample", ())] > 0
    (done_run / "shards" / "000001.stats.json").unlink()  # a shard lost: the run's figures say so
    assert status.main([str(done_run), "--prometheus"]) == 0
    run = values(capsys.readouterr().out)
    assert run[("shardgen_run_prompts", ())] == 12 and run[("shardgen_run_samples_done", ())] == 7
    assert run[("shardgen_run_samples", (("status", "ok"),))] == 7
    assert run[("shardgen_run_shards", (("state", "done"),))] == 2
    assert run[("shardgen_run_shards", (("state", "pending"),))] == 1 and run[("shardgen_run_complete", ())] == 0
    assert run[("shardgen_committed_samples_total", (("status", "ok"),))] == 12  # the rank's file, merged in


def test_a_rank_that_commits_nothing_shows_zeros_in_a_file_named_by_its_slurm_job_and_rank(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from shardgen.dataio.rundir import RankMetrics, RunDir

    metrics = RankMetrics(RunDir(tmp_path), rank=3, replica=1, ranks_per_replica=2, job="77")
    metrics.write()
    path = tmp_path / "metrics" / "job77.rank003.prom"
    samples = [s for f in text_string_to_metric_families(path.read_text()) for s in f.samples]
    ok = next(s for s in samples if s.name == "shardgen_committed_samples_total" and s.labels["status"] == "ok")
    assert ok.value == 0 and ok.labels | {"host": "-"} == dict(run=str(tmp_path), rank="3", replica="1", host="-",
                                                              job="77", status="ok")
    metrics.commit({"ok": 4, "failed": 1, "rejected": 0}, generated=5, gen_s=2.5)
    values = {s.name: s.value for f in text_string_to_metric_families(path.read_text()) for s in f.samples
              if s.labels.get("status") in (None, "failed")}
    assert values["shardgen_committed_samples_total"] == 1 and values["shardgen_device_seconds_total"] == 5.0
    assert values["shardgen_device_seconds_per_sample"] == 1.0 and values["shardgen_committed_shards_total"] == 1


def test_status_tells_the_replicas_of_two_launches_apart(done_run, capsys):
    """A second launch (another process) on the run has a replica 0 too: each line names its launch."""
    import os

    from tests.conftest import start_module

    for name in ("000001.stats.json", "000001.tar", "000001.parquet"):
        (done_run / "shards" / name).unlink()
    second = start_module("jobs.generate", [f"run_dir={done_run}", *ARGS], done_run.parent / "second-launch.log")
    assert second.wait(timeout=300) == 0, second.output[-2000:]
    assert status.main([str(done_run)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  replica  0")]
    assert len(lines) == 2 and len({ln.split(":")[0] for ln in lines}) == 2
    # the most recent launch first: the subprocess's 5 samples, then this process's 12
    assert f"pid {os.getpid()})" not in lines[0] and "5 samples" in lines[0]
    assert f"pid {os.getpid()})" in lines[1] and "12 samples" in lines[1]


def test_status_watch_shows_the_run_again_until_it_is_complete(done_run, capsys, monkeypatch):
    """--watch on an unfinished run shows a view, sleeps, shows the next one (the run meanwhile completed by
    another launch) and stops there with exit 0."""
    stats = done_run / "shards" / "000001.stats.json"
    kept = stats.read_bytes()
    stats.unlink()
    sleeps = []

    def another_launch_commits_meanwhile(seconds):
        sleeps.append(seconds)
        stats.write_bytes(kept)

    monkeypatch.setattr("jobs.status.time.sleep", another_launch_commits_meanwhile)
    assert status.main([str(done_run), "--watch", "2"]) == 0
    views = capsys.readouterr().out.split("--- ")[1:]
    assert sleeps == [2.0] and len(views) == 2
    assert "2 done" in views[0] and "stopped" in views[0] and "3 done" in views[1] and "COMPLETE" in views[1]


def test_status_watch_stops_quietly_on_ctrl_c_and_refuses_a_bad_interval(done_run, capsys, monkeypatch):
    (done_run / "shards" / "000001.stats.json").unlink()

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr("jobs.status.time.sleep", ctrl_c)
    assert status.main([str(done_run), "--watch"]) == 0
    assert capsys.readouterr().out.count("--- ") == 1
    assert status.main([str(done_run), "--watch", "0"]) == 2
    assert "error: --watch 0: give a number of seconds above 0" in capsys.readouterr().err
