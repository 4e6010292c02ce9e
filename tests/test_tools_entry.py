"""The operator tools share one entry (shardgen/tools/entry.py): a run directory without a plan, or with a damaged
one, is one line on stderr and exit status 2 from each of them, never a traceback."""

from __future__ import annotations

import importlib

import pytest

PLAN_TOOLS = ["status", "verify", "report", "signals", "preview"]


@pytest.mark.parametrize("tool", PLAN_TOOLS)
def test_a_directory_without_a_plan_is_one_line_and_status_2(tool, tmp_path, capsys):
    main = importlib.import_module(f"jobs.{tool}").main
    assert main([str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"error: {tmp_path}: not a shardgen run directory") and "plan/plan.json" in out.err


@pytest.mark.parametrize("tool", PLAN_TOOLS)
def test_a_damaged_plan_names_its_file_and_the_fix(tool, tmp_path, capsys):
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan.json").write_text("{not json")
    assert importlib.import_module(f"jobs.{tool}").main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'plan' / 'plan.json'}: unreadable") and "re-run" in err
    assert err.count("\n") == 1


def test_plan_for_tool_raises_a_user_error_instead_of_returning_a_line(tmp_path):
    from shardgen.dataio.resume import plan_for_tool
    from shardgen.dataio.rundir.storage import RunDirError

    with pytest.raises(RunDirError, match=f"^{tmp_path}: nothing here yet$"):
        plan_for_tool(str(tmp_path), "nothing here yet")


def test_dedup_reads_no_plan_and_says_what_is_missing(tmp_path, capsys):
    from jobs.dedup import main
    from shardgen.dataio.rundir import RunDir

    RunDir.at(tmp_path).create()  # a run that has committed nothing yet (its plan not needed: dedup reads none)
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"{tmp_path}: no committed shard index (shards/*.parquet) yet\n"


@pytest.mark.parametrize("what", ["missing", "a regular file", "an empty directory", "another directory"])
def test_dedup_on_a_path_that_is_no_run_says_so_as_the_other_tools_do(what, tmp_path, capsys):
    """Not "no index yet" (a run in progress): the line verify, status and report give."""
    from jobs.dedup import main
    from shardgen.tools.entry import NO_PLAN

    path = tmp_path / "x"
    if what == "a regular file":
        path.write_text("a cat\n")
    elif what != "missing":
        path.mkdir()
        if what == "another directory":
            (path / "shards").mkdir()  # a name a run has, but no run's layout
    assert main([str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"error: {path}: {NO_PLAN}\n"


def test_a_tool_whose_reader_closes_the_pipe_stops_quietly():
    """`python -m jobs.status RUN --shards | head`: no "error: Broken pipe" once head has read its lines."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import sys; from shardgen.tools.runfiles import tool_errors\n"
            "def main():\n    for _ in range(10000):\n        print('a line of a long listing')\n    return 0\n"
            "sys.exit(tool_errors(main)())")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # the reader is done
    err = p.stderr.read().decode()
    assert (p.wait(timeout=60), err) == (141, "")


def test_status_takes_one_output_format():
    """``--json`` and ``--prometheus`` both write stdout: asking for both is refused, not answered with one."""
    from jobs.status import main as status_main

    with pytest.raises(SystemExit) as e:
        status_main(["somewhere", "--json", "--prometheus"])
    assert e.value.code == 2
