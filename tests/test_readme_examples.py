"""Every runnable example of README.md, run as shown, section by section, and its shown output compared.

The convention (README.md's "Tests" section says the same, for whoever adds an example):

* A fenced block is a command block when it is tagged ``bash``/``sh``/``console``, has a ``$ `` line, or is
  untagged and its first line that is not a comment starts with ``python``. ``python`` blocks are snippets.
  Other blocks (``json``, ``yaml``, a directory tree, an error message quoted alone) are shown, not run.
* In a block with ``$ `` lines, each ``$ `` line is a command, and the lines under it, up to the next ``$ `` line,
  are its shown output. In a block without, each line that is not a comment is a command, and the ``# `` lines
  directly under it (no blank line between) are its shown output; a comment above a command, or after a blank
  line, only describes. A line ending in ``\\`` continues on the next; ``<<'EOF'`` heredocs are part of their
  command.
* Shown output is compared fragment by fragment: each shown line, split at ``...``, must appear in what the
  command printed (stdout and stderr), in order, after masking what varies on every run (log times, durations,
  rates, the example's own directory, written as ``<dir>/`` or left out; a sha256 shown as ``<sha256>`` stands for
  any, where the bytes hashed differ from run to run). A command whose shown output has an
  ``error:`` or ``[ERROR]`` line must fail; any other must exit 0.
* A ``python -m jobs.generate`` command with no shown output runs with ``prompts.limit=8 steps=1`` added (only its
  success is checked: it makes every sample, none fails, it is not "already complete"); with shown output it runs
  exactly as written.
* Each section (any ``##``-``####`` heading) runs in a fresh directory that holds a copy of the quick start's
  ``runs/default``, so its examples may read that run and need run_dirs of their own. A section's ``python``
  snippets run there after the commands before them, in the README's order.
* Commands that need what a CI machine has not got are skipped for the reason ``NEEDS`` gives (a GPU, a real
  model, torchrun, SLURM, the internet, node_exporter); files the README asks the reader to fetch are made by
  ``FETCHED``; what a section needs set up beyond that is ``SETUP``'s (the object-storage section's buckets, on the
  moto S3 server of tests/s3_server.py).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")

# (pattern in the command, why a CI machine cannot run it)
NEEDS = [
    (r"^(pip |python3 -m venv)", "installs packages: needs the internet"),
    (r"^python -m pytest", "the test suite itself"),
    (r"^torchrun|slurm_cluster\.sh| torchrun ", "needs torchrun over several GPUs or nodes"),
    (r"launcher=slurm", "needs a SLURM cluster"),
    (r"launcher=ray", "needs a Ray cluster with room for the replicas: tests/test_ray.py runs launcher=ray on a "
                      "two-node one"),
    (r"^(?!.*dry_run=true).*\bmodel=(?!tiny)", "needs a GPU and a large model's weights"),
    (r"^python benchmarks/", "a GPU benchmark (H200 figures)"),
    (r"node_exporter", "needs node_exporter"),
    (r"--lpips-backbone|--clip ", "needs trained LPIPS/CLIP weight files: tests/test_quality.py and test_lpips.py run "
                                  "these options on random ones"),
    (r"launcher\.nprocs=4", "4 ranks take ~25 s on 2 cores; tests/test_cfg_parallel.py runs that path"),
    (r"^python -m jobs\.generate strategy=tp tp_degree=4 run_dir", "4 ranks take ~25 s on 2 cores; "
                                                                   "tests/test_images_per_prompt.py runs a plain "
                                                                   "strategy=tp tp_degree=2"),
]
# files the README asks the reader to download, made small here
FETCHED = {
    "PartiPrompts.tsv": "Prompt\tCategory\tChallenge\tNote\n" + "".join(f"prompt {i}\tAnimals\tBasic\t\n"
                                                                        for i in range(10)),
}


def object_storage(request, where: Path) -> None:
    """The buckets the object-storage section reads and writes, on the moto S3 server (its endpoint and
    credentials in the environment), with the example prompts as the parquet file it names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = request.getfixturevalue("s3").fs()
    for bucket in ("captions", "datasets"):
        if fs.exists(bucket):  # a server kept from an earlier session (SHARDGEN_TEST_S3_ENDPOINT): emptied, as new
            fs.rm(fs.find(bucket))
        else:
            fs.mkdir(bucket)
    lines = (ROOT / "examples" / "prompts.txt").read_text(encoding="utf-8").splitlines()
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"prompt": lines}), sink)
    fs.pipe("s3://captions/prompts.parquet", sink.getvalue().to_pybytes())


# what a section's examples need that the README tells the reader to have (a bucket, a server)
SETUP = {"Prompts and shards on object storage": object_storage}
NO_OUTPUT_EXTRA = ("prompts.limit=8", "steps=1")
FAILS = re.compile(r"^error: |\[ERROR\]", re.M)


@dataclass
class Command:
    text: str  # as a shell would run it (continuations joined, heredoc included)
    shown: list[str] = field(default_factory=list)  # its shown output lines


@dataclass
class Block:
    lang: str
    lines: list[str]

    @property
    def is_commands(self) -> bool:
        first = next((l for l in self.lines if l.strip() and not l.startswith("#")), "")
        return (self.lang in ("bash", "sh", "console") or any(l.startswith("$ ") for l in self.lines)
                or (self.lang == "" and first.startswith("python")))


def sections(text: str) -> list[tuple[str, list[Block]]]:
    """The README's sections (any ## to #### heading) with their fenced blocks, in order."""
    out: list[tuple[str, list[Block]]] = [("", [])]
    fence: Block | None = None
    for line in text.splitlines():
        if fence is not None:
            if line.startswith("```"):
                out[-1][1].append(fence)
                fence = None
            else:
                fence.lines.append(line)
        elif line.startswith("```"):
            fence = Block(line[3:].strip(), [])
        elif m := re.match(r"#{2,4} (.+)", line):
            out.append((m.group(1).strip(), []))
    return [s for s in out if s[0]]


def _take_command(lines: list[str], i: int, first: str) -> tuple[str, int]:
    """The command starting at ``lines[i]`` (``first`` is its text): continuation lines and a heredoc joined."""
    text = first
    while text.endswith("\\") and i + 1 < len(lines):
        i += 1
        text = text[:-1] + " " + lines[i].strip()
    if m := re.search(r"<<'?(\w+)'?", text):
        while i + 1 < len(lines):
            i += 1
            text += "\n" + lines[i]
            if lines[i].strip() == m.group(1):
                break
    return text, i + 1


def commands(block: Block) -> list[Command]:
    """A command block's commands with their shown output (the module docstring's convention)."""
    lines, out, i = block.lines, [], 0
    session = any(l.startswith("$ ") for l in lines)
    while i < len(lines):
        line = lines[i]
        if session and line.startswith("$ "):
            text, i = _take_command(lines, i, line[2:])
            out.append(Command(text))
        elif not session and line.strip() and not line.startswith("#"):
            text, i = _take_command(lines, i, line)
            cmd = Command(text)
            while i < len(lines) and lines[i].startswith("#"):
                cmd.shown.append(lines[i][1:].removeprefix(" "))
                i += 1
            out.append(cmd)
        else:
            if session and out:
                out[-1].shown.append(line)
            i += 1
    return out


def needs(text: str) -> str | None:
    """Why CI cannot run this command, or None."""
    return next((why for pattern, why in NEEDS if re.search(pattern, text)), None)


def mask(text: str, where: Path) -> str:
    """What varies on every run, made equal: log times, durations, rates, the example's directory; whitespace."""
    text = re.sub(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]", "", text)
    text = text.replace(f"{where}/", "").replace(str(where), "").replace("<dir>/", "")
    text = re.sub(r"\b\d+(\.\d+)? s\b", "<t> s", text)
    text = re.sub(r"\b\d+m\d+s\b", "<t>", text)
    text = re.sub(r"\b\d+(\.\d+)? (images|videos|samples|img|video)/s\b", r"<r> \2/s", text)
    return " ".join(text.split())


def progress_bars_dropped(out: str) -> str:
    """tqdm redraws its bar with carriage returns; the bars are not part of what a run reports."""
    return "\n".join(part for line in out.splitlines() for part in line.split("\r")
                     if not re.search(r"\d+%\|.*\| *\d+/\d+ \[", part))


def assert_shown(cmd: Command, out: str | tuple[str, ...], where: Path) -> None:
    """Each shown fragment appears in ``out`` in order (in order within its stream, when stdout and stderr come
    apart)."""
    streams = [mask(progress_bars_dropped(s), where) for s in ((out,) if isinstance(out, str) else out)]
    if any("<sha256>" in line for line in cmd.shown):  # the README marks a digest that differs on every run
        streams = [re.sub(r"\b[0-9a-f]{64}\b", "<sha256>", s) for s in streams]
    pos = [0] * len(streams)
    for line in progress_bars_dropped("\n".join(cmd.shown)).splitlines():  # a bar is shown for what it looks like
        for frag in (mask(f, where) for f in line.split("...")):
            if not frag:
                continue
            found = [(s.find(frag, p), i) for i, (s, p) in enumerate(zip(streams, pos)) if s.find(frag, p) >= 0]
            assert found, f"\n$ {cmd.text}\nshown:   {frag!r}\nnot in:  {[s[p:] for s, p in zip(streams, pos)]!r}"
            at, i = found[0]
            pos[i] = at + len(frag)


def _shell_operators(text: str) -> bool:
    """Whether the command line has a pipe, redirection or list operator outside its quotes."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, ""
    return any(set(token) <= set("|&;<>()") for token in lex)


class Example:
    """Runs one section's commands and snippets in its own directory."""

    def __init__(self, where: Path, capfd, monkeypatch):
        self.where, self.capfd, self.monkeypatch = where, capfd, monkeypatch
        self.env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(self, cmd: Command) -> tuple[int, str | tuple[str, str]]:
        """The exit status and output of one command (interleaved, or in-process as stdout and stderr)."""
        argv = shlex.split(cmd.text, comments=True)
        if argv[0] == "export":
            for name, value in (a.split("=", 1) for a in argv[1:]):
                self.env.setdefault(name, value)  # the test's S3 server and credentials stand for the shown ones
            return 0, ""
        text = cmd.text
        if argv[:3] == ["python", "-m", "jobs.generate"] and not cmd.shown:
            text += "".join(f" {x}" for x in NO_OUTPUT_EXTRA if x.split("=")[0] + "=" not in text)
        if self.capfd and argv[:3] == ["python", "-m", "jobs.generate"] and not re.search(r"[|;&<>]", text):
            return self.generate(shlex.split(text, comments=True)[3:])
        if self.capfd and argv[:2] == ["python", "-c"] and len(argv) == 3 and not _shell_operators(text):
            return self.python_c(argv[2])
        p = subprocess.run(["bash", "-c", text], cwd=self.where, env=self.env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=600)
        return p.returncode, p.stdout

    def generate(self, args: list[str]) -> tuple[int, str]:
        """``python -m jobs.generate ARGS`` in this process (a new interpreter costs seconds of imports each)."""
        from jobs import generate

        self.capfd.readouterr()
        self.monkeypatch.setattr(sys, "argv", [str(ROOT / "jobs" / "generate.py"), *args])
        # Hydra points the root logger at this test's captured stream: given back afterwards, for the next tests
        self.monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
        self.monkeypatch.setattr(logging.root, "level", logging.root.level)
        with self.monkeypatch.context() as m:
            for k, v in self.env.items():
                if os.environ.get(k) != v:
                    m.setenv(k, v)
            m.setenv("HYDRA_MAIN_MODULE", "__main__")  # conf/ found next to jobs/generate.py, as when run with -m
            try:
                generate.entry(args)
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
        got = self.capfd.readouterr()
        return rc, (got.out, got.err)

    def python_c(self, code: str) -> tuple[int, tuple[str, str]]:
        """``python -c CODE`` in this process, in the example's directory (a new interpreter costs seconds of
        imports: the README's ``python -c`` lines import the library)."""
        self.capfd.readouterr()
        with self.monkeypatch.context() as m:
            for k, v in self.env.items():
                if os.environ.get(k) != v:
                    m.setenv(k, v)
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
        got = self.capfd.readouterr()
        return rc, (got.out, got.err)

    def snippet(self, code: str) -> None:
        """A ``python`` block, run as written, in this directory."""
        from webdataset.gopen import gopen_schemes

        schemes = dict(gopen_schemes)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, "<README python block>", "exec"), {"__name__": "__readme__"})
        finally:
            gopen_schemes.clear()
            gopen_schemes.update(schemes)

    def section(self, blocks: list[Block]) -> list[str]:
        """Run every block of a section in order; the commands skipped, with why."""
        skipped = []
        for block in blocks:
            if block.lang == "python":
                self.snippet("\n".join(block.lines))
                continue
            if not block.is_commands:
                continue
            for cmd in commands(block):
                if why := needs(cmd.text):
                    skipped.append(f"{cmd.text.splitlines()[0]}: {why}")
                    continue
                if not cmd.shown and cmd.text in shown_later(blocks, cmd):
                    continue  # the same command is shown again with its output below: run there
                rc, out = self.run(cmd)
                self.check(cmd, rc, out)
        return skipped

    def check(self, cmd: Command, rc: int, out: str | tuple[str, str]) -> None:
        """The exit status the shown output implies, the shown output, or (none shown) a run that made its samples."""
        text = out if isinstance(out, str) else "\n".join(out)
        expect_failure = any(FAILS.search(l) for l in cmd.shown)
        assert (rc != 0) == expect_failure, f"$ {cmd.text}\nexit {rc}\n{text[-3000:]}"
        if cmd.shown:
            assert_shown(cmd, out, self.where)
        elif cmd.text.startswith("python -m jobs.generate") and "dry_run=true" not in cmd.text:
            assert "already complete" not in text, text[-2000:]
            assert re.search(r": \d+ (images|videos), 0 failed", text), f"$ {cmd.text}\n{text[-3000:]}"


def shown_later(blocks: list[Block], cmd: Command) -> set[str]:
    """The section's commands that are shown with their output (a bare command repeated there runs only there)."""
    return {c.text for b in blocks if b.is_commands for c in commands(b) if c.shown and c is not cmd}


def runnable(blocks: list[Block]) -> bool:
    """Whether a section has anything this machine can run."""
    return any(b.lang == "python" or (b.is_commands and any(not needs(c.text) for c in commands(b)))
               for b in blocks)


SECTIONS = dict(sections(README))
QUICK_START = "Quick start"
RUNNABLE = [title for title, blocks in SECTIONS.items() if title != QUICK_START and runnable(blocks)]


def fresh_dir(path: Path) -> Path:
    """A directory for a section's examples, with the files the README asks the reader to download."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in FETCHED.items():
        (path / name).write_text(text)
    return path


@contextlib.contextmanager
def captured_fds():
    """What capfd captures (stdout and stderr, their file descriptors included; ``readouterr()``), for the
    module-scoped quick start, which cannot ask for the function-scoped capfd."""
    from _pytest.capture import FDCapture, MultiCapture

    cap = MultiCapture(in_=None, out=FDCapture(1), err=FDCapture(2))
    cap.start_capturing()
    try:
        yield cap
    finally:
        cap.stop_capturing()


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The quick start run as shown (the 64 example prompts), in its own directory: the run other sections copy."""
    where = fresh_dir(tmp_path_factory.mktemp("quick-start"))
    with pytest.MonkeyPatch.context() as mp, captured_fds() as cap:
        mp.chdir(where)
        skipped = Example(where, cap, mp).section(SECTIONS[QUICK_START])
    assert (where / "runs" / "default" / "summary.json").is_file()
    return where, skipped


@pytest.mark.slow
def test_the_quick_start_runs_as_shown(quick_start):
    where, skipped = quick_start
    assert any("pip install" in s for s in skipped)  # the set-up lines are recognised, not run
    print("\n".join(skipped))


@pytest.mark.slow
@pytest.mark.parametrize("title", RUNNABLE)
def test_a_readme_section_runs_as_shown(title, quick_start, tmp_path, capfd, monkeypatch, request):
    """The section's commands and snippets, in order, in a directory of their own with the quick start's run."""
    where = fresh_dir(tmp_path / "example")
    shutil.copytree(quick_start[0] / "runs" / "default", where / "runs" / "default")
    monkeypatch.chdir(where)
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", where / ".hf")  # load_dataset's cache: not in $HOME
    if title in SETUP:
        SETUP[title](request, where)
    skipped = Example(where, capfd, monkeypatch).section(SECTIONS[title])
    print("\n".join(skipped))


def test_the_harness_finds_the_readmes_examples_and_their_shown_output():
    assert {"Quick start", "Usage", "LoRA adapters", "Video (Wan text-to-video)", "Output: the run directory",
            "Metrics for Prometheus"} <= set(RUNNABLE) | {QUICK_START}
    quick = [c for b in SECTIONS[QUICK_START] if b.is_commands for c in commands(b)]
    assert [c.text for c in quick if c.shown][:2] == ["python -m jobs.generate"] * 2
    lora = [c for b in SECTIONS["LoRA adapters"] if b.is_commands for c in commands(b)]
    assert lora[1].shown[0] == "[shardgen.lora][INFO] LoRA fused: [style.safetensors x0.8]"
    assert needs("torchrun --nproc-per-node 8 -m jobs.generate") and not needs("python -m jobs.generate model=tiny")
    assert needs("python -m jobs.generate model=flux_dev") and not needs("python -m jobs.generate dry_run=true "
                                                                         "model=flux_dev")


def test_masking_keeps_counts_and_hashes_unless_marked_and_drops_what_varies(tmp_path):
    shown = Command("x", ["<dir>/runs/a: 8 images, 0 failed ... in 29.1 s (0.27 images/s)"])
    assert_shown(shown, f"[2026-01-01 00:00:00,001][shardgen] {tmp_path}/runs/a: 8 images, 0 failed, 0 rejected "
                        "of 8 prompts; in 3.0 s (2.67 images/s)\n", tmp_path)
    with pytest.raises(AssertionError, match="not in"):
        assert_shown(shown, f"{tmp_path}/runs/a: 7 images, 0 failed in 3.0 s (2.67 images/s)", tmp_path)
    digest = "0a587f7d10052e0bd7a228063dc98e9a724ca7854f725f891c5f07f37ddc52b8"
    assert_shown(Command("x", ["sha256 <sha256>"]), f"sha256 {digest}", tmp_path)
    with pytest.raises(AssertionError, match="not in"):
        assert_shown(Command("x", [f"sha256 {digest}"]), f"sha256 {digest[::-1]}", tmp_path)
