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
    from shardgen.dataio.verify import read_shard_members

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
