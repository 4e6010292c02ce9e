"""The operator tools on damaged runs: every file of a finished and of an unfinished run damaged in
each way, and each tool (status, verify, preview, report, dedup) run on it in process: an exit status and a
message, never a traceback, and never a write through a symlink."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from jobs import dedup, preview, report, signals, status, verify
from shardgen.errors import UserError
from tests.conftest import write_lines
from tests.test_integrity import gen, make_partial
from tests.test_integrity_faults import OPS as FAULT_OPS, damage_file

OPS = (*FAULT_OPS, "odd", "fifo")
TOOLS = {"status": lambda d: status.main([str(d), "--shards"]), "verify": lambda d: verify.main([str(d)]),
         "verify --repair": lambda d: verify.main([str(d), "--repair", "--no-decode"]),
         "preview": lambda d: preview.main([str(d), "--n", "4", "--size", "32"]),
         "report": lambda d: report.main([str(d)]), "dedup": lambda d: dedup.main([str(d)])}
SEED = 25


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a finished run with the phash signal, the same run unfinished: a partial shard and a missing one)."""
    d = tmp_path_factory.mktemp("tools")
    prompts = write_lines(d / "p.txt", [f"prompt {i}" for i in range(6)])
    finished = d / "finished"
    assert gen(finished, prompts, "samples_per_shard=2", "signals=[phash]").complete
    partial = d / "partial"
    shutil.copytree(finished, partial, symlinks=True)
    make_partial(partial, 1, 1)
    for name in ("000002.stats.json", "000002.tar", "000002.parquet"):
        (partial / "shards" / name).unlink()
    return finished, partial


def _run_tools(d: Path, decoy: Path, what: str, capsys) -> None:
    for name, tool in TOOLS.items():
        try:
            rc = tool(d)
        except SystemExit as e:  # argparse's own refusal (a message and status 2)
            rc = e.code
        except BaseException as e:
            raise AssertionError(f"{what}: {name} raised {type(e).__name__}: {e}") from e
        out = capsys.readouterr()
        assert rc in (0, 1, 2), f"{what}: {name} returned {rc!r}"
        assert "Traceback" not in out.err + out.out, f"{what}: {name} printed a traceback"
        if rc == 2:
            assert out.err.strip(), f"{what}: {name} refused without a message"
        assert decoy.read_bytes() == b"decoy", f"{what}: {name} wrote through a symlink"


@pytest.mark.slow
def test_every_tool_on_every_damaged_file(runs, tmp_path, capsys):
    """Each file of both runs x each way of damage (about 300 cases), each tool in process."""
    rng = random.Random(SEED)
    decoy = tmp_path / "decoy"
    cases = 0
    t0 = time.perf_counter()
    for base in runs:
        files = sorted(p.relative_to(base) for p in base.rglob("*") if p.is_file() and not p.is_symlink())
        for rel in files:
            for op in OPS:
                decoy.write_bytes(b"decoy")
                d = tmp_path / "case"
                shutil.copytree(base, d, symlinks=True)
                damage_file(d / rel, op, rng, decoy)
                with _no_hang(f"{op} {base.name}/{rel}", 60):
                    _run_tools(d, decoy, f"{op} {base.name}/{rel}", capsys)
                shutil.rmtree(d)
                cases += 1
    print(f"{cases} damaged runs x {len(TOOLS)} tools in {time.perf_counter() - t0:.1f} s")
    assert cases > 200


def test_tools_on_a_read_only_run_dir_say_so(runs, tmp_path, capsys, monkeypatch):
    """A read-only file system (root ignores chmod, so the failing write is simulated where every tool writes)."""
    import shardgen.dataio.rundir.fileio as rundir

    def read_only(*a, **k):  # as the calls fail there: naming the file or directory
        raise OSError(errno.EROFS, "Read-only file system", str(k.get("dir") or a[0]))

    d = tmp_path / "ro"
    shutil.copytree(runs[1], d, symlinks=True)
    (d / "shards" / "000000.stats.json").unlink()  # work for verify --repair: stats to write from the tar
    monkeypatch.setattr(rundir.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(rundir.os, "unlink", read_only)
    for name in ("preview", "report", "verify --repair"):
        assert TOOLS[name](d) == 2, name
        err = capsys.readouterr().err
        assert "Read-only file system" in err and str(d) in err and "Traceback" not in err, (name, err)


@pytest.mark.parametrize("argv", [["preview", "--n", "0"], ["preview", "--n", "-3"], ["preview", "--cols", "0"],
                                  ["preview", "--size", "0"], ["preview", "--out", "/nonexistent/dir/x.png"],
                                  ["report", "--out", "/nonexistent/dir/r.html"], ["report", "--out", "."],
                                  ["dedup", "--max-distance", "-1"], ["verify", "--max-lines", "-1"],
                                  ["status", "/nonexistent/run"], ["dedup", "/nonexistent/run"]])
def test_odd_arguments_are_a_message(runs, argv, capsys):
    tool = {"preview": preview, "report": report, "dedup": dedup, "verify": verify, "status": status}[argv[0]]
    args = argv[1:] if argv[1].startswith("/") else [str(runs[0]), *argv[1:]]
    try:
        rc = tool.main(args)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    assert rc in (0, 1, 2) and "Traceback" not in out.err
    if rc == 2:
        assert out.err.strip()


def test_report_escapes_the_logs_and_never_writes_through_a_link(runs, tmp_path, capsys):
    d = tmp_path / "r"
    shutil.copytree(runs[0], d, symlinks=True)
    events = next((d / "logs").glob("events.*.jsonl"))
    events.write_text('{"t": 1, "replica": "<script>alert(1)</script>", "samples": 2}\n'
                      '{"t": 2, "replica": "<script>alert(1)</script>", "samples": 2}\n')
    victim = tmp_path / "victim.html"
    victim.write_text("precious")
    (d / "report.html").symlink_to(victim)
    assert report.main([str(d)]) == 0
    page = (d / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert victim.read_text() == "precious" and not (d / "report.html").is_symlink()


@pytest.mark.parametrize("tool,target", [("preview", "shards/000000.tar"), ("report", "plan/plan.json"),
                                         ("report", "fingerprint.json"), ("preview", "new.png")])
def test_a_tools_out_never_lands_in_the_run_directory(runs, tmp_path, capsys, tool, target):
    d = tmp_path / "r"
    shutil.copytree(runs[0], d, symlinks=True)
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    argv = [str(d), "--out", str(tmp_path / "r" / "." / target)]
    assert TOOLS_BY_NAME[tool].main(argv) == 2
    err = capsys.readouterr().err
    assert "inside the run directory" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    assert TOOLS_BY_NAME[tool].main([str(d)]) == 0  # its own default output is still written


def test_a_preview_sheet_too_large_to_draw_is_refused_first(runs, capsys):
    assert preview.main([str(runs[0]), "--size", "60000"]) == 2
    assert "megapixels" in capsys.readouterr().err
    assert preview.main([str(runs[0]), "--n", "100000", "--size", "256"]) == 2


TOOLS_BY_NAME = {"preview": preview, "report": report}


class _Hang(BaseException):
    """A tool still blocked after the alarm (a BaseException: no tool's error handling takes it for its own)."""


@contextlib.contextmanager
def _no_hang(what: str, seconds: int = 20):
    def ring(*_):
        raise _Hang(f"{what} hangs")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# with generate too (test_every_tool_on_every_damaged_file puts a FIFO at every file for the tools alone)
FIFO_FILES = ("plan/plan.json", "fingerprint.json", "shards/000000.stats.json", "shards/000000.tar", "stats_cache.npz",
              "launches.jsonl")


@pytest.mark.parametrize("rel", FIFO_FILES)
def test_a_fifo_in_a_run_directory_never_blocks_a_reader(runs, tmp_path, capsys, rel):
    """A FIFO opens for reading only once someone writes to it: every reader opens run files without blocking
    and refuses what is not a regular file."""
    from tests.test_integrity import gen

    d = tmp_path / "r"
    shutil.copytree(runs[0], d, symlinks=True)
    stats_cache = d / "stats_cache.npz"
    if not stats_cache.exists():
        status.main([str(d)])
    (d / rel).unlink(missing_ok=True)
    os.mkfifo(d / rel)
    tools = dict(TOOLS, signals=lambda r: signals.main([str(r)]))
    for name, tool in tools.items():
        with _no_hang(f"{name} on a FIFO at {rel}"):
            try:
                rc = tool(d)
            except SystemExit as e:
                rc = e.code
        out = capsys.readouterr()
        assert rc in (0, 1, 2) and "Traceback" not in out.err, (name, rc, out.err)
    with _no_hang(f"generate on a FIFO at {rel}"):
        try:
            r = gen(d, runs[0].parent / "p.txt", "samples_per_shard=2", "signals=[phash]")
        except UserError as e:
            assert str(d) in str(e)
        else:
            assert r.complete


def test_status_escapes_terminal_controls_from_the_run_directory(runs, tmp_path, capsys):
    """A run directory on shared storage is someone else's input: its log lines and claims are shown, never obeyed."""
    d = tmp_path / "r"
    shutil.copytree(runs[1], d, symlinks=True)
    hostile = "\x1b]0;owned\x07\x1b[2J\x9b\u202e"
    with open(d / "logs" / "rank000.log", "a") as f:
        f.write(f"2030-01-01 00:00:00,000 ERROR shardgen: boom {hostile}\n")
    claim = next((d / "claims").iterdir())
    record = json.loads(claim.read_text())
    claim.write_text(json.dumps(dict(record, host=f"host{hostile}", job=hostile)))
    assert status.main([str(d), "--shards"]) == 0
    out = capsys.readouterr().out
    assert "boom" in out and "host" in out
    assert not any(c in out for c in "\x1b\x07\x9b\u202e") and "\\x1b]0;owned" in out


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory):
    """A finished run made without signals: work for jobs.signals."""
    from tests.test_integrity import gen

    d = tmp_path_factory.mktemp("unsigned")
    prompts = write_lines(d / "p.txt", [f"prompt {i}" for i in range(4)])
    assert gen(d / "run", prompts, "samples_per_shard=2").complete
    return d / "run"


def _drop_first_image(tar: Path) -> None:
    import io as _io
    import tarfile

    from shardgen.tools.verify import read_shard_members

    members = read_shard_members(tar)
    first = min(members)
    with tarfile.open(tar, "w") as tf:
        for key, mem in sorted(members.items()):
            for ext, data in mem.items():
                if key == first and ext == "png":
                    continue
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, _io.BytesIO(data))


@pytest.mark.parametrize("damage", ["garbage index", "damaged tar", "tar lacks an indexed image", "read-only",
                                    "disk full"])
def test_signals_on_a_damaged_or_unwritable_run_is_one_line(unsigned, tmp_path, monkeypatch, capsys, damage):
    import shardgen.tools.signals_after as signals_after

    d = tmp_path / "r"
    shutil.copytree(unsigned, d, symlinks=True)
    shards = d / "shards"
    if damage == "garbage index":
        (shards / "000000.parquet").write_bytes(b"PAR1 not really")
    elif damage == "damaged tar":
        os.truncate(shards / "000000.tar", 700)
    elif damage == "tar lacks an indexed image":
        _drop_first_image(shards / "000000.tar")
    else:
        code = errno.EROFS if damage == "read-only" else errno.ENOSPC

        def refused(path, rows):
            raise OSError(code, os.strerror(code), str(path))

        monkeypatch.setattr(signals_after, "write_index", refused)
    assert signals.main([str(d)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and str(d) in err, err


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_status_prometheus_skips_a_metrics_file_that_is_no_small_regular_file(runs, tmp_path, capsys, kind):
    d = tmp_path / "r"
    shutil.copytree(runs[0], d, symlinks=True)
    good = (d / "metrics" / "rank000.prom").read_text()
    bad = d / "metrics" / "rank001.prom"
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dev-zero":
        bad.symlink_to("/dev/zero")
    else:
        with open(bad, "wb") as f:  # sparse: 4 GiB of zeros that take no disk
            f.truncate(4 << 30)
    capsys.readouterr()
    with _no_hang(f"jobs.status --prometheus with a {kind} in metrics/", seconds=20):
        rc = status.main([str(d), "--prometheus"])
    out = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out.err, out.err
    assert 'shardgen_committed_samples_total{' in out.out and good.splitlines()[2].split(" ")[0] in out.out
