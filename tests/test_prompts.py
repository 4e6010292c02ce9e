"""Prompt-file readers: exact text, row counts, and errors that name the file and line."""

from __future__ import annotations

import json
import re
import sys
import tracemalloc
from pathlib import Path

import pytest

from shardgen.dataio.prompts.read import (PromptFileError, PromptRow, check_prompt_source, detect_format,
                                          read_prompts)

SKIP_HINT = "prompts.on_bad_row=skip"


def write(path: Path, data: str | bytes) -> Path:
    """A fixture file with exactly these bytes (str is encoded as UTF-8, no newline translation)."""
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def prompts(path: Path, **kw) -> list[str | None]:
    return [r.prompt for r in read_prompts(str(path), **kw)]


def write_parquet(path: Path, columns: dict) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path)
    return path


# ---------------------------------------------------------------- happy paths

def test_txt_exact_text_line_numbers_and_no_extra(tmp_path):
    lines = ["  leading and trailing spaces  ", "tab\tinside", 'quotes "PEACE" and \'single\'', "ünïcödé ✓ 日本",
             "trailing backslash \\", "vertical\vtab and form\ffeed"]
    path = write(tmp_path / "p.txt", "".join(l + "\n" for l in lines))
    rows = list(read_prompts(str(path)))
    assert [r.prompt for r in rows] == lines
    assert [(r.index, r.line) for r in rows] == [(i, i + 1) for i in range(len(lines))]
    assert all(r.extra == {} and r.seed is None and r.reject is None for r in rows)
    assert all(isinstance(r, PromptRow) for r in rows)


def test_txt_final_newline_makes_no_empty_row_and_missing_one_loses_nothing(tmp_path):
    assert prompts(write(tmp_path / "a.txt", "one\ntwo\n")) == ["one", "two"]
    assert prompts(write(tmp_path / "b.txt", "one\ntwo")) == ["one", "two"]


def test_crlf_terminators_are_removed_and_nothing_else(tmp_path):
    assert prompts(write(tmp_path / "p.txt", "one \r\n two\r\nthree")) == ["one ", " two", "three"]
    assert prompts(write(tmp_path / "p.jsonl", '{"prompt": "a"}\r\n{"prompt": "b "}\r\n')) == ["a", "b "]
    assert prompts(write(tmp_path / "p.csv", 'prompt,n\r\n"x, y",1\r\nz ,2\r\n')) == ["x, y", "z "]
    assert prompts(write(tmp_path / "p.tsv", "prompt\tn\r\n a \t1\r\n")) == [" a "]


def test_bom_at_file_start_is_removed(tmp_path):
    bom = b"\xef\xbb\xbf"
    assert prompts(write(tmp_path / "p.txt", bom + b"first\nsecond\n")) == ["first", "second"]
    assert prompts(write(tmp_path / "p.jsonl", bom + b'{"prompt": "x"}\n')) == ["x"]
    rows = list(read_prompts(str(write(tmp_path / "p.csv", bom + b"prompt,k\nx,1\n"))))
    assert rows[0].prompt == "x" and rows[0].extra == {"k": "1"}
    check_prompt_source(str(tmp_path / "p.csv"), "auto", "prompt")


def test_jsonl_prompt_seed_and_extra(tmp_path):
    objs = [{"prompt": 'a "quoted" cat ', "seed": 7, "style": "oil", "tags": ["x", 1], "meta": {"k": None}},
            {"id": 3, "prompt": "dog"},
            {"prompt": "null seed", "seed": None}]
    path = write(tmp_path / "p.jsonl", "".join(json.dumps(o) + "\n" for o in objs))
    rows = list(read_prompts(str(path)))
    assert [r.prompt for r in rows] == ['a "quoted" cat ', "dog", "null seed"]
    assert [r.seed for r in rows] == [7, None, None]
    assert rows[0].extra == {"style": "oil", "tags": ["x", 1], "meta": {"k": None}}
    assert rows[1].extra == {"id": 3} and rows[2].extra == {}
    assert [r.line for r in rows] == [1, 2, 3]


def test_jsonl_custom_field_and_seed_field(tmp_path):
    path = write(tmp_path / "p.ndjson", '{"caption": "c", "s": 5, "seed": "kept as extra"}\n')
    (row,) = read_prompts(str(path), field="caption", seed_field="s")
    # "seed" is a key shardgen writes itself: the input field moves under "extra" rather than being overwritten
    assert (row.prompt, row.seed, row.extra) == ("c", 5, {"extra": {"seed": "kept as extra"}})


def test_csv_quoting_multiline_records_seed_and_extra(tmp_path):
    text = ('id,prompt,seed\n'
            '1,"a, comma and ""doubled"" quotes",10\n'
            '2,"two\nlines",\n'
            '3,plain "mid" quotes ,0\n')
    rows = list(read_prompts(str(write(tmp_path / "p.csv", text))))
    assert [r.prompt for r in rows] == ['a, comma and "doubled" quotes', "two\nlines", 'plain "mid" quotes ']
    assert [r.seed for r in rows] == [10, None, 0]  # an empty seed cell means no per-row seed
    assert [r.extra for r in rows] == [{"id": "1"}, {"id": "2"}, {"id": "3"}]
    assert [r.line for r in rows] == [2, 3, 5]  # the record after the two-line one starts on line 5
    assert [r.index for r in rows] == [0, 1, 2]


def partiprompts_like(n: int = 1632) -> tuple[list[str], list[dict]]:
    """A PartiPrompts-shaped TSV: quotes that must stay literal, odd spacing, unicode."""
    specials = ['A sign that says "PEACE".', '"quoted from start to end"', 'an apostrophe\'s "half quote',
                " leading space", "trailing space ", "café ✓ 東京", 'a ""doubled"" quote', "comma, separated"]
    prompts_, extras = [], []
    for i in range(n):
        prompts_.append(specials[i] if i < len(specials) else f"prompt number {i} of a cat")
        extras.append({"Category": f"cat{i % 12}", "Challenge": ["Basic", "Imagination"][i % 2],
                       "Note": "" if i % 3 else f'note "{i}"'})
    return prompts_, extras


def test_tsv_1632_rows_exact_text_and_extras(tmp_path):
    prompts_, extras = partiprompts_like()
    lines = ["Prompt\tCategory\tChallenge\tNote"]
    lines += ["\t".join([p, e["Category"], e["Challenge"], e["Note"]]) for p, e in zip(prompts_, extras)]
    path = write(tmp_path / "PartiLike.tsv", "\n".join(lines) + "\n")
    check_prompt_source(str(path), "auto", "Prompt")
    rows = list(read_prompts(str(path), field="Prompt"))
    assert len(rows) == 1632
    assert [r.prompt for r in rows] == prompts_
    assert [r.extra for r in rows] == extras
    assert rows[0].prompt == 'A sign that says "PEACE".'
    assert (rows[-1].index, rows[-1].line) == (1631, 1633)
    assert all(r.reject is None and r.seed is None for r in rows)


def test_parquet_streams_batches_with_seed_and_extra(tmp_path):
    n = 5000  # more than one record batch
    path = write_parquet(tmp_path / "p.parquet", {
        "prompt": [f" p{i} \"q\"" for i in range(n)], "seed": [i if i % 2 else None for i in range(n)],
        "score": [i / 2 for i in range(n)], "tags": [["a", str(i)] for i in range(n)]})
    rows = list(read_prompts(str(path)))
    assert len(rows) == n
    assert rows[4321].prompt == ' p4321 "q"' and rows[4321].seed == 4321 and rows[4320].seed is None
    assert rows[7].extra == {"score": 3.5, "tags": ["a", "7"]}
    assert [(r.index, r.line) for r in rows[:2]] == [(0, 1), (1, 2)]  # parquet: line is the 1-based row
    json.dumps([r.extra for r in rows])


def test_parquet_extras_are_json_serialisable(tmp_path):
    import datetime
    import decimal
    path = write_parquet(tmp_path / "p.parquet", {
        "prompt": ["x"], "when": [datetime.datetime(2024, 5, 6, 7, 8, 9)], "price": [decimal.Decimal("1.25")],
        "blob": [b"\x00\x01"]})
    (row,) = read_prompts(str(path))
    assert row.extra["when"] == "2024-05-06T07:08:09" and row.extra["price"] == "1.25"
    json.dumps(row.extra)


# ---------------------------------------------------------------- bad rows

# (file name, content, field, line of the bad row, index of the bad row, words of the reason)
BAD_ROWS = [
    ("empty.txt", "a\n\nc\n", "prompt", 2, 1, "empty prompt"),
    ("spaces.txt", "a\nb\n \t \n", "prompt", 3, 2, "only whitespace"),
    ("latin1.txt", b"a\ncaf\xe9\nc\n", "prompt", 2, 1, "not valid UTF-8"),
    ("nul.txt", "a\nb\x00c\nd\n", "prompt", 2, 1, "NUL byte (is the file UTF-16?"),
    ("cr.txt", "a\nb\rc\rd\ne\n", "prompt", 2, 1, "carriage return (CR): a file with CR-only line endings"),
    ("bom.txt", "a\n\ufeffb\nc\n", "prompt", 2, 1, "byte-order mark (U+FEFF), in the middle of the file"),
    ("nul.jsonl", '{"prompt": "a"}\n{"prompt": "b\\u0000"}\n', "prompt", 2, 1, "NUL byte"),
    ("blank.jsonl", '{"prompt": "a"}\n\n{"prompt": "c"}\n', "prompt", 2, 1, "blank line"),
    ("broken.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n', "prompt", 2, 1, "malformed JSON"),
    ("array.jsonl", '["a"]\n', "prompt", 1, 0, "not a JSON object"),
    ("nofield.jsonl", '{"prompt": "a"}\n{"text": "b"}\n', "prompt", 2, 1, "no field 'prompt'"),
    ("number.jsonl", '{"prompt": 3}\n', "prompt", 1, 0, "not a string"),
    ("null.jsonl", '{"prompt": "a"}\n{"prompt": null}\n', "prompt", 2, 1, "not a string"),
    ("emptyfield.jsonl", '{"prompt": ""}\n', "prompt", 1, 0, "empty prompt"),
    ("negseed.jsonl", '{"prompt": "a", "seed": -1}\n', "prompt", 1, 0, "seed=-1 is not a seed"),
    ("strseed.jsonl", '{"prompt": "a", "seed": "4"}\n', "prompt", 1, 0, "is not a seed"),
    ("boolseed.jsonl", '{"prompt": "a", "seed": true}\n', "prompt", 1, 0, "is not a seed"),
    ("floatseed.jsonl", '{"prompt": "a", "seed": 1.5}\n', "prompt", 1, 0, "is not a seed"),
    ("bigseed.jsonl", '{"prompt": "a", "seed": %d}\n' % 2**63, "prompt", 1, 0, "is not a seed"),
    ("latin1.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', "prompt", 2, 1, "not valid UTF-8"),
    ("short.csv", "prompt,k\na,1\nb\n", "prompt", 3, 1, "1 column, the header has 2"),
    ("long.csv", "prompt,k\na,1,extra\n", "prompt", 2, 0, "3 columns, the header has 2"),
    ("emptycell.csv", "k,prompt\n1,\n", "prompt", 2, 0, "empty prompt"),
    ("blank.csv", "prompt\na\n\nc\n", "prompt", 3, 1, "0 columns"),
    ("badseed.csv", "prompt,seed\na,1\nb,x1\n", "prompt", 3, 1, "seed='x1' is not a seed"),
    ("negseed.csv", "prompt,seed\na,-3\n", "prompt", 2, 0, "is not a seed"),
    ("quoting.csv", 'prompt,k\n"a"b,1\nc,2\n', "prompt", 2, 0, "malformed csv"),
    ("latin1.csv", b"prompt,k\nok,1\ncaf\xe9,2\n", "prompt", 3, 1, "not valid UTF-8"),
    ("latin1multi.csv", b'prompt,k\n"first\ncaf\xe9",2\nz,3\n', "prompt", 2, 0, "line 3 is not valid UTF-8"),
    ("short.tsv", "Prompt\tNote\na\tn\nb\n", "Prompt", 3, 1, "1 column, the header has 2"),
    ("spaces.tsv", "Prompt\tNote\n  \tn\n", "Prompt", 2, 0, "only whitespace"),
    ("latin1.tsv", b"Prompt\tNote\ncaf\xe9\tn\n", "Prompt", 2, 0, "not valid UTF-8"),
    ("hugeint.jsonl", '{"prompt": "a"}\n{"prompt": "b", "k": %s}\n' % ("9" * 5000), "prompt", 2, 1,
     "a number with thousands of digits"),
    ("bigint.jsonl", '{"prompt": "a", "k": [%d]}\n' % 10**400, "prompt", 1, 0, "beyond a number's range"),
    ("hugeseed.csv", "prompt,seed\na,%s\n" % ("9" * 5000), "prompt", 2, 0, "is not a seed"),
]


@pytest.mark.parametrize("name,content,field,line,index,reason", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_bad_row_error_names_path_line_and_reason(tmp_path, name, content, field, line, index, reason):
    path = write(tmp_path / name, content)
    with pytest.raises(PromptFileError) as e:
        list(read_prompts(str(path), field=field))
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line}: ")
    assert reason in msg and SKIP_HINT in msg


@pytest.mark.parametrize("name,content,field,line,index,reason", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_bad_row_skip_records_reject_and_keeps_counting(tmp_path, name, content, field, line, index, reason):
    path = write(tmp_path / name, content)
    rows = list(read_prompts(str(path), field=field, on_bad_row="skip"))
    assert [r.index for r in rows] == list(range(len(rows)))
    bad = rows[index]
    assert (bad.prompt, bad.line, bad.seed, bad.extra) == (None, line, None, {})
    assert reason in bad.reject
    assert all(r.prompt is not None and r.reject is None for r in rows if r is not bad)


def test_skip_keeps_reading_after_bad_rows(tmp_path):
    path = write(tmp_path / "p.csv", b'prompt,k\na,1\n"b"x,2\ncaf\xe9,3\n,4\nd,5\n')
    rows = list(read_prompts(str(path), on_bad_row="skip"))
    assert [r.prompt for r in rows] == ["a", None, None, None, "d"]
    assert [r.line for r in rows] == [2, 3, 4, 5, 6]
    assert rows[4].extra == {"k": "5"}


@pytest.mark.parametrize("column,value,reason", [("prompt", None, "not a string"), ("prompt", " ", "only whitespace"),
                                                 ("seed", -5, "seed=-5 is not a seed")])
def test_parquet_bad_rows(tmp_path, column, value, reason):
    cols = {"prompt": ["a", "b", "c"], "seed": [1, 2, 3]}
    cols[column] = [cols[column][0], value, cols[column][2]]
    path = write_parquet(tmp_path / "p.parquet", cols)
    with pytest.raises(PromptFileError, match=rf"^{re.escape(str(path))}:2: .*{reason}"):
        list(read_prompts(str(path)))
    rows = list(read_prompts(str(path), on_bad_row="skip"))
    assert [r.prompt for r in rows] == ["a", None, "c"] and reason in rows[1].reject


def test_error_comes_only_when_the_bad_row_is_reached(tmp_path):
    # streaming: the good rows before a bad one are yielded first
    path = write(tmp_path / "p.txt", "a\nb\n\n")
    rows = read_prompts(str(path))
    assert next(rows).prompt == "a" and next(rows).prompt == "b"
    with pytest.raises(PromptFileError, match=r":3: empty prompt"):
        next(rows)


def test_unknown_on_bad_row_lists_valid_values(tmp_path):
    path = write(tmp_path / "p.txt", "a\n")
    with pytest.raises(ValueError, match="error, skip"):
        read_prompts(str(path), on_bad_row="ignore")


# ---------------------------------------------------------------- whole-file errors

def test_missing_file_directory_and_empty_file(tmp_path):
    with pytest.raises(PromptFileError, match="does not exist"):
        read_prompts(str(tmp_path / "nope.txt"))
    with pytest.raises(PromptFileError, match="does not exist"):
        check_prompt_source(str(tmp_path / "nope.csv"), "auto", "prompt")
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(PromptFileError, match="is a directory"):
        read_prompts(str(tmp_path / "dir.txt"))
    empty = write(tmp_path / "empty.jsonl", b"")
    with pytest.raises(PromptFileError, match=r"empty \(0 bytes\)"):
        check_prompt_source(str(empty), "auto", "prompt")
    with pytest.raises(PromptFileError, match=r"empty \(0 bytes\)"):
        read_prompts(str(empty))


@pytest.mark.parametrize("name,content", [("header.csv", "prompt,k\n"), ("bom.txt", b"\xef\xbb\xbf")])
def test_file_without_rows_is_an_error(tmp_path, name, content):
    path = write(tmp_path / name, content)
    with pytest.raises(PromptFileError, match=rf"^{re.escape(str(path))}: .*no rows"):
        list(read_prompts(str(path)))


def test_parquet_without_rows_is_an_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    path = write_parquet(tmp_path / "p.parquet", {"prompt": pa.array([], pa.string())})
    with pytest.raises(PromptFileError, match="no rows"):
        list(read_prompts(str(path)))


def test_missing_column_lists_the_columns(tmp_path):
    path = write(tmp_path / "p.csv", "Prompt,Category\nx,y\n")
    for call in (lambda: check_prompt_source(str(path), "auto", "prompt"), lambda: list(read_prompts(str(path)))):
        with pytest.raises(PromptFileError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith(f"{path}:1: no column 'prompt'")
        assert "['Prompt', 'Category']" in msg and "prompts.field=<one of them>" in msg
        assert "prompts.field=Prompt" in msg  # the case-insensitive match is suggested


@pytest.mark.parametrize("name,data", [("s.csv", "prompt,seed\na cat,5\n"), ("s.tsv", "prompt\tseed\na cat\t5\n")])
def test_a_seed_column_named_on_purpose_must_be_there(tmp_path, name, data):
    path = write(tmp_path / name, data)
    with pytest.raises(PromptFileError, match=r"no column 'Seed' \(prompts.seed_field\); the columns are \['prompt', "
                                              r"'seed'\]\. Set prompts.seed_field=<one of them>"):
        list(read_prompts(str(path), seed_field="Seed"))
    assert [r.seed for r in read_prompts(str(path))] == [5]
    assert [r.seed for r in read_prompts(str(write(tmp_path / ("n" + name), "prompt\na cat\n")))] == [None]


def test_a_parquet_seed_column_named_on_purpose_must_be_there(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["a"], "seed": [5]})
    with pytest.raises(PromptFileError, match="no column 'Seed' \\(prompts.seed_field\\)"):
        list(read_prompts(str(path), seed_field="Seed"))


def test_tsv_read_as_csv_hints_at_the_format(tmp_path):
    path = write(tmp_path / "parti.csv", "Prompt\tCategory\nx\ty\n")
    with pytest.raises(PromptFileError, match="prompts.format=tsv"):
        check_prompt_source(str(path), "auto", "Prompt")


def test_parquet_missing_column_lists_the_columns(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", {"caption": ["x"], "n": [1]})
    with pytest.raises(PromptFileError, match=r"no column 'prompt'.*\['caption', 'n'\].*prompts.field="):
        check_prompt_source(str(path), "parquet", "prompt")


def test_not_a_parquet_file(tmp_path):
    pytest.importorskip("pyarrow")
    path = write(tmp_path / "p.parquet", "just text\n")
    with pytest.raises(PromptFileError, match="not a readable parquet file"):
        check_prompt_source(str(path), "auto", "prompt")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    path = write(tmp_path / "p.parquet", b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PromptFileError, match="pip install pyarrow"):
        list(read_prompts(str(path)))


def test_non_utf8_header_is_an_error_even_with_skip(tmp_path):
    path = write(tmp_path / "p.tsv", b"Pr\xf6mpt\tNote\nx\ty\n")
    with pytest.raises(PromptFileError, match=r":1: the header is not valid UTF-8"):
        list(read_prompts(str(path), field="Prompt", on_bad_row="skip"))


# ---------------------------------------------------------------- formats

@pytest.mark.parametrize("name,fmt", [("a.txt", "txt"), ("a.TXT", "txt"), ("a.jsonl", "jsonl"), ("a.ndjson", "jsonl"),
                                      ("a.csv", "csv"), ("a.tsv", "tsv"), ("dir.v2/a.parquet", "parquet")])
def test_detect_format_by_extension(name, fmt):
    assert detect_format(name) == fmt


def test_unknown_extension_lists_formats_and_override(tmp_path):
    path = write(tmp_path / "prompts.json", '{"prompt": "a"}\n')
    with pytest.raises(PromptFileError) as e:
        read_prompts(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "'.json'" in msg
    assert "prompts.format=" in msg and all(f in msg for f in ("txt", "jsonl", "csv", "tsv", "parquet"))
    assert "prompts.format=jsonl if it holds one JSON object per line" in msg
    assert prompts(path, format="jsonl") == ["a"]  # the override reads it


def test_unknown_explicit_format_lists_formats():
    with pytest.raises(PromptFileError, match="prompts.format='xlsx'.*txt, jsonl, csv, tsv, parquet"):
        detect_format("a.txt", "xlsx")


def test_memory_is_constant_in_the_number_of_rows(tmp_path):
    n = 100_000
    path = write(tmp_path / "big.txt", "".join(f"prompt {i} of a quiet harbour at dusk\n" for i in range(n)))
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_prompts(str(path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == n
    assert peak < 1_000_000  # the file is 4 MB; a reader that held every row would exceed this


def test_a_parquet_string_that_is_not_utf8_is_a_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = b"a" + b"caf\xe9" + b"c"
    offsets = pa.py_buffer(bytes(memoryview(__import__("array").array("i", [0, 1, 5, 6])).cast("B")))
    prompts = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(data)])  # bytes never validated
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": prompts}), path)
    with pytest.raises(PromptFileError, match=rf"^{re.escape(str(path))}:2: .*not valid UTF-8"):
        list(read_prompts(str(path)))
    rows = list(read_prompts(str(path), on_bad_row="skip"))
    assert [r.prompt for r in rows] == ["a", None, "c"] and "not valid UTF-8" in rows[1].reject


@pytest.mark.parametrize("fmt,first,last", [("txt", b"a cat\n", b"a dog\n"),
                                            ("jsonl", b'{"prompt": "a cat"}\n', b'{"prompt": "a dog"}\n'),
                                            ("csv", b"prompt\na cat\n", b"a dog\n")])
def test_a_line_of_many_megabytes_is_read_past_in_bounded_memory(tmp_path, fmt, first, last):
    """A file that lost its newlines (here 40 MB of NUL bytes): a bad row found without holding the line."""
    path = tmp_path / f"p.{fmt}"
    with open(path, "wb") as f:
        f.write(first)
        f.truncate(40 << 20)
        f.seek(0, 2)
        f.write(b"\n" + last)
    tracemalloc.start()
    try:
        rows = list(read_prompts(str(path), on_bad_row="skip", max_chars=1000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.prompt for r in rows] == ["a cat", None, "a dog"]
    assert "bytes long, over prompts.max_prompt_chars=1000" in rows[1].reject
    assert peak < 8 << 20, peak
    with pytest.raises(PromptFileError, match=r":(2|3): the line is \d+ bytes long"):
        list(read_prompts(str(path), max_chars=1000))
