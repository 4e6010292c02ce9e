"""``shardgen COMMAND``: the console entry point runs the jobs' programs with their arguments and exit codes."""

from __future__ import annotations

from shardgen.cli import main


def test_shardgen_status_is_python_m_jobs_status(tmp_path, capsys):
    assert main(["status", str(tmp_path / "none")]) == 2
    assert "not a shardgen run directory" in capsys.readouterr().err


def test_an_unknown_command_or_key_is_one_line_naming_the_close_one(capsys):
    assert main(["stats", "runs/x"]) == 2
    assert capsys.readouterr().err.startswith("shardgen: no command 'stats' (did you mean status?); the commands are ")
    assert main(["generate", "batchsize=4"]) == 2
    assert "no key 'batchsize' (did you mean batch_size?)" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "  verify" in capsys.readouterr().out
