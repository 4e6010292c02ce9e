"""Per-row generation settings (``prompts.row_settings``): what a user of a mixed-size run notices.

One jsonl mixes three aspect ratios, a width/height row, per-row negative prompts, guidance and true CFG: every
image has its row's size and json; each sample is byte-identical to a one-row run given the same settings by
the config; the tars are byte-identical across batch sizes and after a kill + resume; bad values are
``file:line: <field>: ...`` errors with nothing written, or rejects with ``prompts.on_bad_row=skip``.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jobs import verify
from shardgen.config.validate import ConfigError
from shardgen.dataio.prompts.read import PromptFileError, read_prompts
from shardgen.dataio.prompts.rowsettings import RowRules
from shardgen.dataio.shards.video import decode_video
from shardgen.tools.verify import read_shard_members
from shardgen.run.runner import run_rank
from tests.conftest import compose_cfg

NAMES = "[aspect_ratio,width,height,negative_prompt,guidance,true_cfg_scale,steps]"
# the run's area is 48x48: 1:1 -> 48x48, 16:9 -> 64x32, 1:2 -> 32x64 (sides rounded to the model's 16)
ROWS = [
    dict(prompt="a cat", seed=11, aspect_ratio="1:1"),
    dict(prompt="a dog", seed=12, aspect_ratio="16:9", negative_prompt="blurry", guidance=2.0),
    dict(prompt="a car", seed=13, aspect_ratio="1:2", true_cfg_scale=2.0, negative_prompt="dark"),
    dict(prompt="a tree", seed=14, aspect_ratio="1:1"),  # batched with row 0, ahead of rows 1 and 2
    dict(prompt="a boat", seed=15, width=32, height=16),
    dict(prompt="a hat", seed=16, aspect_ratio="1:2", true_cfg_scale=2.0, negative_prompt="bright"),
    dict(prompt="a cup", seed=17, aspect_ratio="1:1", guidance=5, steps=2),
    dict(prompt="a pen", seed=18, source="web"),  # the run's own settings
]
SIZES = [(48, 48), (64, 32), (32, 64), (48, 48), (32, 16), (32, 64), (48, 48), (48, 48)]  # (width, height)
ARGS = ("height=48", "width=48", "steps=1", "progress=false", "samples_per_shard=4", "lease_s=1", "heartbeat_s=0.25")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def gen(run_dir: Path, prompts: Path, *extra: str, **kw):
    return run_rank(compose_cfg("prompts=jsonl", f"run_dir={run_dir}", f"prompts.path={prompts}", *ARGS, *extra), **kw)


def samples(run_dir: Path) -> dict:
    """index -> (png bytes, json without timing)."""
    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for mem in read_shard_members(tar).values():
            meta = json.loads(mem["json"])
            meta.pop("gen_s", None)
            out[meta["index"]] = (mem.get("png"), meta)
    return out


def tars(run_dir: Path) -> dict:
    return {t.name: t.read_bytes() for t in sorted((run_dir / "shards").glob("*.tar"))}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(prompt file, a finished mixed run at batch_size=3, its samples)."""
    d = tmp_path_factory.mktemp("mixed")
    prompts = write_jsonl(d / "p.jsonl", ROWS)
    assert gen(d / "run", prompts, f"prompts.row_settings={NAMES}", "batch_size=3").complete
    return prompts, d / "run", samples(d / "run")


def test_every_image_has_its_rows_size_and_json_and_verify_passes(mixed):
    _, run_dir, got = mixed
    assert sorted(got) == list(range(len(ROWS)))
    for i, (png, meta) in got.items():
        assert Image.open(io.BytesIO(png)).size == SIZES[i], i
        assert (meta["width"], meta["height"]) == SIZES[i]
        assert meta["guidance"] == ROWS[i].get("guidance", 3.5) and meta["steps"] == ROWS[i].get("steps", 1)
        assert meta.get("true_cfg_scale") == ROWS[i].get("true_cfg_scale")
        assert meta.get("negative_prompt") == ROWS[i].get("negative_prompt")
        assert meta.get("aspect_ratio") == ROWS[i].get("aspect_ratio")
    assert got[7][1]["source"] == "web"  # a column not listed stays metadata
    assert verify.main([str(run_dir)]) == 0
    import pandas as pd

    index = pd.concat(pd.read_parquet(p) for p in sorted((run_dir / "shards").glob("*.parquet")))
    assert sorted(zip(index["index"], index.width, index.height)) == [(i, w, h) for i, (w, h) in enumerate(SIZES)]
    from shardgen.dataio.prompts.plan import load_plan
    from shardgen.dataio.rundir.layout import RunDir
    from shardgen.tools.report import build_report

    page = build_report(load_plan(RunDir(run_dir)))  # jobs.report: images per size
    for size, n in (("48x48", 4), ("64x32", 1), ("32x64", 2), ("32x16", 1)):
        assert f"<tr><td>{size}</td><td>{n}</td>" in page


def test_status_and_report_count_images_per_shape(mixed, capsys):
    """jobs.status (text and --json) and jobs.report give the same images per shape, from the shards' stats."""
    from jobs import status

    _, run_dir, _ = mixed
    want = {"48x48": 4, "32x64": 2, "64x32": 1, "32x16": 1}
    stats = [json.loads(p.read_text()) for p in sorted((run_dir / "shards").glob("*.stats.json"))]
    assert [st["shapes"] for st in stats] == [{"32x64": 1, "48x48": 2, "64x32": 1},
                                              {"32x16": 1, "32x64": 1, "48x48": 2}]
    assert status.main([str(run_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["shapes"] == want
    assert st["row_settings"] == ["aspect_ratio", "width", "height", "negative_prompt", "guidance", "true_cfg_scale",
                                  "steps"]
    assert status.main([str(run_dir)]) == 0
    assert "  shapes   4 at 48x48, 2 at 32x64, 1 at 64x32, 1 at 32x16 (images in committed shards, width x height)" \
        in capsys.readouterr().out
    assert status.main([str(run_dir), "--json"]) == 0  # the second call reads the status cache: the same counts
    assert json.loads(capsys.readouterr().out)["shapes"] == want


def test_each_sample_is_the_one_a_one_row_run_with_those_settings_makes(mixed, tmp_path):
    """The config's height/width/guidance/true CFG/negative prompt, for one row: the same png bytes."""
    _, _, got = mixed
    for i in (1, 2, 4, 6, 7):  # 16:9 with its own guidance, true CFG, width/height, 2 steps, the run's own
        row = ROWS[i]
        w, h = SIZES[i]
        extra = [f"width={w}", f"height={h}", f"guidance={row.get('guidance', 3.5)}", f"steps={row.get('steps', 1)}",
                 f"model.true_cfg_scale={row.get('true_cfg_scale', 1.0)}"]
        if "negative_prompt" in row:
            extra.append(f"model.negative_prompt={row['negative_prompt']}")
        one = write_jsonl(tmp_path / f"one{i}.jsonl", [dict(prompt=row["prompt"], seed=row["seed"])])
        gen(tmp_path / f"one{i}", one, *extra)
        png, meta = samples(tmp_path / f"one{i}")[0]
        assert png == got[i][0], f"row {i}: its pixels depend on the rows it was batched with"
        for k in ("width", "height", "guidance", "true_cfg_scale", "steps", "seed"):
            assert meta.get(k) == got[i][1].get(k)


@pytest.mark.slow
def test_tars_are_identical_across_batch_sizes_and_after_a_kill_and_resume(mixed, tmp_path):
    prompts, run_dir, _ = mixed
    want = tars(run_dir)  # batch_size=3
    assert gen(tmp_path / "b1", prompts, f"prompts.row_settings={NAMES}", "batch_size=1").complete
    assert tars(tmp_path / "b1") == want
    ends = []

    def kill_at_the_second_batch(event, worker):
        if event == "end":
            ends.append(event)
            if len(ends) == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gen(tmp_path / "k", prompts, f"prompts.row_settings={NAMES}", "batch_size=2", on_batch=kill_at_the_second_batch)
    assert not list((tmp_path / "k" / "shards").glob("*.tar"))  # killed inside the first shard,
    assert list((tmp_path / "k" / "work").glob("*.ckpt.json"))     # after row 0 was handed over (row 3: made ahead)
    time.sleep(1.1)  # our own claim expires (lease_s=1)
    assert gen(tmp_path / "k", prompts, f"prompts.row_settings={NAMES}", "batch_size=2").complete
    assert tars(tmp_path / "k") == want
    from shardgen.dataio.resume.fingerprint import FingerprintMismatch

    with pytest.raises(FingerprintMismatch, match=r"prompts.row_settings: run has \['aspect_ratio'"):
        gen(tmp_path / "k", prompts, "prompts.row_settings=[guidance]")


def test_batches_are_full_by_shape_and_the_earliest_row_goes_first():
    from shardgen.dataio.prompts import PlannedRow
    from shardgen.run.generation import GenSettings, shape_batches

    s = GenSettings(height=48, width=48, steps=1, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=8, model="tiny", strategy="dp")
    own = [{"width": 64}, {}, {"width": 64}, {"height": 48, "width": 48}, {"width": 64}, {"guidance": 2.0}]
    rows = [PlannedRow(index=i, line=i + 1, prompt="p", seed=i, extra={}, reject=None, settings=o)
            for i, o in enumerate(own)]
    # row 3 gives the run's own size explicitly: it shares row 1's call
    assert shape_batches(s, rows, 2) == [[0, 2], [1, 3], [4], [5]]
    assert shape_batches(s, rows, 1) == [[i] for i in range(6)]
    plain = [PlannedRow(index=i, line=i + 1, prompt="p", seed=i, extra={}, reject=None) for i in range(5)]
    assert shape_batches(s, plain, 2) == [[0, 1], [2, 3], [4]]  # no row settings: slices, as before


@pytest.mark.parametrize("row, message", [
    (dict(prompt="x", width=40), r"p.jsonl:2: width: 40 is not an image width this model can make: write a whole "
                                 r"number of pixels, a multiple of 16 from 16 to 8192"),
    (dict(prompt="x", height=99999), r"p.jsonl:2: height: 99999 is not an image height"),
    (dict(prompt="x", width="64"), r"p.jsonl:2: width: a string is not an image width"),
    (dict(prompt="x", guidance=-1), r"p.jsonl:2: guidance: -1 is out of range: write a number from 0 up"),
    (dict(prompt="x", guidance="high"), r"p.jsonl:2: guidance: a string is not a number: write a number from 0 up"),
    (dict(prompt="x", true_cfg_scale=0.5), r"p.jsonl:2: true_cfg_scale: 0.5 is out of range: write a number from 1 up"),
    (dict(prompt="x", aspect_ratio="wide"), r"p.jsonl:2: aspect_ratio: 'wide' is not an aspect ratio: write "
                                            r"WIDTH:HEIGHT, e.g. \"16:9\""),
    (dict(prompt="x", aspect_ratio="1:1", width=64), r"p.jsonl:2: aspect_ratio: the row gives width/height too"),
    (dict(prompt="x", negative_prompt=3), r"p.jsonl:2: negative_prompt: 3 is not a string"),
    (dict(prompt="x", steps=0), r"p.jsonl:2: steps: 0 is not a number of denoising steps: write a whole number"),
    (dict(prompt="x", guidance=10**400), r"p.jsonl:2: an integer of 1329 bits is beyond a number's range"),
    (dict(prompt="x", negative_prompt="n" * 100_001), r"p.jsonl:2: the negative_prompt is 100001 characters long, "
                                                      r"over prompts.max_prompt_chars=100000"),
])
def test_a_bad_value_is_a_file_line_error_naming_the_field_with_nothing_written(tmp_path, row, message):
    prompts = write_jsonl(tmp_path / "p.jsonl", [dict(prompt="fine"), row])
    with pytest.raises(PromptFileError, match=message):
        gen(tmp_path / "run", prompts, f"prompts.row_settings={NAMES}")
    assert not (tmp_path / "run").exists()


def test_skip_records_bad_rows_as_rejects(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [dict(prompt="fine", aspect_ratio="1:2"),
                                                 dict(prompt="bad", guidance=-2), dict(prompt="also", width=33)])
    res = gen(tmp_path / "run", prompts, f"prompts.row_settings={NAMES}", "prompts.on_bad_row=skip")
    assert res.complete
    got = samples(tmp_path / "run")
    assert (got[0][1]["width"], got[0][1]["height"]) == (32, 64)
    import pandas as pd

    index = pd.read_parquet(tmp_path / "run" / "shards" / "000000.parquet").set_index("index")
    assert list(index.status) == ["ok", "rejected", "rejected"]
    assert "guidance: -2 is out of range: write a number from 0 up" in index.error[1]
    assert "width: 33 is not an image width" in index.error[2]
    assert verify.main([str(tmp_path / "run")]) == 0


def test_csv_cells_and_unlisted_columns(tmp_path):
    """csv cells are text: numbers are parsed, an empty cell keeps the run's; without row_settings (the default)
    columns named width/height stay metadata, as before."""
    path = tmp_path / "p.csv"
    path.write_text("prompt,width,height,guidance\na,64,,2.5\nb,,,\n", encoding="utf-8")
    rules = RowRules(names=("width", "height", "guidance"), height=48, width=48)
    rows = list(read_prompts(str(path), rules=rules))
    assert rows[0].settings == {"width": 64, "guidance": 2.5} and rows[0].extra == {}
    assert rows[1].settings == {}
    plain = list(read_prompts(str(path)))
    assert plain[0].settings == {} and plain[0].extra == {"extra": {"width": "64", "height": "", "guidance": "2.5"}}
    path.write_text("prompt,width\na,6x4\n", encoding="utf-8")
    with pytest.raises(PromptFileError, match=r"p.csv:2: width: '6x4' is not an image width"):
        list(read_prompts(str(path), rules=rules))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "width": [64, None], "guidance": [float("nan"), 2.0]}),
                   tmp_path / "p.parquet")
    rows = list(read_prompts(str(tmp_path / "p.parquet"), rules=rules))
    assert [r.settings for r in rows] == [{"width": 64}, {"guidance": 2.0}]  # null and NaN: the run's


def test_an_unknown_name_is_a_config_error_listing_the_allowed_ones(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [dict(prompt="x")])
    with pytest.raises(ConfigError, match=r"prompts.row_settings: 'style' cannot be set per row: list only width, "
                                          r"height, aspect_ratio, negative_prompt, guidance, true_cfg_scale, steps, "
                                          r"num_frames"):
        gen(tmp_path / "run", prompts, "prompts.row_settings=[guidance,style]")
    assert not (tmp_path / "run").exists()


def test_num_frames_is_refused_for_an_image_model():
    with pytest.raises(Exception, match="num_frames: this is an image model"):
        RowRules(names=("num_frames",)).parse({"num_frames": 5})
    assert RowRules(names=("num_frames",), frame_stride=4).parse({"num_frames": 9}) == {"num_frames": 9}
    with pytest.raises(Exception, match=r"num_frames: 8 is not a frame count this model can make: write 4k\+1"):
        RowRules(names=("num_frames",), frame_stride=4).parse({"num_frames": 8})


def test_video_rows_with_their_own_frame_counts(tmp_path):
    """model=tiny_video with prompts.row_settings=[num_frames]: each mp4 has its row's frames, the same video as
    a one-row run of that many frames (decoded, within rounding: the row runs in a batch of two there and alone here,
    and torch's CPU kernels do not promise the same last bit across batch shapes); a count the model cannot make
    is a file:line error."""
    video = ("model=tiny_video", "height=32", "width=32", "num_frames=5", "steps=1", "batch_size=2")
    prompts = write_jsonl(tmp_path / "p.jsonl", [dict(prompt="a", seed=1, num_frames=9), dict(prompt="b", seed=2),
                                                 dict(prompt="c", seed=3, num_frames=9)])
    assert gen(tmp_path / "run", prompts, *video, "prompts.row_settings=[num_frames]").complete
    got = {json.loads(m["json"])["index"]: (m["mp4"], json.loads(m["json"]))
           for t in (tmp_path / "run" / "shards").glob("*.tar") for m in read_shard_members(t).values()}
    assert [got[i][1]["frames"] for i in range(3)] == [9, 5, 9]
    assert json.loads((tmp_path / "run" / "shards" / "000000.stats.json").read_text())["shapes"] == \
        {"32x32x5": 1, "32x32x9": 2}  # width x height x frames, as jobs.status and jobs.report show them
    one = write_jsonl(tmp_path / "one.jsonl", [dict(prompt="c", seed=3)])
    gen(tmp_path / "one", one, *video[:3], "num_frames=9", *video[4:])
    alone, _ = decode_video(next(m["mp4"] for m in read_shard_members(tmp_path / "one" / "shards" / "000000.tar")
                                 .values()))
    batched, _ = decode_video(got[2][0])
    assert alone.shape == batched.shape == (9, 32, 32, 3)
    assert np.abs(alone.astype(int) - batched.astype(int)).mean() < 0.5  # pixel levels of 255
    assert verify.main([str(tmp_path / "run")]) == 0
    bad = write_jsonl(tmp_path / "bad.jsonl", [dict(prompt="a", num_frames=8)])
    with pytest.raises(PromptFileError, match=r"bad.jsonl:1: num_frames: 8 is not a frame count this model can make"):
        gen(tmp_path / "bad", bad, *video, "prompts.row_settings=[num_frames]")
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_two_ranks_make_the_same_samples(mixed, tmp_path):
    """launcher=local with 2 gloo ranks (one shard each): the same images and settings as one rank."""
    from jobs.generate import run

    prompts, _, want = mixed
    cfg = compose_cfg("prompts=jsonl", f"run_dir={tmp_path / 'run'}", f"prompts.path={prompts}", *ARGS,
                      f"prompts.row_settings={NAMES}", "batch_size=2", "launcher=local", "launcher.nprocs=2")
    run(cfg)
    assert verify.main([str(tmp_path / "run")]) == 0
    got = samples(tmp_path / "run")
    assert {i: png for i, (png, _) in got.items()} == {i: png for i, (png, _) in want.items()}
    assert all((got[i][1]["width"], got[i][1]["height"]) == SIZES[i] for i in got)


def test_retry_failed_regenerates_each_failed_sample_at_its_rows_settings(tmp_path, monkeypatch):
    """Samples that failed (an exception in their batch) are regenerated by retry_failed=true with their row's size,
    guidance and negative prompt: the run's tars end byte-identical to a run that never failed."""
    from tests.test_failures import faulty

    rows = [dict(prompt="a boom car", seed=1, aspect_ratio="1:2", true_cfg_scale=2.0, negative_prompt="dark"),
            dict(prompt="a cat", seed=2, aspect_ratio="1:1"), dict(prompt="a boom boat", seed=3, width=32, height=16),
            dict(prompt="a dog", seed=4, aspect_ratio="16:9", guidance=2.0)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    assert gen(tmp_path / "clean", prompts, f"prompts.row_settings={NAMES}", "batch_size=2").complete
    with monkeypatch.context() as m:
        faulty(m, poison=("boom",))
        res = gen(tmp_path / "run", prompts, f"prompts.row_settings={NAMES}", "batch_size=2")
    assert (res.ok, res.failed) == (2, 2)
    again = gen(tmp_path / "run", prompts, f"prompts.row_settings={NAMES}", "batch_size=2", "retry_failed=true")
    assert (again.ok, again.failed, again.generated_here) == (4, 0, 2)
    got = samples(tmp_path / "run")
    assert [(got[i][1]["width"], got[i][1]["height"]) for i in range(4)] == [(32, 64), (48, 48), (32, 16), (64, 32)]
    assert got[0][1]["negative_prompt"] == "dark" and got[0][1]["true_cfg_scale"] == 2.0
    assert tars(tmp_path / "run") == tars(tmp_path / "clean")
    assert json.loads((tmp_path / "run" / "shards" / "000000.stats.json").read_text())["shapes"] == \
        {"32x16": 1, "32x64": 1, "48x48": 1, "64x32": 1}  # the rewritten shard's stats count the new images


def test_rows_appended_to_the_prompt_file_extend_the_run_with_their_own_settings(tmp_path):
    """Rows appended to a finished run's jsonl become new shards, each with its row's size; a bad value among the
    appended rows is a file:line error and the run stays as it was."""
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:4])
    assert gen(tmp_path / "run", prompts, f"prompts.row_settings={NAMES}", "batch_size=2").complete
    before = tars(tmp_path / "run")
    with open(prompts, "a", encoding="utf-8") as f:
        f.write(json.dumps(dict(prompt="a kite", seed=21, width=16, height=64)) + "\n")
        f.write(json.dumps(dict(prompt="a map", seed=22, guidance=-1)) + "\n")
    with pytest.raises(PromptFileError, match=r"p.jsonl:6: guidance: -1 is out of range"):
        gen(tmp_path / "run", prompts, f"prompts.row_settings={NAMES}", "batch_size=2")
    assert tars(tmp_path / "run") == before and not list((tmp_path / "run" / "plan").glob("ext-*"))
    write_jsonl(prompts, ROWS[:4] + [dict(prompt="a kite", seed=21, width=16, height=64),
                                     dict(prompt="a map", seed=22, aspect_ratio="1:2")])
    res = gen(tmp_path / "run", prompts, f"prompts.row_settings={NAMES}", "batch_size=2")
    assert (res.complete, res.ok, res.generated_here) == (True, 6, 2)
    assert {k: v for k, v in tars(tmp_path / "run").items() if k in before} == before  # earlier shards untouched
    got = samples(tmp_path / "run")
    assert [(got[i][1]["width"], got[i][1]["height"]) for i in (4, 5)] == [(16, 64), (32, 64)]
    assert verify.main([str(tmp_path / "run")]) == 0
    from shardgen.dataio.prompts import Shape, load_plan
    from shardgen.dataio.rundir.layout import RunDir

    shapes = load_plan(RunDir(tmp_path / "run")).shapes()  # the extension's rows counted with the first plan's
    assert shapes == {Shape(48, 48): 2, Shape(32, 64): 2, Shape(64, 32): 1, Shape(16, 64): 1}


def test_dry_run_counts_rows_per_shape_and_sizes_the_tars_by_them(mixed, capsys):
    """dry_run=true before a launch (a plan thrown away) and on the finished run (its plan): rows per shape, and
    the expected bytes added up shape by shape, not as if every row had the run's 48x48."""
    from jobs.generate import run
    from shardgen.dataio.shards import sample_bytes_estimate
    from shardgen.run.dryrun import dry_run

    prompts, run_dir, _ = mixed
    want_bytes = sum(sample_bytes_estimate(width=w, height=h, image_format="png") for w, h in SIZES)
    assert want_bytes != len(SIZES) * sample_bytes_estimate(width=48, height=48, image_format="png")
    for where in (run_dir.parent / "not-yet", run_dir):
        cfg = compose_cfg("prompts=jsonl", f"run_dir={where}", f"prompts.path={prompts}", *ARGS,
                          f"prompts.row_settings={NAMES}", "dry_run=true")
        d = dry_run(cfg)
        assert d.shapes == {"48x48": 4, "32x64": 2, "64x32": 1, "32x16": 1}
        assert d.expected_bytes == pytest.approx(want_bytes)
        run(cfg)
        assert "  shapes    4 at 48x48, 2 at 32x64, 1 at 32x16, 1 at 64x32 (rows per width x height; " \
               "prompts.row_settings)\n" in capsys.readouterr().out
    assert not (run_dir.parent / "not-yet").exists()


def test_the_plan_gives_the_runs_and_each_shards_shape_set(mixed):
    """Plan.shapes (counted while planning, for what depends on the shapes a run's calls take: compiled graphs,
    attention sequence lengths) and count_shapes over one shard's rows."""
    from shardgen.dataio.prompts import Shape, count_shapes, load_plan
    from shardgen.dataio.rundir.layout import RunDir

    _, run_dir, _ = mixed
    plan = load_plan(RunDir(run_dir))
    assert plan.shapes() == {Shape(48, 48): 4, Shape(32, 64): 2, Shape(64, 32): 1, Shape(32, 16): 1}
    assert count_shapes(plan.row_rules, plan.rows(1)) == {Shape(32, 16): 1, Shape(32, 64): 1, Shape(48, 48): 2}
    assert [s.label for s in plan.shapes()] == ["48x48", "32x64", "32x16", "64x32"]  # most rows first
    assert RowRules(names=("num_frames",), frame_stride=4, frames=5).shape({"num_frames": 9}) == Shape(1024, 1024, 9)


def test_rows_whose_tokens_a_cp_degree_cannot_split_are_refused_before_any_weight(tmp_path):
    """Ulysses-2 splits each image's tokens over 2 ranks: a row at 48x48 (3x3 = 9 tokens) cannot be split. The
    run's own size passes the launch checks, so the plan's shapes are checked (dry run and launch alike)."""
    from parallel.dims import ParallelConfigError, ParallelDims
    from parallel.strategies import DeviceFacts, ParallelLayout
    from parallel.transformer import sequence_shape
    from shardgen.dataio.prompts import Shape
    from shardgen.run.dryrun import dry_run

    prompts = write_jsonl(tmp_path / "p.jsonl", [dict(prompt="a", width=64, height=32), dict(prompt="b"),
                                                 dict(prompt="c", aspect_ratio="1:1"), dict(prompt="d", width=32)])
    cfg = compose_cfg("prompts=jsonl", f"run_dir={tmp_path / 'run'}", f"prompts.path={prompts}", "height=48",
                      "width=64", "prompts.row_settings=[width,height,aspect_ratio]", "strategy=cp_ulysses",
                      "ulysses_degree=2", "launcher=local", "launcher.nprocs=2", "dry_run=true")
    with pytest.raises(ParallelConfigError, match=r"^prompts.row_settings: 1 rows at 48x48 \(9 tokens\): their"):
        dry_run(cfg)  # 64x32, the run's 64x48 and 32x48 split (8, 12, 6 tokens); 1:1 at 64x48's area is 48x48
    layout = ParallelLayout(ParallelDims(world_size=2, strategy="cp_ulysses", ulysses=2), DeviceFacts("cpu", 0, 2),
                            sequence_shape(cfg))
    with pytest.raises(ParallelConfigError, match=r"^prompts.row_settings: 3 rows at 48x48 \(9 tokens\): their "
                                                  r"image tokens do not divide by the CP degree 2 \(ulysses 2 x ring "
                                                  r"1\); give those rows sizes whose \(H/16\)\*\(W/16\) divides by 2"):
        layout.check_rows({Shape(64, 64): 5, Shape(48, 48): 3})
    layout.check_rows({Shape(64, 64): 5, Shape(32, 48): 3})  # 8 and 6 tokens: fine
    assert not (tmp_path / "run").exists()


def test_an_edit_models_rows_are_checked_with_their_input_images_tokens():
    """Qwen-Image-Edit's input image (fitted to ~1 MP at the row's aspect) joins the sequence Ulysses splits: a row
    at 960x1024 has 3840 tokens of its own, which 8 ranks split, and 4092 of its input, which they do not."""
    from parallel.dims import ParallelConfigError, ParallelDims
    from parallel.strategies import DeviceFacts, ParallelLayout
    from parallel.transformer import sequence_shape
    from shardgen.dataio.prompts import Shape

    cfg = compose_cfg("run_dir=/tmp/x", "model=qwen_image_edit", "model.weights=dummy", "prompts=jsonl",
                      "prompts.row_settings=[image,width,height]")
    layout = ParallelLayout(ParallelDims(world_size=8, strategy="cp_ulysses", ulysses=8), DeviceFacts("cuda", 8, 8),
                            sequence_shape(cfg))
    with pytest.raises(ParallelConfigError, match=r"^prompts.row_settings: 2 rows at 960x1024 \(7932 tokens\): .* "
                                                  r"\(H/16\)\*\(W/16\) plus their input image's divides by 8"):
        layout.check_rows({Shape(1024, 1024): 5, Shape(960, 1024): 2})
    layout.check_rows({Shape(1024, 1024): 5, Shape(768, 1024): 2})  # 3072 + 4144 tokens: fine


def test_a_pandas_parquet_with_nullable_integer_columns_plans_and_generates(tmp_path):
    """pandas stores an integer column that has a null as float64: a row's 32.0 is the whole number 32, a seed's
    11.0 the seed 11, and a null keeps the run's setting."""
    import pandas as pd

    df = pd.DataFrame({"prompt": ["a cat", "a dog"], "height": [32, None], "steps": [2, None], "seed": [11, None]})
    assert str(df["height"].dtype) == "float64"
    df.to_parquet(tmp_path / "p.parquet")
    result = run_rank(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={tmp_path / 'p.parquet'}", *ARGS,
                                  "prompts.row_settings=[height,steps]"))
    assert (result.ok, result.rejected) == (2, 0)
    got = samples(tmp_path / "run")
    assert [(got[i][1]["height"], got[i][1]["steps"]) for i in (0, 1)] == [(32, 2), (48, 1)]
    assert got[0][1]["seed"] == 11


def test_a_fraction_is_still_no_size():
    rules = RowRules(names=("height",), multiple=16, height=48, width=48)
    with pytest.raises(Exception, match="32.5 is not an image height"):
        rules.parse({"height": 32.5})
