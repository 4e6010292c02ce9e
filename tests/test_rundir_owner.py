"""A run_dir that is not a run is never written into or cleaned up: a user's files in it survive,
``/``, the home directory and an empty run_dir are refused, and a bad prompt file refused at launch leaves
nothing behind. Runs made before the owner record existed are still accepted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shardgen.dataio.prompts.read import PromptFileError
from shardgen.dataio.rundir.layout import RUN_MARKER, RunDir
from shardgen.dataio.rundir.storage import RunDirError
from tests.test_integrity import copy, gen, reference  # noqa: F401 (fixtures)


def _user_files(d: Path) -> dict[Path, bytes | str]:
    """A user's own files of the kinds clean-up used to delete: a .plan-* directory, an old .tmp file, a link
    in logs/. What each holds (a link: its target)."""
    (d / ".plan-backup").mkdir(parents=True)
    (d / ".plan-backup" / "plan.json").write_bytes(b"my backup")
    (d / ".session.tmp").write_bytes(b"my session")
    (d / "shards").mkdir(exist_ok=True)
    (d / "shards" / ".notes.tmp").write_bytes(b"my notes")
    (d / "logs").mkdir(exist_ok=True)
    (d / "logs" / "latest").symlink_to("/var/log")
    old = time.time() - 7 * 86400  # a week old: older than any leftover age
    for p in (d / ".plan-backup", d / ".session.tmp", d / "shards" / ".notes.tmp"):
        os.utime(p, (old, old))
    return {d / ".plan-backup" / "plan.json": b"my backup", d / ".session.tmp": b"my session",
            d / "shards" / ".notes.tmp": b"my notes", d / "logs" / "latest": "/var/log"}


def _intact(files: dict) -> bool:
    return all(os.readlink(p) == v if isinstance(v, str) else p.read_bytes() == v for p, v in files.items())


def test_a_directory_of_user_files_is_refused_and_left_as_it_was(tmp_path, reference):
    d = tmp_path / "mine"
    files = _user_files(d)
    before = sorted(p.name for p in d.rglob("*"))
    with pytest.raises(RunDirError, match=r"holds files .*\.plan-backup.* and is not a shardgen run .*Choose another"):
        gen(d, reference[0])
    assert _intact(files) and sorted(p.name for p in d.rglob("*")) == before  # nothing added, nothing removed


def test_a_users_files_inside_a_run_survive_every_launch(copy):
    prompts, d, _ = copy
    files = _user_files(d)
    (d / "shards" / "000000.stats.json").unlink()  # work for the launch: the repair path runs
    gen(d, prompts)
    gen(d, prompts)
    assert _intact(files)


@pytest.mark.parametrize("where", ["", "/", "home"])
def test_root_home_and_an_empty_run_dir_are_refused(where, tmp_path, reference, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.tmp").write_bytes(b"x")
    if where == "home":
        home = tmp_path / "home"
        home.mkdir()
        monkeypatch.setenv("HOME", str(home))
        where = str(home)
    with pytest.raises(RunDirError, match=r"run_dir is empty|the root directory|your home directory"):
        gen(where, reference[0]) if where else _gen_text("", reference[0])
    assert sorted(os.listdir(tmp_path)) == sorted(["old.tmp", *(["home"] if "home" in where else [])])
    assert not any(Path("/", n).exists() for n in ("claims", "plan", "shards", RUN_MARKER))


def _gen_text(run_dir: str, prompts: Path):
    from jobs.generate import run
    from tests.conftest import compose_cfg
    from tests.test_integrity import ARGS

    return run(compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *ARGS))


def test_tools_refuse_an_empty_run_dir_argument(capsys):
    from jobs import status

    with pytest.raises(SystemExit) as e:
        status.main([""])
    assert e.value.code == 2 and "the run directory is empty" in capsys.readouterr().err


def test_a_run_of_the_previous_version_without_the_owner_record_is_accepted(copy):
    prompts, d, want = copy
    (d / RUN_MARKER).unlink()  # made before the record existed: plan/ claims/ shards/ and fingerprint.json
    (d / "shards" / "000001.stats.json").unlink()
    assert gen(d, prompts).complete
    assert (d / RUN_MARKER).is_file()  # adopted: marked from now on


def test_an_empty_existing_directory_becomes_a_run(tmp_path, reference):
    d = tmp_path / "empty"
    d.mkdir()
    assert gen(d, reference[0]).complete and (d / RUN_MARKER).is_file()


@pytest.mark.parametrize("existing", [False, True])
def test_a_bad_row_at_line_2_leaves_nothing_behind(existing, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 3}\n{"prompt": "fine too"}\n')
    d = tmp_path / "deep" / "run"
    if existing:
        d.mkdir(parents=True)
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: the prompt is not a string"):
        gen(d, prompts, "prompts.format=jsonl")
    if existing:
        assert os.listdir(d) == []  # the empty directory stays empty: no claims/ logs/ shards/ work/
    else:
        assert not (tmp_path / "deep").exists()  # not even the directories on the way


def test_clean_up_removes_only_shardgens_own_names(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    old = time.time() - 7 * 86400
    ours = [run.root / ".summary.json~otherhost~12~abcd1234.tmp", run.root / ".plan-otherhost-12-abcd1234",
            run.shards_dir / ".000000.parquet~otherhost~12~a1b2c3d4.tmp"]
    theirs = [run.root / ".summary.json.tmp", run.root / ".plan-backup", run.root / ".plan-", run.shards_dir / "x.tmp",
              run.root / ".a~b~c~d.tmp"]
    for p in ours + theirs:
        p.mkdir() if "plan-" in p.name else p.write_bytes(b"x")
        os.utime(p, (old, old))
    removed = run.clean_leftovers()
    assert sorted(removed) == sorted(ours) and all(p.exists() for p in theirs)


def test_a_dry_run_refuses_a_directory_of_user_files_too(tmp_path):
    from jobs.generate import run
    from tests.conftest import compose_cfg, write_lines

    d = tmp_path / "mine"
    files = _user_files(d)
    prompts = write_lines(tmp_path / "p.txt", ["a photo of a cat"])
    with pytest.raises(RunDirError, match=f"run_dir {d} holds files .* is not a shardgen run"):
        run(compose_cfg(f"run_dir={d}", f"prompts.path={prompts}", "dry_run=true", "progress=false"))
    assert _intact(files) and sorted(os.listdir(d)) == [".plan-backup", ".session.tmp", "logs", "shards"]
