"""The README as a newcomer pastes it: commands that set up a CPU machine as written, examples that do not collide."""

from __future__ import annotations

import re
import shlex

import pytest

from shardgen.config.overrides import check_overrides
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def code_blocks(text: str) -> list[str]:
    """The fenced blocks of a markdown text."""
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """The command lines of a block as argv lists (``$ `` prompts and ``\\`` continuations joined; output skipped)."""
    out, pending = [], ""
    for line in block.splitlines():
        line = line.removeprefix("$ ")
        if pending:
            line, pending = pending + line, ""
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:  # output, not a command
            continue
        if argv:
            out.append(argv)
    return out


def generate_commands() -> list[list[str]]:
    found = []
    for block in code_blocks(README):
        for argv in commands(block):
            if "jobs.generate" in argv and "--help" not in argv:
                found.append(argv)
    return found


def test_every_example_after_the_quick_start_has_a_run_dir_of_its_own():
    found = generate_commands()
    assert found[0] == ["python", "-m", "jobs.generate"]  # the quick start: runs/default (shown again with its output)
    rest = [argv for argv in found if argv != found[0]]
    assert len(rest) >= 20
    run_dirs = []
    for argv in rest:
        overrides = argv[argv.index("jobs.generate") + 1:]
        if check_overrides(overrides) or overrides == ["steps=2"]:  # shown refused: a typo, runs/default's settings
            continue
        named = [a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")]
        assert named, f"no run_dir: {shlex.join(argv)}"
        run_dirs += named
    dupes = {d for d in run_dirs if run_dirs.count(d) > 1}
    # the same run on purpose: a run then its resume or its refusal, the two nodes of one torchrun job
    assert dupes <= {"runs/video", "/tmp/runs/tr", "runs/lora"}, dupes


def test_the_quick_start_installs_the_cpu_torch_build_as_pasted():
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    lines = [" ".join(argv) for block in code_blocks(quick) for argv in commands(block)]
    torch = [l for l in lines if l.startswith("pip install torch")]
    # the CPU build first (the default index would pull the multi-GB CUDA one), then the GPU machine's
    assert torch == ["pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
                     "pip install torch==2.13.0"]
    assert lines.index(torch[0]) < lines.index('pip install -e .[test]') < lines.index("python -m jobs.generate")


def test_the_contents_list_every_section():
    contents = README.split("## Contents", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^##+ (.+)$", README.split("## Contents", 1)[1].split("\n", 1)[1], flags=re.M)
    assert headings and all(f"[{h}](#" in contents for h in headings), headings


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings: lower case, punctuation dropped, spaces as dashes."""
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def relative_links(text: str) -> list[str]:
    """The targets of a markdown text's links that are not URLs (outside code blocks and inline code)."""
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.M)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                      for p in (ROOT / "docs").glob("*.md"))])
def test_every_relative_link_points_at_a_file_and_heading_that_exist(doc):
    source = ROOT / doc
    broken = []
    for target in relative_links(source.read_text(encoding="utf-8")):
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, broken


def test_the_link_check_finds_a_broken_anchor_and_file(tmp_path):
    assert anchors("## Output: the run directory\n```\n## not a heading\n```\n") == {"output-the-run-directory"}
    assert relative_links("[a](docs/x.md#y) [b](https://x.org) `[c](d.md)`") == ["docs/x.md#y"]
