"""RunDir builds every path of a run directory: the layout docs/architecture.md and the tools rely on."""

from pathlib import Path

import pytest

from shardgen.dataio.rundir.layout import RunDir


def test_every_path_is_under_the_run_directory_where_the_docs_say():
    run = RunDir(Path("/r"))
    paths = {
        "plan/plan.json": run.plan_json_path, "plan/starts.npy": run.starts_path, "latents": run.latents_dir,
        "logs/rank007.log": run.rank_log_path(7), "logs/events.h1.42.jsonl": run.events_path("h1", 42),
        "logs/failures/123.attempt2": run.failure_mark_path("123", 2), "logs/slurm": run.slurm_logs_dir,
        "launches.jsonl": run.launches_path,
    }
    assert {k: str(v.relative_to("/r")) for k, v in paths.items()} == {k: k for k in paths}
    assert run.events_path("h1", 42).match(run.EVENTS_GLOB)
    assert run.failure_mark_path("123", 2).match(run.failure_mark_path("123", "*").name)


@pytest.mark.parametrize("host,name", [("evil/../../x", "evil_.._.._x"), ("..", "host"), ("", "host"),
                                       ("a~b", "a_b"), ("node-1.cluster", "node-1.cluster")])
def test_a_host_name_becomes_a_file_name_part(monkeypatch, host, name):
    import socket

    from shardgen.dataio.rundir.liveness import host_name

    monkeypatch.setattr(socket, "gethostname", lambda: host)
    assert host_name() == name


def test_a_host_name_with_path_characters_stays_in_the_run_directory(tmp_path, monkeypatch):
    import socket

    from jobs import verify
    from tests.conftest import write_lines
    from tests.test_integrity import gen

    monkeypatch.setattr(socket, "gethostname", lambda: "a~b/../../x")
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    prompts = write_lines(work / "p.txt", ["a cat", "a dog", "a cow"])
    assert gen(work / "run", prompts).complete
    assert verify.main([str(work / "run")]) == 0
    assert sorted(p.name for p in tmp_path.rglob("*") if work / "run" not in p.parents) == ["a", "b", "p.txt", "run"]


def test_a_run_dir_starting_with_a_tilde_is_the_home_directorys(tmp_path, monkeypatch):
    from jobs import status
    from jobs.generate import run
    from tests.conftest import compose_cfg, write_lines
    from tests.test_integrity import ARGS

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.txt", ["a cat", "a dog"])
    assert run(compose_cfg("run_dir='~/runs/x'", f"prompts.path={prompts}", *ARGS)).complete
    assert (tmp_path / "home" / "runs" / "x" / "fingerprint.json").is_file() and not (tmp_path / "~").exists()
    assert status.main(["run_dir=~/runs/x"]) == 0


def _generate(tmp_path: Path, *args: str):
    """``python -m jobs.generate ARGS`` in ``tmp_path`` (its current directory): (exit status, stderr)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-m", "jobs.generate", "height=16", "width=16", "steps=1", "progress=false",
                        f"prompts.path={root / 'examples' / 'prompts.txt'}", *args], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr


@pytest.mark.parametrize("dry", [False, True])
def test_a_url_of_a_store_that_cannot_hold_a_run_is_refused_in_one_line_naming_output_uri(tmp_path, dry):
    rc, err = _generate(tmp_path, "run_dir=gs://bucket/r", f"dry_run={str(dry).lower()}")
    assert rc == 2 and err.count("\n") == 1, err
    assert "run_dir=gs://bucket/r: a run kept in a bucket needs an S3-compatible store" in err
    assert "output_uri=gs://bucket/r/" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dry", [False, True])
def test_a_bucket_run_dir_whose_bucket_does_not_exist_is_one_line_and_no_folder_is_made(tmp_path, s3, dry):
    rc, err = _generate(tmp_path, "run_dir=s3://no-such-bucket/r", f"dry_run={str(dry).lower()}")
    assert rc == 2 and err.count("\n") == 1, err
    assert "s3://no-such-bucket/r/" in err and "the bucket does not exist" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run_dir", ["x" * 300, "/".join(["d" * 200] * 21)])
def test_a_run_dir_no_file_system_takes_is_one_line(tmp_path, run_dir):
    rc, err = _generate(tmp_path, f"run_dir={run_dir}")
    assert rc == 2 and err.count("\n") == 1 and "no file system takes it; choose a shorter run_dir" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_store_url_short_of_its_slashes_is_refused_in_one_line_and_no_local_folder_is_made(tmp_path):
    rc, err = _generate(tmp_path, "run_dir=s3:/bucket/run")
    assert rc == 2 and err.count("\n") == 1, err
    assert ("run_dir=s3:/bucket/run is no URL (a URL has '//' after 's3:') but a local path in a folder named 's3:'. "
            "Write run_dir=s3://bucket/run; for a local path of that name, run_dir=./s3:/bucket/run") in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run_dir,advice", [
    ("gs:/bucket/r", "Write run_dir=gs://bucket/r;"), ("S3:", "Write run_dir=S3://BUCKET/RUN_NAME;"),
    ("file:/data/runs/a", "Write run_dir=/data/runs/a;"), ("file:///data/runs/a", "write run_dir=/data/runs/a"),
    ("file:", "Write run_dir=/PATH;"), ("file:///", "write run_dir=/PATH"),
])
def test_a_near_url_run_dir_names_what_to_write(run_dir, advice):
    from shardgen.dataio.rundir import check_run_dir_text
    from shardgen.dataio.rundir.storage import RunDirError

    with pytest.raises(RunDirError, match=advice):
        check_run_dir_text(run_dir)


@pytest.mark.parametrize("run_dir", ["./s3:/bucket/r", "runs/gs:", "mys3:/x", "s3x:/y"])
def test_a_local_path_with_a_colon_in_it_stays_a_run_dir(run_dir):
    from shardgen.dataio.rundir import check_run_dir_text

    check_run_dir_text(run_dir)


@pytest.mark.parametrize("tool", ["status", "verify", "report"])
def test_the_tools_name_the_url_a_run_dir_short_of_its_slashes_meant(tmp_path, monkeypatch, capsys, tool):
    import importlib

    monkeypatch.chdir(tmp_path)
    assert importlib.import_module(f"jobs.{tool}").main(["s3:/bucket/run"]) == 2
    err = capsys.readouterr().err
    assert "Write run_dir=s3://bucket/run;" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_file_url_short_of_its_slashes_is_refused_naming_the_url(tmp_path, monkeypatch):
    from jobs.generate import run
    from shardgen.errors import ConfigError
    from tests.conftest import compose_cfg

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts.path=s3:/bucket/captions.txt"))
    assert str(refused.value) == ("prompts.path=s3:/bucket/captions.txt is no URL (a URL has '//' after 's3:') but a "
                                  "local path in a folder named 's3:'. Write prompts.path=s3://bucket/captions.txt; "
                                  "for a local path of that name, prompts.path=./s3:/bucket/captions.txt")
    assert list(tmp_path.iterdir()) == []
