"""Runs that move and runs that grow: a run is tied to its prompt file's content, not its path; prompts
appended to that file are planned as new shards after the existing ones, which stay byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import jobs.verify
from jobs.generate import run
from tests.conftest import compose_cfg, write_lines

FAST = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=4", "samples_per_shard=8")


def _gen(run_dir: Path, prompts: Path, *extra: str):
    return run(compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *FAST, *extra))


def _shard_bytes(run_dir: Path) -> dict[str, bytes]:
    """Every committed shard file's bytes (the stats, the done markers, hold times)."""
    return {p.name: p.read_bytes() for p in sorted((run_dir / "shards").iterdir()) if p.suffix in (".tar", ".parquet")}


def _samples(run_dir: Path) -> dict[str, tuple[bytes, bytes]]:
    """key -> (image, prompt) over the committed shards (a sample's json also holds its generation time)."""
    from shardgen.tools.verify import read_shard_members

    return {k: (m["png"], m["txt"]) for t in sorted((run_dir / "shards").glob("*.tar"))
            for k, m in read_shard_members(t).items()}


def test_a_run_copied_elsewhere_with_its_prompt_file_resumes_from_the_new_path(tmp_path, capsys):
    old = tmp_path / "laptop"
    old.mkdir()
    prompts = write_lines(old / "p.txt", [f"a photo of thing {i}" for i in range(20)])
    assert _gen(old / "run", prompts).complete
    before = _samples(old / "run")
    new = tmp_path / "cluster"
    shutil.copytree(old, new)
    shutil.rmtree(old)  # the old path is gone: nothing may be read from it
    for p in ("000001.tar", "000001.parquet", "000001.stats.json"):  # a shard still to do after the move
        (new / "run" / "shards" / p).unlink()
    r = _gen(new / "run", new / "p.txt")
    assert (r.complete, r.generated_here, r.ok) == (True, 8, 20)
    assert _samples(new / "run") == before  # the regenerated shard is the same, read from the new path
    capsys.readouterr()
    assert jobs.verify.main([str(new / "run")]) == 0, capsys.readouterr().out


def test_another_file_at_the_run_is_refused_naming_its_path(tmp_path):
    prompts = write_lines(tmp_path / "p.txt", [f"a photo of thing {i}" for i in range(10)])
    assert _gen(tmp_path / "run", prompts).complete
    other = write_lines(tmp_path / "q.txt", [f"a photo of thing {i}" for i in range(9)] + ["a changed line"])
    with pytest.raises(Exception, match=rf"prompts.path={other}: not this run's prompt file"):
        _gen(tmp_path / "run", other)


def _append(prompts: Path, lines: list[str]) -> None:
    with open(prompts, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def _committed(run_dir: Path, shards: range) -> dict[str, bytes]:
    """The bytes of every file of ``shards`` (tar, index, stats)."""
    return {p.name: p.read_bytes() for s in shards for p in sorted((run_dir / "shards").glob(f"{s:06d}.*"))}


def _grown_run(tmp_path: Path) -> tuple[Path, Path]:
    """A finished run of 40 prompts in shards of 16 (the last one holds 8)."""
    prompts = write_lines(tmp_path / "p.txt", [f"a photo of thing {i}" for i in range(40)])
    r = _gen(tmp_path / "run", prompts, "samples_per_shard=16")
    assert (r.complete, r.ok) == (True, 40)
    return tmp_path / "run", prompts


@pytest.mark.slow
def test_appended_prompts_become_new_shards_twice_in_a_row(tmp_path, capsys):
    """40 prompts done, 20 appended: 60 samples, the 3 earlier shards untouched byte for byte (the last one
    stays partial), keys and seeds of the new rows those of their line; the extension is recorded; again."""
    from shardgen.dataio.prompts.plan import load_plan, sample_seed
    from shardgen.dataio.rundir.layout import RunDir

    run_dir, prompts = _grown_run(tmp_path)
    before = _committed(run_dir, range(3))
    for round_, (old, new) in enumerate([(40, 60), (60, 80)]):
        _append(prompts, [f"an appended thing {i}" for i in range(old, new)])
        r = _gen(run_dir, prompts, "samples_per_shard=16")
        assert (r.complete, r.ok, r.total, r.generated_here) == (True, new, new, new - old)
        assert _committed(run_dir, range(3)) == before
        samples = _samples(run_dir)
        assert sorted(samples) == [f"{i:010d}" for i in range(new)]
        assert samples[f"{new - 1:010d}"][1] == f"an appended thing {new - 1}".encode()
        capsys.readouterr()
        assert jobs.verify.main([str(run_dir)]) == 0, capsys.readouterr().out
    plan = load_plan(RunDir(run_dir))
    assert [(e.first_row, e.end_row, e.first_shard, e.meta["num_shards"]) for e in plan.extensions] == \
        [(40, 60, 3, 2), (60, 80, 5, 2)]
    assert plan.extensions[0].meta["utc"] and plan.extensions[0].meta["prompt_size_before"] < \
        plan.extensions[0].meta["prompt_size"]
    assert [r.seed for r in plan.rows(3)][:1] == [sample_seed(0, 40)]
    assert run(compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *FAST, "samples_per_shard=16")) \
        .generated_here == 0  # nothing appended since: nothing to do


def test_an_edit_beside_an_append_is_refused_and_leaves_the_run_as_it_was(tmp_path):
    run_dir, prompts = _grown_run(tmp_path)
    text = prompts.read_text()
    prompts.write_text(text.replace("thing 3\n", "thing X\n", 1) + "an appended thing\n")  # same length
    with pytest.raises(Exception, match=rf"prompts.path={prompts}: not this run's prompt file, nor that file with "
                                        r"prompts appended \(its first \d+ bytes are not the planned file's\)"):
        _gen(run_dir, prompts, "samples_per_shard=16")
    assert not list((run_dir / "plan").glob("ext-*"))


@pytest.mark.slow
def test_two_jobs_extending_at_once_plan_the_rows_once(tmp_path, monkeypatch):
    """Both jobs plan the appended rows at the same moment: one rename wins, the other adopts its extension."""
    import threading

    import shardgen.dataio.resume.extend as extend
    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.run.runner import prepare_run

    run_dir, prompts = _grown_run(tmp_path)
    _append(prompts, [f"an appended thing {i}" for i in range(40, 60)])
    both_planning, real = threading.Barrier(2, timeout=60), extend.plan_rows_into

    def plan_side_by_side(*a, **kw):
        out = real(*a, **kw)
        both_planning.wait()
        return out

    monkeypatch.setattr(extend, "plan_rows_into", plan_side_by_side)
    cfg = compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *FAST, "samples_per_shard=16")
    plans = []
    jobs_ = [threading.Thread(target=lambda: plans.append(prepare_run(cfg))) for _ in range(2)]
    for t in jobs_:
        t.start()
    for t in jobs_:
        t.join()
    assert [p.num_rows for p in plans] == [60, 60]  # a job that failed (or never met the other) adds none
    assert [e.name for e in (run_dir / "plan").glob("ext-*")] == ["ext-000001"]
    assert len(load_plan(RunDir(run_dir)).extensions) == 1
    monkeypatch.setattr(extend, "plan_rows_into", real)
    r = _gen(run_dir, prompts, "samples_per_shard=16")
    assert (r.complete, r.ok, r.generated_here) == (True, 60, 20)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["planning", "renamed"])
def test_a_job_killed_mid_extension_leaves_a_run_the_next_launch_extends_once(tmp_path, where):
    """SIGKILL while the appended rows are planned (a temp dir left behind) or right after the extension's
    rename (the fingerprint not yet updated): the next launch plans each appended row exactly once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    run_dir, prompts = _grown_run(tmp_path)
    _append(prompts, [f"an appended thing {i}" for i in range(40, 60)])
    flag = tmp_path / "stopped"
    # planning: stop once the rows are scanned into the temp dir; renamed: stop instead of the fingerprint update
    # (extend.py's one json_bytes call makes the new fingerprint's bytes)
    code = (f"import pathlib, time\nimport shardgen.dataio.resume.extend as e\nname, flag = "
            f"{'plan_rows_into' if where == 'planning' else 'json_bytes'!r}, pathlib.Path({str(flag)!r})\n"
            "real = getattr(e, name)\n"
            "def stop(*a, **kw):\n"
            "    if name == 'plan_rows_into':\n"
            "        real(*a, **kw)\n"
            "    flag.touch()\n"
            "    time.sleep(600)\n"
            "setattr(e, name, stop)\n"
            "from shardgen.run.runner import prepare_run\nfrom tests.conftest import compose_cfg\n"
            f"prepare_run(compose_cfg('run_dir={run_dir}', 'prompts.path={prompts}', *{FAST!r}, "
            "'samples_per_shard=16'))\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.time() + 120
        while not flag.exists():
            assert p.poll() is None and time.time() < deadline, "the job ended before the kill point"
            time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    left = list(run_dir.glob(".plan-*")) if where == "planning" else list((run_dir / "plan").glob("ext-*"))
    assert left  # what the kill left behind: a temp dir, or an extension with the fingerprint not yet updated
    r = _gen(run_dir, prompts, "samples_per_shard=16")
    assert (r.complete, r.ok, r.generated_here) == (True, 60, 20)
    assert [e.name for e in (run_dir / "plan").glob("ext-*")] == ["ext-000001"]
    assert not list(run_dir.glob(".plan-*"))
    assert jobs.verify.main([str(run_dir)]) == 0


@pytest.mark.parametrize("fmt", ["txt", "csv"])
def test_an_extension_has_shard_digests_and_an_edit_of_appended_rows_is_refused(tmp_path, fmt):
    """Appended rows are an extension, not a changed file: every shard reads back; a same-size edit of an
    appended row is then refused for its shard only (in-process, no generation)."""
    from shardgen.dataio.resume.extend import extend_if_appended
    from shardgen.dataio.prompts.plan import build_plan, file_sha256
    from shardgen.dataio.prompts.read import PromptSource
    from shardgen.dataio.prompts.read import PromptFileError
    from shardgen.dataio.rundir.fileio import atomic_write_json
    from shardgen.dataio.rundir.layout import RunDir

    path = write_lines(tmp_path / f"p.{fmt}", (["prompt"] if fmt == "csv" else []) + [f"thing {i}" for i in range(10)])
    run, src = RunDir(tmp_path / "run"), PromptSource(str(path), fmt)
    run.root.mkdir()
    build_plan(run, src, samples_per_shard=4, run_seed=0, prompt_sha256=file_sha256(path))  # shards 0..2
    fp = {"model.name": "tiny", "steps": 1, "prompts.sha256": file_sha256(path)}
    atomic_write_json(run.fingerprint_path, fp)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(f"new thing {i}\n" for i in range(6)))
    plan = extend_if_appended(run, dict(fp, **{"prompts.sha256": file_sha256(path)}), src, path.stat().st_size,
                              lambda: None)
    assert plan.num_shards == 5 and (run.plan_dir / "ext-000001" / "digests.npy").is_file()
    assert [r.prompt for s in range(5) for r in plan.rows(s)] == \
        [f"thing {i}" for i in range(10)] + [f"new thing {i}" for i in range(6)]
    path.write_bytes(path.read_bytes().replace(b"new thing 4", b"new thing X"))  # row 14: shard 4, same size
    assert [r.prompt for r in plan.rows(3)] == [f"new thing {i}" for i in range(4)]  # other shards untouched
    with pytest.raises(PromptFileError, match="changed since the run was planned.*shard 000004"):
        plan.rows(4)


def test_a_damaged_extension_of_a_run_directory_gets_one_fix_and_keeps_its_plan(tmp_path):
    """A damaged file of an extended run's plan: the error names that file and one fix (restore plan/, or a new
    run_dir), not also a rebuild by deleting the extension; nothing of the plan is moved or deleted."""
    from shardgen.dataio.resume.extend import extend_if_appended
    from shardgen.dataio.resume.repair import load_plan_or_discard
    from shardgen.dataio.prompts.plan import build_plan, file_sha256
    from shardgen.dataio.prompts.read import PromptSource
    from shardgen.dataio.rundir.fileio import atomic_write_json
    from shardgen.dataio.rundir.layout import RunDir, RunDirError

    path = write_lines(tmp_path / "p.txt", [f"thing {i}" for i in range(10)])
    run, src = RunDir(tmp_path / "run"), PromptSource(str(path), "txt")
    run.root.mkdir()
    build_plan(run, src, samples_per_shard=4, run_seed=0, prompt_sha256=file_sha256(path))
    atomic_write_json(run.fingerprint_path, {"model.name": "tiny", "steps": 1, "prompts.sha256": file_sha256(path)})
    with open(path, "a", encoding="utf-8") as f:
        f.write("new thing\n")
    extend_if_appended(run, {"model.name": "tiny", "steps": 1, "prompts.sha256": file_sha256(path)}, src,
                       path.stat().st_size, lambda: None)
    starts = run.plan_dir / "ext-000001" / "starts.npy"
    starts.write_bytes(b"garbage")
    before = sorted(p.relative_to(run.root) for p in run.plan_dir.rglob("*"))
    with pytest.raises(RunDirError) as e:
        load_plan_or_discard(run, str(path))
    msg = str(e.value)
    assert msg.startswith(f"{starts}: unreadable ("), msg
    assert "was extended with appended prompts" in msg and msg.endswith("or start a new run_dir")
    assert "re-run the same command to rebuild it" not in msg
    assert sorted(p.relative_to(run.root) for p in run.plan_dir.rglob("*")) == before


def test_an_extension_deleted_from_a_run_stops_the_launch_and_the_tools_and_loses_nothing(tmp_path, capsys):
    """A grown run whose plan/ext-000001 is deleted: the first rows' plan alone is whole, and taken as the run's plan
    it would finish the run as complete without the appended prompts and move their shards to stray/. The launch
    refuses in one line naming the extension, jobs.status and jobs.verify say the same, every committed shard stays;
    the extension restored, the run goes on and takes the next append."""
    import jobs.status
    from shardgen.dataio.rundir.storage import RunDirError

    run_dir, prompts = tmp_path / "run", write_lines(tmp_path / "p.txt", [f"thing {i}" for i in range(10)])
    assert _gen(run_dir, prompts, "samples_per_shard=4").complete
    _append(prompts, [f"new thing {i}" for i in range(6)])
    assert _gen(run_dir, prompts, "samples_per_shard=4").ok == 16
    committed, ext = _committed(run_dir, range(5)), run_dir / "plan" / "ext-000001"
    backup = tmp_path / "ext-backup"
    shutil.copytree(ext, backup)
    (ext / "starts.npy").write_bytes(b"garbage")  # damaged: the tools give the one fix an extended run has
    capsys.readouterr()
    assert jobs.status.main([str(run_dir)]) != 0
    err = capsys.readouterr().err
    assert f"{ext / 'starts.npy'}: unreadable (" in err and "re-run the same command" not in err
    assert err.rstrip().endswith("Restore plan/ from a backup, or start a new run_dir"), err
    shutil.rmtree(ext)
    missing = f"the extension that planned the appended rows ({ext}) is missing"
    with pytest.raises(RunDirError, match="Restore plan/ from a backup, or start a new run_dir") as e:
        _gen(run_dir, prompts, "samples_per_shard=4")
    assert missing in str(e.value)
    capsys.readouterr()
    assert jobs.status.main([str(run_dir)]) != 0 and missing in capsys.readouterr().err
    assert jobs.verify.main([str(run_dir)]) != 0 and missing in capsys.readouterr().err
    assert _committed(run_dir, range(5)) == committed and not (run_dir / "stray").exists()
    shutil.move(backup, ext)
    _append(prompts, ["one more thing"])
    r = _gen(run_dir, prompts, "samples_per_shard=4")
    assert (r.complete, r.ok, r.generated_here) == (True, 17, 1)
    assert _committed(run_dir, range(5)) == committed


def test_the_tools_give_an_extended_run_whose_plan_json_cannot_be_read_the_extended_runs_fix(tmp_path, capsys):
    """plan.json unreadable as a file (a directory in its place) in a grown run: jobs.status says to restore plan/,
    not to re-run the generate command (which refuses to plan a grown run again)."""
    import jobs.status

    run_dir, prompts = tmp_path / "run", write_lines(tmp_path / "p.txt", [f"thing {i}" for i in range(6)])
    assert _gen(run_dir, prompts, "samples_per_shard=4").complete
    _append(prompts, ["new thing"])
    assert _gen(run_dir, prompts, "samples_per_shard=4").ok == 7
    (run_dir / "plan" / "plan.json").unlink()
    (run_dir / "plan" / "plan.json").mkdir()
    capsys.readouterr()
    assert jobs.status.main([str(run_dir)]) != 0
    err = capsys.readouterr().err
    assert f"{run_dir / 'plan' / 'plan.json'} is damaged (" in err and "re-run the generate command" not in err
    assert err.rstrip().endswith("Restore plan/ from a backup, or start a new run_dir"), err
