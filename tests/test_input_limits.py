"""What a prompt file can do to a run: it cannot break the writer or the index, pose as shardgen's
own fields, exhaust memory with one runaway line, or be changed under a running job without the job noticing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from jobs import dedup, verify
from shardgen.dataio.shards import index as shard_index
from shardgen.dataio.prompts.plan import build_plan, load_plan
from shardgen.dataio.prompts.read import PromptFileError, PromptSource
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import read_shard_members
from shardgen.run.runner import run_rank
from tests.conftest import compose_cfg, write_lines
from tests.test_integrity import ARGS, gen


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _index(d: Path) -> list[dict]:
    run = RunDir(d)
    return [r for s in sorted(run.done_shards()) for r in shard_index.read_index(run, s)]


def test_rows_posing_as_shardgens_own_fields_go_under_extra(tmp_path, capsys):
    fake = {"phash": "ffffffffffffffff", "clip_score": 0.99}
    prompts = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "a red cube", "signals": "x"}, {"prompt": "a red cube", "signals": fake},
        {"prompt": "a blue ball", "signals": fake, "provenance": "mine", "tokens": -1, "truncated": "no", "key": "k"}])
    d = tmp_path / "run"
    r = gen(d, prompts, "prompts.format=jsonl", "signals=[phash]")
    assert r.complete and r.ok == 3 and verify.main([str(d)]) == 0
    rows = _index(d)
    assert all(row["phash"] != "ffffffffffffffff" and row["clip_score"] is None for row in rows)  # only computed ones
    metas = [json.loads(row["json"]) for row in rows]
    assert metas[0]["extra"] == {"signals": "x"} and set(metas[0]["signals"]) >= {"phash"}
    assert metas[2]["extra"] == {"signals": fake, "provenance": "mine", "tokens": -1, "truncated": "no", "key": "k"}
    assert isinstance(metas[2]["provenance"], dict) and metas[2]["truncated"] is False
    assert json.loads(rows[2]["extra"]) == {"extra": metas[2]["extra"]}
    capsys.readouterr()
    assert dedup.main([str(d), "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert all(len(g) < 3 for g in groups)  # the fake equal hashes made no group of all three


def test_a_field_named_signals_with_signals_off_completes(tmp_path):
    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "signals": "x"}, {"prompt": "b", "signals": [1]}])
    for skip in ("error", "skip"):
        d = tmp_path / skip
        assert gen(d, prompts, "prompts.format=jsonl", f"prompts.on_bad_row={skip}").ok == 2
        assert verify.main([str(d)]) == 0


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_a_prompt_over_the_length_limit_is_a_file_line_error_or_a_reject(tmp_path, fmt):
    long = "word " * 3000  # 15000 characters
    lines = ["short one", long, "short two"]
    path = tmp_path / f"p.{fmt}"
    path.write_text("".join((json.dumps({"prompt": p}) if fmt == "jsonl" else p) + "\n" for p in lines))
    limit = ("prompts.max_prompt_chars=10000", f"prompts.format={fmt}")
    with pytest.raises(PromptFileError, match=rf"p.{fmt}:2: the prompt is 15000 characters long, over "
                                              r"prompts.max_prompt_chars=10000"):
        gen(tmp_path / "a", path, *limit)
    assert not (tmp_path / "a").exists()
    r = gen(tmp_path / "b", path, *limit, "prompts.on_bad_row=skip")
    assert (r.ok, r.rejected) == (2, 1) and verify.main([str(tmp_path / "b")]) == 0
    assert [row["status"] for row in _index(tmp_path / "b")] == ["ok", "rejected", "ok"]


def test_a_runaway_line_is_never_tokenized(tmp_path, monkeypatch):
    """A 20 MB line between short prompts (a file that lost its newlines): a reject found by length, with the
    truncation check on (which tokenizes long prompts); before, planning tokenized it whole (GBs, minutes)."""
    from shardgen.dataio.prompts.truncation import TruncationCheck, planning_windows

    path = tmp_path / "p.txt"
    path.write_bytes(b"a cat\n" + b"x" * (20 << 20) + b"\na dog\n")
    offered = []
    check = TruncationCheck(planning_windows(compose_cfg("prompts.path=x").model), "warn")
    monkeypatch.setattr(check, "offer", lambda *a: offered.append(len(a[2])))
    plan = build_plan(RunDir(tmp_path / "run"), PromptSource(str(path), "txt", on_bad_row="skip", max_chars=100_000),
                      samples_per_shard=2, run_seed=1, truncation=check)
    assert plan.num_rejects == 1 and offered == []
    assert "over prompts.max_prompt_chars=100000" in plan.rows(0)[1].reject


@pytest.mark.parametrize("fmt", ["txt", "csv"])
def test_a_prompt_file_edited_during_the_run_stops_it_before_any_changed_row_is_used(tmp_path, fmt):
    prompts = [f"a photo of a cat number {i}" for i in range(8)]
    path = tmp_path / f"p.{fmt}"
    path.write_text(("prompt\n" if fmt == "csv" else "") + "".join(p + "\n" for p in prompts))
    size = path.stat().st_size
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={path}", f"prompts.format={fmt}", *ARGS,
                      "samples_per_shard=2")
    edited = []

    def edit_after_shard_0(event, worker):
        if event == "start" and not edited and 0 in worker.plan.run.done_shards():
            subprocess.run(["sed", "-i", "s/a /A /g", str(path)], check=True)  # the same size, other text
            edited.append(True)

    with pytest.raises(PromptFileError, match=rf"p.{fmt}: the prompt file changed since the run was planned"):
        run_rank(cfg, on_batch=edit_after_shard_0)
    assert edited and path.stat().st_size == size
    run = RunDir(tmp_path / "run")
    committed = {k: m["txt"].decode() for s in run.done_shards() for k, m in read_shard_members(run.shard_file(s)).items()}
    assert 2 <= len(committed) < 8  # shard 0 and the shard in hand when the file changed (read before it), no more
    assert all(txt == prompts[int(k)] for k, txt in committed.items())  # every committed prompt as planned
    assert verify.main([str(tmp_path / "run")]) == 1  # the tool says so too, without a traceback


def test_a_plan_from_before_shard_digests_still_reads(tmp_path):
    path = write_lines(tmp_path / "p.txt", ["a", "b", "c"])
    run = RunDir(tmp_path / "run")
    build_plan(run, PromptSource(str(path), "txt"), samples_per_shard=2, run_seed=1)
    meta = json.loads((run.plan_dir / "plan.json").read_text())
    for k in ("digests_sha256", "rows_end"):
        meta.pop(k)
    meta["source"].pop("max_chars")
    (run.plan_dir / "plan.json").write_text(json.dumps(meta))
    (run.plan_dir / "digests.npy").unlink()
    plan = load_plan(run)
    assert plan.digests is None and [r.prompt for r in plan.rows(1)] == ["c"]


def test_planning_a_file_without_newlines_holds_one_block_not_the_line(tmp_path):
    """128 MB of NUL bytes after one prompt (a file that lost its newlines): refused at file:line, or a reject, with
    the planner's memory one read block, not the line (it held it whole, and grew its buffer past it)."""
    import tracemalloc

    path = tmp_path / "p.txt"
    with open(path, "wb") as f:
        f.write(b"a cat\n")
        f.truncate(128 << 20)
    source = dict(format="txt", max_chars=100_000)
    with pytest.raises(PromptFileError, match=r"p.txt:2: the line is 134217722 bytes long, over "
                                              r"prompts.max_prompt_chars=100000"):
        build_plan(RunDir(tmp_path / "a"), PromptSource(str(path), **source), samples_per_shard=2, run_seed=1)
    tracemalloc.start()
    try:
        plan = build_plan(RunDir(tmp_path / "b"), PromptSource(str(path), on_bad_row="skip", **source),
                          samples_per_shard=2, run_seed=1)
        rows = plan.rows(0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.prompt for r in rows] == ["a cat", None] and plan.num_rejects == 1
    assert peak < 64 << 20, peak  # blocks of 16 MB


def test_a_negative_prompt_over_the_limit_is_refused_while_validating():
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match="model.negative_prompt is 1001 characters long"):
        validate_config(compose_cfg("prompts.path=x", "prompts.max_prompt_chars=1000", f"model.negative_prompt={'n' * 1001}"))
