"""Prompt formats as a registry: a format registered in one module (here, this test's) is found by its extension,
planned, and read back shard by shard by the job, with nothing else changed."""

from __future__ import annotations

import json

import pytest

from shardgen.dataio.prompts.formats import PromptFormat, prompt_formats, register_format, unregister_format
from shardgen.dataio.prompts.read import BadRow, emit, line_rows_at, max_line_bytes, raw_lines, strip_eol, decode_line
from shardgen.dataio.rundir.remote import open_input
from tests.conftest import compose_cfg

SMALL = ("height=32", "width=32", "steps=1", "samples_per_shard=2", "batch_size=2", "progress=false")


def parse_pipe(raw: bytes):
    """``seed|prompt`` on one line."""
    seed, sep, prompt = decode_line(strip_eol(raw)).partition("|")
    if not sep or not seed.isdigit():
        raise BadRow("not seed|prompt")
    return prompt, int(seed), {}


def read_pipe(req):
    with open_input(req.path) as f:
        for index, (line, raw) in enumerate(raw_lines(f, max_line_bytes(req.max_chars))):
            yield emit(req.path, index, line, req.on_bad_row, parse_pipe, raw, max_chars=req.max_chars)


@pytest.fixture
def pipe_format():
    register_format(PromptFormat("pipe", (".pipe",), read_pipe,
                                 lambda src, data, offset, line, index, count, head:
                                 line_rows_at(src, data, offset, line, index, count, parse_pipe), fields=False))
    yield
    unregister_format("pipe")


def test_the_built_in_formats_are_registered_with_their_extensions():
    assert {n: f.extensions for n, f in prompt_formats().items()} == {
        "txt": (".txt",), "jsonl": (".jsonl", ".ndjson"), "csv": (".csv",), "tsv": (".tsv",),
        "parquet": (".parquet",)}


def test_a_format_registered_in_one_module_runs_a_job(pipe_format, tmp_path):
    from jobs.generate import run
    from shardgen.tools import read_shard_members, verify_run
    from shardgen.dataio.prompts import load_plan
    from shardgen.dataio.rundir import RunDir

    prompts = tmp_path / "p.pipe"
    prompts.write_text("7|a red cube\n8|a blue sphere\n9|not\n10|a green cone\n11|fog\n", encoding="utf-8")
    result = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={prompts}", "prompts.format=auto", *SMALL))
    assert result.ok == 5
    samples = {}
    for tar in sorted((tmp_path / "run" / "shards").glob("*.tar")):  # each shard's rows read back by the format
        samples.update(read_shard_members(tar))
    got = [(json.loads(m["json"])["seed"], m["txt"].decode()) for _, m in sorted(samples.items())]
    assert got == [(7, "a red cube"), (8, "a blue sphere"), (9, "not"), (10, "a green cone"), (11, "fog")]
    assert verify_run(load_plan(RunDir(tmp_path / "run"))).ok


def test_a_bad_row_of_the_new_format_is_one_line_naming_file_and_line(pipe_format, tmp_path):
    from shardgen.dataio.prompts.read import PromptFileError, read_prompts

    prompts = tmp_path / "p.pipe"
    prompts.write_text("1|ok\nno seed here\n", encoding="utf-8")
    with pytest.raises(PromptFileError, match=f"^{prompts}:2: not seed\\|prompt. Fix the row"):
        list(read_prompts(str(prompts)))


@pytest.mark.parametrize("name,data", [("c.jsonl", '{"prompt": "a cat"}\n'), ("c.csv", "prompt,n\na cat,1\n"),
                                       ("c.tsv", "prompt\tn\na cat\t1\n")])
def test_a_prompt_file_given_to_the_default_prompts_is_read_by_its_extension(tmp_path, name, data):
    from shardgen.dataio.prompts.read import read_prompts

    (tmp_path / name).write_text(data)
    cfg = compose_cfg(f"prompts.path={tmp_path / name}")  # prompts.path alone, as a first try types it
    assert [r.prompt for r in read_prompts(cfg.prompts.path, format=cfg.prompts.format)] == ["a cat"]


@pytest.mark.parametrize("name, content, guess", [
    ("cap.jsonl", '{"caption": "a cat", "id": 1}\n{"caption": "a dog", "id": 2}\n', "caption"),
    ("t.csv", "id,text\n1,a cat\n2,a dog\n", "text"),
    ("t.tsv", "Caption\tid\na cat\t1\na dog\t2\n", "Caption"),
])
def test_a_common_caption_column_is_taken_when_the_file_has_no_prompt_field(tmp_path, caplog, name, content, guess):
    import logging

    from jobs.generate import run
    from tests.conftest import compose_cfg

    (tmp_path / name).write_text(content)
    args = (f"prompts.path={tmp_path / name}", f"run_dir={tmp_path / 'r'}", "height=16", "width=16", "steps=1",
            "progress=false")
    with caplog.at_level(logging.INFO, logger="shardgen"):
        result = run(compose_cfg(*args))
    assert (result.ok, result.rejected) == (2, 0)
    assert f"prompts.field={guess}: {tmp_path / name} has no 'prompt' field, and its {guess!r} is taken" in caplog.text
    assert run(compose_cfg(*args)).ok == 2  # the next launch takes the same field: the same run


def test_no_caption_column_is_guessed_between_two_or_over_an_explicit_field(tmp_path):
    from shardgen.dataio.prompts.read import guess_prompt_field

    (tmp_path / "two.jsonl").write_text('{"caption": "a", "text": "b"}\n')
    (tmp_path / "one.jsonl").write_text('{"prompt": "a", "text": "b"}\n')
    assert guess_prompt_field(str(tmp_path / "two.jsonl")) is None
    assert guess_prompt_field(str(tmp_path / "one.jsonl")) is None
    (tmp_path / "id.jsonl").write_text('{"id": 1, "text": "b"}\n')
    assert guess_prompt_field(str(tmp_path / "id.jsonl")) == "text"
    cfg = compose_cfg(f"prompts.path={tmp_path / 'id.jsonl'}", "prompts.field=id")
    from jobs.generate import _guess_prompt_field

    _guess_prompt_field(cfg)
    assert cfg.prompts.field == "id"  # a field named on the command line is kept
    assert guess_prompt_field(str(tmp_path / "missing.jsonl")) is None
