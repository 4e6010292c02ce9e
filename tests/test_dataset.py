"""The output is a dataset: every run loads in webdataset and Hugging Face ``datasets`` with no glue,
and the per-shard parquet index holds every sample (failed and rejected ones too) and equals the tars."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from jobs.generate import run
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.shards.index import index_path
from shardgen.tools.verify import read_shard_members, verify_run
from tests.conftest import compose_cfg
from tests.test_failures import faulty

# index 1 and the whole second shard (3..5) are rejected (bad rows), index 2 fails (NaN image)
ROWS = ['{"prompt": "a cat", "source": "web"}', '{"prompt": 1, "source": "web"}',
        '{"prompt": "a nan dog", "source": "web"}', "not json", '{"prompt": ""}', '{"source": "web"}',
        '{"prompt": "a bird", "source": "book"}', '{"prompt": "a fish", "source": "book"}']
OK, FAILED, REJECTED = {"0000000000", "0000000006", "0000000007"}, {"0000000002"}, {"0000000001", "0000000003",
                                                                                   "0000000004", "0000000005"}


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory) -> Path:
    """A finished run with ok, failed and rejected samples, one shard holding no image at all."""
    tmp = tmp_path_factory.mktemp("mixed")
    prompts = tmp / "p.jsonl"
    prompts.write_text("\n".join(ROWS) + "\n", encoding="utf-8")
    mp = pytest.MonkeyPatch()
    faulty(mp, poison=("nan",))
    try:
        r = run(compose_cfg(f"run_dir={tmp / 'run'}", "prompts=jsonl", f"prompts.path={prompts}",
                            "prompts.on_bad_row=skip", "height=16", "width=16", "steps=1", "progress=false",
                            "batch_size=2", "samples_per_shard=3"))
    finally:
        mp.undo()
    assert (r.ok, r.failed, r.rejected, r.complete) == (3, 1, 4, True)
    return tmp / "run"


def test_tars_hold_only_images_and_webdataset_reads_every_one(mixed_run):
    import webdataset as wds

    from shardgen.tools.loading import shard_paths

    # the README's snippet, as written there
    ds = wds.WebDataset(shard_paths(mixed_run), shardshuffle=False).decode("pil")
    seen = {s["__key__"]: (s["png"].size, s["txt"], s["json"]["seed"]) for s in ds}
    assert set(seen) == OK
    assert seen["0000000006"][:2] == ((16, 16), "a bird")


def test_hugging_face_datasets_loads_a_run_with_failures_and_rejects(mixed_run, tmp_path):
    from datasets import load_dataset

    ds = load_dataset("webdataset", data_files={"train": str(mixed_run / "shards" / "*.tar")}, split="train",
                      cache_dir=str(tmp_path / "hf"))
    assert sorted(ds["__key__"]) == sorted(OK)
    assert all(img.size == (16, 16) for img in ds["png"])
    assert {j["source"] for j in ds["json"]} == {"web", "book"}


@pytest.fixture(scope="module")
def later_fields_run(tmp_path_factory) -> Path:
    """A run of 8 rows in 4 shards whose first two shards' rows have only a prompt and whose last two add a
    ``score`` and ``tags``."""
    tmp = tmp_path_factory.mktemp("later")
    rows = [{"prompt": f"a plain {i}"} for i in range(4)]
    rows += [{"prompt": f"a scored {i}", "score": 0.5 + i, "tags": ["x", "y"][: i % 2 + 1]} for i in range(4)]
    (tmp / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    r = run(compose_cfg(f"run_dir={tmp / 'run'}", f"prompts.path={tmp / 'p.jsonl'}", "height=16", "width=16",
                        "steps=1", "progress=false", "batch_size=2", "samples_per_shard=2"))
    assert (r.ok, r.complete) == (8, True)
    return tmp / "run"


def test_datasets_with_the_runs_features_loads_fields_only_later_shards_have(later_fields_run, tmp_path):
    from datasets import load_dataset

    from shardgen.tools.loading import hf_features, shard_paths

    ds = load_dataset("webdataset", data_files={"train": shard_paths(later_fields_run)}, split="train",
                      features=hf_features(later_fields_run), cache_dir=str(tmp_path / "hf"))
    assert len(ds) == 8
    by_key = {r["__key__"]: r["json"] for r in ds}
    assert [by_key[f"{i:010d}"]["score"] for i in range(8)] == [None] * 4 + [0.5, 1.5, 2.5, 3.5]
    assert by_key["0000000005"]["tags"] == ["x", "y"] and by_key["0000000000"]["tags"] is None
    assert ds[0]["png"].size == (16, 16)


def test_webdataset_over_the_runs_shard_paths_reads_every_sample(later_fields_run):
    import webdataset as wds

    from shardgen.tools.loading import shard_paths

    assert len(shard_paths(later_fields_run)) == 4
    samples = list(wds.WebDataset(shard_paths(later_fields_run), shardshuffle=False).decode("pil"))
    assert len(samples) == 8 and samples[-1]["json"]["score"] == 3.5


def test_a_video_run_loads_in_datasets_as_mp4_bytes_without_torchcodec(tmp_path):
    """``datasets.Video`` decodes with torchcodec; ``video="bytes"`` gives each mp4 to decode with PyAV (a
    dependency of shardgen), so a video run loads with nothing more installed."""
    from datasets import load_dataset

    from shardgen.dataio.shards.video import decode_video
    from shardgen.tools.loading import hf_features, shard_paths

    r = run(compose_cfg("model=tiny_video", "height=32", "width=32", "num_frames=5", "steps=1", "progress=false",
                        "prompts.limit=3", "samples_per_shard=2", f"run_dir={tmp_path / 'v'}"))
    assert r.ok == 3
    ds = load_dataset("webdataset", data_files={"train": shard_paths(tmp_path / "v")}, split="train",
                      features=hf_features(tmp_path / "v", video="bytes"), cache_dir=str(tmp_path / "hf"))
    assert len(ds) == 3 and ds[2]["json"]["frames"] == 5
    assert decode_video(ds[2]["mp4"])[0].shape == (5, 32, 32, 3)


def test_index_equals_the_tars_and_holds_failures_and_rejects(mixed_run):
    import glob

    import pandas as pd
    import pyarrow.dataset as ds

    rund = RunDir(mixed_run)
    df = pd.read_parquet(glob.glob(str(mixed_run / "shards" / "*.parquet")))  # docs/dataset.md, as written there
    t = ds.dataset(glob.glob(str(mixed_run / "shards" / "*.parquet"))).to_table(
        columns=["key", "status", "error"], filter=ds.field("status") != "ok")
    assert sorted(t.column("key").to_pylist()) == sorted(FAILED | REJECTED)
    assert sorted(df["key"]) == sorted(OK | FAILED | REJECTED)  # every prompt index exactly once
    by_key = df.set_index("key")
    for shard in range(load_plan(rund).num_shards):
        assert index_path(rund, shard).exists()
        for key, mem in read_shard_members(rund.shard_file(shard)).items():
            row = by_key.loc[key]
            meta = json.loads(mem["json"])
            assert (row["status"], row["prompt"], row["seed"], row["shard"]) == ("ok", mem["txt"].decode(),
                                                                                 meta["seed"], shard)
            assert row["image_sha256"] == hashlib.sha256(mem["png"]).hexdigest()
            assert row["image_bytes"] == len(mem["png"]) and (row["width"], row["height"]) == (16, 16)
            assert json.loads(row["extra"]) == {"source": meta["source"]}
    failed = df[df.status != "ok"].set_index("key")
    assert set(failed.index) == FAILED | REJECTED
    assert failed.loc["0000000002", "error"].startswith("nonfinite")
    assert failed.loc["0000000003", "error"].startswith("rejected: malformed JSON")
    assert failed["image_sha256"].isna().all()


def test_a_tool_reading_the_index_exits_zero_after_printing(mixed_run):
    """Every operator tool reads the committed index from an open file; the process must exit with its own status,
    not abort at exit in pyarrow's threads (exit 134 after a correct result, which a script takes as a failure)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("from pathlib import Path; from shardgen.dataio.rundir.layout import RunDir; "
            "from shardgen.tools.runfiles import read_index_columns; "
            f"print(len(read_index_columns(RunDir(Path({str(mixed_run)!r})), ['key', 'status'])['key']))")
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stdout.strip()) == (0, str(len(OK | FAILED | REJECTED))), p.stderr[-1000:]


def test_verify_counts_records_in_the_index_and_catches_a_missing_one(mixed_run, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    rep = verify_run(load_plan(RunDir(mixed_run)))
    assert rep.ok, rep.defects
    assert (rep.samples, rep.status["ok"], rep.status["failed"], rep.status["rejected"]) == (8, 3, 1, 4)
    broken = tmp_path / "broken"
    shutil.copytree(mixed_run, broken)
    table = pq.read_table(broken / "shards" / "000001.parquet")
    pq.write_table(table.slice(1), broken / "shards" / "000001.parquet")  # lose the record of index 3
    rep = verify_run(load_plan(RunDir(broken)))
    assert any("000001: 1 prompt indices missing" in d for d in rep.defects), rep.defects


LONG = "a very long prompt about " + " ".join(f"thing{i}" for i in range(60))  # > 32 T5 tokens of the tiny model
FAST = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=2")


def _sample_json(run_dir: Path) -> dict[str, dict]:
    import pandas as pd

    df = pd.concat(pd.read_parquet(p) for p in sorted((run_dir / "shards").glob("*.parquet")))
    return {k: json.loads(j) for k, j in zip(df["key"], df["json"])}


def test_truncated_prompts_are_warned_flagged_and_provenance_recorded(tmp_path, caplog, capsys, monkeypatch):
    """on_truncation=warn (the default): planning tokenizes nothing; generation counts each batch, flags the
    samples, and the stats, the launch's summary and jobs.status sum them up."""
    import logging

    import jobs.status
    import shardgen.run.runner as runner
    from tests.conftest import write_lines

    def no_tokenizing(model_cfg):
        raise AssertionError("planning loaded tokenizers with on_truncation=warn")

    monkeypatch.setattr(runner, "planning_windows", no_tokenizing)
    f = write_lines(tmp_path / "p.txt", ["a cat", LONG])
    with caplog.at_level(logging.WARNING, logger="shardgen"):
        r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *FAST))
    assert (r.ok, r.truncated) == (2, 1)
    assert "1 prompt(s) were longer than the text encoders keep" in caplog.text
    assert json.loads((tmp_path / "run" / "shards" / "000000.stats.json").read_text())["truncated"] == 1
    capsys.readouterr()
    assert jobs.status.main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "truncated 1 prompts longer than a text encoder keeps" in out
    assert "last error" not in out and "last warning" not in out  # a clean complete run: the count says it all
    meta = _sample_json(tmp_path / "run")
    short, long = meta["0000000000"], meta["0000000001"]
    assert short["truncated"] is False and long["truncated"] is True
    assert long["tokens"]["T5EncoderModel"] > 32 and short["tokens"]["CLIPTextModel"] < 77
    prov = long["provenance"]
    assert prov["model"]["version"].startswith("tiny-") and prov["model"]["weights"].startswith("config-sha256:")
    assert prov["scheduler"]["name"] == "FlowMatchEulerDiscreteScheduler" and prov["scheduler"]["shift"] == 3.0
    assert (prov["dtype"], prov["steps"], prov["width"], prov["lossy"]) == ("float64", 1, 16, False)
    assert prov["shardgen"] != "unknown" and "seed" in long


def test_batch_token_counts_equal_the_tokenizers_own_call():
    """count_tokens goes through the Rust backend's batch call; the counts are the tokenizer's own."""
    from shardgen.dataio.prompts.truncation import count_tokens, planning_windows

    prompts = ["a cat", LONG, "caf\u00e9 \u4e00\u53ea", "x" * 300]
    windows = planning_windows(compose_cfg().model)
    assert len(windows) == 2 and all(tok.backend_tokenizer is not None for _, tok, _ in windows)
    for _, tok, _ in windows:
        want = [len(ids) for ids in tok(prompts, add_special_tokens=True, truncation=False)["input_ids"]]
        assert count_tokens(tok, prompts) == want and want[1] > 32


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_on_truncation_error_stops_planning_at_the_first_batch_with_a_long_prompt(tmp_path, monkeypatch, fmt):
    import shardgen.dataio.prompts.truncation as T
    from shardgen.dataio.prompts.plan import build_plan
    from shardgen.dataio.prompts.read import PromptSource
    from shardgen.dataio.prompts.read import PromptFileError

    monkeypatch.setattr(T, "_BATCH", 4)
    rows = ["a cat"] * 5 + [LONG] * 3 + [f"{LONG} {i}" for i in range(100)]
    path = tmp_path / f"p.{fmt}"
    path.write_text("".join((json.dumps({"prompt": r}) if fmt == "jsonl" else r) + "\n" for r in rows))
    check = T.TruncationCheck(T.planning_windows(compose_cfg().model), "error", progress=False)
    with pytest.raises(PromptFileError, match=r"4 prompt\(s\) are longer .* \(among the first 9 rows: planning "
                                              rf"stopped there\); the first, .*p.{fmt}:6, has"):
        build_plan(RunDir(tmp_path / "run"), PromptSource(str(path), fmt), samples_per_shard=10, run_seed=1,
                   truncation=check)


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_on_truncation_refuses_long_prompts(tmp_path, policy):
    from shardgen.dataio.prompts.read import PromptFileError
    from tests.conftest import write_lines

    f = write_lines(tmp_path / "p.txt", ["a cat", LONG, "a dog"])
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", f"prompts.on_truncation={policy}", *FAST)
    if policy == "error":
        with pytest.raises(PromptFileError, match=r"1 prompt\(s\) are longer.*prompts.on_truncation=warn"):
            run(cfg)
        assert not (tmp_path / "run" / "plan").exists()
        return
    r = run(cfg)
    assert (r.ok, r.rejected) == (2, 1)
    assert _sample_json(tmp_path / "run")["0000000001"]["error"].startswith("rejected: the prompt is longer")


def test_index_rows_follow_the_checkpoint_through_a_kill(tmp_path):
    """Rows written after the last checkpoint are dropped on resume, like the tar's bytes."""
    import numpy as np

    from shardgen.dataio.shards.index import read_index
    from shardgen.dataio.shards.shardwork import Sample, ShardWork

    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    px = np.zeros((16, 16, 3), np.uint8)

    def sample(i, status="ok"):
        meta = dict(index=i, prompt=f"p{i}", width=16, height=16)
        return Sample(key=f"{i:010d}", index=i, prompt=f"p{i}", meta=meta, pixels=px if status == "ok" else None,
                      status=status, failure=None if status == "ok" else f"{status}: why")

    first = ShardWork.open(run_dir, 0, 1, range(4))
    first.write([sample(0), sample(1, "failed")], [b"png0", None], "png")
    first.index.add([("0000000009.txt", b"x"), ("0000000009.json", b'{"index": 9}')])  # not checkpointed
    first.index.sync()
    first.close()  # killed here
    second = ShardWork.open(run_dir, 0, 2, range(4))
    assert second.n_done == 2
    second.write([sample(2, "rejected"), sample(3)], [None, b"png3"], "png")
    second.commit()
    rows = read_index(run_dir, 0)
    assert [(r["index"], r["status"]) for r in rows] == [(0, "ok"), (1, "failed"), (2, "rejected"), (3, "ok")]
    assert set(read_shard_members(run_dir.shard_file(0))) == {"0000000000", "0000000003"}
    assert not list(run_dir.work_dir.iterdir())  # partial rows cleaned with the partial tar
