"""``shardgen COMMAND``: the console entry point runs the jobs' programs with their arguments and exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardgen.cli import main
from tests.conftest import ROOT


def test_shardgen_status_is_python_m_jobs_status(tmp_path, capsys):
    assert main(["status", str(tmp_path / "none")]) == 2
    assert "not a shardgen run directory" in capsys.readouterr().err


def test_an_unknown_command_or_key_is_one_line_naming_the_close_one(capsys):
    assert main(["stats", "runs/x"]) == 2
    assert capsys.readouterr().err.startswith("shardgen: no command 'stats' (did you mean status?); the commands are ")
    assert main(["generate", "batchsize=4"]) == 2
    assert "no key 'batchsize' (did you mean batch_size?)" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "  verify" in capsys.readouterr().out


PROBE = '''
import atexit, sys, threading, time
from shardgen.cli import run_program

class Collected:
    def __del__(self):
        print("interpreter teardown", flush=True)

kept = Collected()  # collected only by the interpreter's teardown
atexit.register(lambda: print("atexit handler", flush=True))

def main():
    if "thread" in sys.argv:
        threading.Thread(target=lambda: time.sleep(0.5) or print("worker thread done", flush=True),
                         daemon=False).start()
    print("unflushed line", end="")
    return int(sys.argv[1]) if sys.argv[1:2] != ["msg"] else sys.exit("refused: a message")

if __name__ == "__main__":
    run_program(main, "probe")
'''


def _probe(tmp_path, *args) -> subprocess.CompletedProcess:
    (tmp_path / "probe.py").write_text(PROBE, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "probe", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_program_ends_with_its_status_after_atexit_and_flushed_output_but_without_the_interpreters_teardown(tmp_path):
    """The jobs' programs skip the interpreter's teardown (1-3 s of collecting torch's modules after the last line):
    the status, the atexit handlers and everything printed are kept."""
    p = _probe(tmp_path, "3")
    assert p.returncode == 3 and p.stdout == "unflushed lineatexit handler\n", p
    p = _probe(tmp_path, "msg")
    assert p.returncode == 1 and p.stderr.strip() == "refused: a message"
    # a thread the interpreter would wait for: then it exits as ever, teardown included
    p = _probe(tmp_path, "0", "thread")
    assert p.returncode == 0 and "worker thread done" in p.stdout and "interpreter teardown" in p.stdout, p


def test_a_program_run_in_another_process_raises_systemexit_as_before():
    from shardgen.cli import run_program

    with pytest.raises(SystemExit) as e:
        run_program(lambda: 4, "jobs.status")  # this process is pytest's, not jobs.status's
    assert e.value.code == 4


def test_a_tool_run_with_its_stdout_closed_exits_0_and_the_program_exit_flushes_nothing_it_lacks(tmp_path):
    """``jobs.status RUN >&-`` (a cron line that only wants the exit status): no traceback, status 0 for a run."""
    from jobs.generate import run
    from tests.conftest import compose_cfg

    run(compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts.limit=2", "steps=1", "progress=false"))
    p = subprocess.run(["bash", "-c", 'exec "$0" -m jobs.status "$1" >&-', sys.executable, str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]


def _help(*cmd: str, stdout) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", *cmd, "--help"], cwd=ROOT, env=env, stdout=stdout,
                            stderr=subprocess.PIPE, text=True)


def test_help_into_a_full_device_is_one_line_and_status_1():
    with open("/dev/full", "w") as full:
        p = _help("jobs.generate", stdout=full)
        err = p.communicate(timeout=120)[1]
    assert p.returncode == 1 and "Traceback" not in err, err
    assert err == ("jobs.generate: cannot write to standard output (No space left on device); send the output where "
                   "there is room (nothing else failed)\n")


@pytest.mark.parametrize("cmd", [("jobs.generate",), ("shardgen.cli", "generate")])
def test_help_into_a_pipe_whose_reader_stops_ends_quietly(cmd):
    p = _help(*cmd, stdout=subprocess.PIPE)
    p.stdout.close()  # `| head -c 0`: the reader is gone before the help is written (Python starts in ~0.1 s)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 141 and err == "", err
