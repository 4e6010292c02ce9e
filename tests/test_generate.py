"""The main job end to end in one process: shards a user can read, exact prompts, seeds, resume."""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import pandas as pd
import pytest
import webdataset as wds
from PIL import Image

from shardgen.dataio.prompts.read import PromptFileError
from shardgen.dataio.resume.fingerprint import FingerprintMismatch
from shardgen.tools.verify import read_shard_members
from jobs.generate import run
from tests.conftest import ROOT, compose_cfg, write_lines

FAST = ("height=16", "width=16", "steps=1", "progress=false")


def shard_images(run_dir: Path) -> dict[str, bytes]:
    """key -> image bytes over every committed shard."""
    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for key, mem in read_shard_members(tar).items():
            img = [v for k, v in mem.items() if k in ("png", "jpg", "webp")]
            out[key] = img[0] if img else None
    return out


def test_default_job_writes_shards_webdataset_reads(tmp_path):
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", "samples_per_shard=24", "progress=false")
    result = run(cfg)
    assert (result.total, result.ok, result.failed, result.complete) == (64, 64, 0, True)
    tars = sorted((tmp_path / "run" / "shards").glob("*.tar"))
    assert [t.name for t in tars] == ["000000.tar", "000001.tar", "000002.tar"]
    prompts = (ROOT / "examples" / "prompts.txt").read_text().splitlines()
    ds = wds.WebDataset([str(t) for t in tars], shardshuffle=False).decode("pil")
    samples = list(ds)
    assert len(samples) == 64
    for s in samples:
        assert s["png"].size == (128, 128) and s["png"].mode == "RGB"
        meta = s["json"]
        assert s["txt"] == prompts[meta["index"]] == meta["prompt"]
        assert s["__key__"] == f"{meta['index']:010d}"
        assert meta["status"] == "ok" and meta["model"] == "tiny" and meta["steps"] == 4
    # the images are not all the same (seeds differ per sample)
    assert len({s["png"].tobytes() for s in samples}) == 64


def test_partiprompts_like_tsv_is_carried_byte_for_byte(tmp_path):
    rows = [f'prompt {i} with "quotes", commas; and unicode é✓ {"x" * (i % 7)}' for i in range(1632)]
    tsv = tmp_path / "parti.tsv"
    tsv.write_text("Prompt\tCategory\tChallenge\tNote\n"
                   + "".join(f"{p}\tCat{i % 5}\tBasic\t{'' if i % 2 else 'n'}\n" for i, p in enumerate(rows)),
                   encoding="utf-8")
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts=parti", f"prompts.path={tsv}", "batch_size=32",
                      "samples_per_shard=500", *FAST)
    assert run(cfg).ok == 1632
    seen = 0
    for tar in sorted((tmp_path / "run" / "shards").glob("*.tar")):
        for key, mem in read_shard_members(tar).items():
            meta = json.loads(mem["json"])
            i = meta["index"]
            assert mem["txt"] == rows[i].encode("utf-8")
            assert (meta["Category"], meta["Challenge"], meta["Note"]) == (f"Cat{i % 5}", "Basic", "" if i % 2 else "n")
            seen += 1
    assert seen == 1632


def test_batch_size_does_not_change_pixels(tmp_path):
    a = run(compose_cfg(f"run_dir={tmp_path / 'b1'}", "batch_size=1", "prompts.limit=16", "progress=false"))
    b = run(compose_cfg(f"run_dir={tmp_path / 'b8'}", "batch_size=8", "prompts.limit=16", "progress=false"))
    assert a.ok == b.ok == 16
    ia, ib = shard_images(tmp_path / "b1"), shard_images(tmp_path / "b8")
    assert ia.keys() == ib.keys() and len(ia) == 16
    assert all(ia[k] == ib[k] for k in ia)


def test_jsonl_row_seed_and_fields_pass_through(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "a cat", "seed": 7, "id": "x1"}\n{"text": "a cat", "seed": 7, "id": "x2"}\n'
                 '{"text": "a cat", "id": "x3"}\n')
    run(compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts=jsonl", f"prompts.path={f}", "prompts.field=text", *FAST))
    members = read_shard_members(tmp_path / "run" / "shards" / "000000.tar")
    metas = {k: json.loads(m["json"]) for k, m in members.items()}
    assert [metas[k]["id"] for k in sorted(metas)] == ["x1", "x2", "x3"]
    assert metas["0000000000"]["seed"] == metas["0000000001"]["seed"] == 7
    # same prompt + same seed = same image; the third row gets the run's own seed rule
    assert members["0000000000"]["png"] == members["0000000001"]["png"] != members["0000000002"]["png"]


@pytest.mark.parametrize("fmt,quality,magic", [("jpg", 80, b"\xff\xd8"), ("webp", 90, b"RIFF")])
def test_lossy_image_formats(tmp_path, fmt, quality, magic):
    run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"image_format={fmt}", f"image_quality={quality}",
                    "prompts.limit=3", *FAST))
    members = read_shard_members(tmp_path / "run" / "shards" / "000000.tar")
    assert len(members) == 3
    for mem in members.values():
        assert mem[fmt].startswith(magic)
        Image.open(io.BytesIO(mem[fmt])).load()


BAD_INPUTS = [
    ("p.txt", b"a cat\n   \na dog\n", "txt", "p.txt:2:"),
    ("p.txt", b"a cat\na \xff dog\n", "txt", "p.txt:2:"),
    ("p.jsonl", b'{"prompt": "a"}\n{"prompt": \n', "jsonl", "p.jsonl:2:"),
    ("p.jsonl", b'{"prompt": "a"}\n{"other": "b"}\n', "jsonl", "p.jsonl:2:"),
    ("p.csv", b"prompt,cat\na,b\nc,d,e\n", "csv", "p.csv:3:"),
    ("p.tsv", b"prompt\tcat\nok\tx\n\tempty\n", "tsv", "p.tsv:3:"),
]


@pytest.mark.parametrize("name,data,fmt,where", BAD_INPUTS)
def test_bad_input_names_file_and_line_and_commits_nothing(tmp_path, name, data, fmt, where):
    f = tmp_path / name
    f.write_bytes(data)
    cfg = compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts={fmt}", f"prompts.path={f}", *FAST)
    with pytest.raises(PromptFileError) as e:
        run(cfg)
    assert where in str(e.value) and "prompts.on_bad_row=skip" in str(e.value)
    assert not list(tmp_path.glob("run/shards/*.tar"))
    assert not (tmp_path / "run" / "plan").exists()


def test_skip_records_rejects_as_samples(tmp_path):
    f = write_lines(tmp_path / "p.txt", ["a cat", "  ", "a dog"])
    r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "prompts.on_bad_row=skip", *FAST))
    assert (r.ok, r.rejected, r.total) == (2, 1, 3)
    members = read_shard_members(tmp_path / "run" / "shards" / "000000.tar")
    assert "0000000001" not in members  # the image tars hold images only; the reject is in the index
    index = pd.read_parquet(tmp_path / "run" / "shards" / "000000.parquet").set_index("key")
    bad = json.loads(index.loc["0000000001", "json"])
    assert bad["status"] == "rejected" and "whitespace" in bad["error"] and bad["line"] == 2
    stats = json.loads((tmp_path / "run" / "shards" / "000000.stats.json").read_text())
    assert stats["rejected"] == 1 and stats["failed_samples"][0]["key"] == "0000000001"


def test_rerun_finished_does_nothing_and_half_finished_completes(tmp_path, capsys):
    args = (f"run_dir={tmp_path / 'run'}", "samples_per_shard=8", "prompts.limit=24", *FAST)
    run(compose_cfg(*args))
    before = shard_images(tmp_path / "run")
    assert "already complete" not in capsys.readouterr().out
    run(compose_cfg(*args))
    assert "already complete (24 samples in 3 shards); nothing to do" in capsys.readouterr().out
    # lose a committed shard: the rerun makes exactly that one again, identical
    (tmp_path / "run" / "shards" / "000001.stats.json").unlink()
    (tmp_path / "run" / "shards" / "000001.tar").unlink()
    r = run(compose_cfg(*args))
    assert r.generated_here == 8 and r.complete
    assert shard_images(tmp_path / "run") == before


def test_changed_settings_are_refused_naming_the_fields(tmp_path):
    run(compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts.limit=4", *FAST))
    with pytest.raises(Exception) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts.limit=4", "seed=1", "steps=2", "height=16", "width=16",
                        "progress=false"))
    msg = str(e.value)
    assert "seed: run has 0, this launch has 1" in msg and "steps: run has 1, this launch has 2" in msg
    # the seed made the plan: allow_fingerprint_change could not apply it, so only what works is suggested
    assert "launch it with its original settings (seed=0: the run's plan was made from them)" in msg
    assert "allow_fingerprint_change" not in msg
    assert "model.sha256" not in msg  # refused before the model's bytes are hashed: the model did not change


def test_every_fix_a_refusal_suggests_works(tmp_path):
    args = (f"run_dir={tmp_path / 'run'}", *FAST)
    run(compose_cfg(*args, "prompts.limit=4"))
    with pytest.raises(FingerprintMismatch) as e:
        run(compose_cfg(*args))
    msg = str(e.value)
    assert "prompts.limit=4" in msg and "allow_fingerprint_change" not in msg
    assert run(compose_cfg(*args, "prompts.limit=4")).complete  # the suggested fix
    with pytest.raises(FingerprintMismatch, match="allow_fingerprint_change=true"):
        run(compose_cfg(*args, "prompts.limit=4", "steps=2"))  # a setting that can change: that fix is offered
    assert run(compose_cfg(*args, "prompts.limit=4", "steps=2", "allow_fingerprint_change=true")).complete


def test_prompt_file_is_hashed_once_per_change_and_an_edit_is_still_refused(tmp_path, monkeypatch):
    """Relaunches and requeues reuse the prompt file's hash while the file is unchanged on disk; an edit
    that keeps size and mtime (what cp -p or rsync -t leave behind) still changes the fingerprint."""
    import shardgen.dataio.resume.fingerprint as fingerprint

    f = write_lines(tmp_path / "p.txt", ["a cat", "a dog"])
    args = (f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", *FAST)
    run(compose_cfg(*args))
    hashed = []
    real = fingerprint.file_sha256
    monkeypatch.setattr(fingerprint, "file_sha256", lambda path: hashed.append(path) or real(path))
    assert run(compose_cfg(*args)).complete
    assert hashed == []
    st = f.stat()
    f.write_text("a cow\na dog\n")  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime
    with pytest.raises(Exception, match=f"prompts.path={f}: not this run's prompt file.*other content"):
        run(compose_cfg(*args))
    assert len(hashed) == 1


@pytest.mark.parametrize("override,needle", [
    ("image_format=gif", "image_format='gif'"),
    ("height=100", "height=100: must be a positive multiple of 16"),
    ("batch_size=0", "batch_size=0"),
    ("dtype=int8", "dtype='int8'"),
    ("strategy.max_memory=70G", "strategy.max_memory: '70G' is not a memory size: use e.g. 70GiB"),
])
def test_bad_settings_fail_before_anything_is_written(tmp_path, override, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", override, "progress=false"))
    assert not (tmp_path / "run").exists()


def test_pickle_only_model_directory_is_refused(tmp_path):
    d = tmp_path / "model"
    (d / "transformer").mkdir(parents=True)
    (d / "model_index.json").write_text("{}")
    (d / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(Exception, match="only pickle checkpoints"):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", "model=flux_dev", f"model.source={d}", "prompts.limit=2",
                        "progress=false", "dtype=float32"))


def test_ctrl_c_while_planning_a_new_run_says_nothing_was_written_and_after_it_resumable(tmp_path, monkeypatch):
    import shardgen.run.runner as runner
    from jobs.generate import interrupted_message

    d = tmp_path / "run"
    args = (f"run_dir={d}", "prompts.limit=4", *FAST)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(runner, "build_plan", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run(compose_cfg(*args))
    assert not d.exists()
    assert interrupted_message(str(d), "CMD").startswith(f"interrupted before {d} held a run: nothing was written. "
                                                          "Run the command again to start:")
    run(compose_cfg(*args))
    assert interrupted_message(str(d), "CMD").startswith(f"interrupted. {d} is resumable")


def test_ctrl_c_once_the_plan_is_in_place_keeps_the_run_and_a_rerun_completes_it(tmp_path, monkeypatch):
    import shardgen.run.runner as runner
    from jobs.generate import interrupted_message

    d = tmp_path / "run"
    args = (f"run_dir={d}", "prompts.limit=4", *FAST)
    build_plan = runner.build_plan

    def planned_then_interrupted(*a, **k):
        build_plan(*a, **k)  # plan/ renamed into place: the moment `plan.json` appears
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(runner, "build_plan", planned_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            run(compose_cfg(*args))
    assert interrupted_message(str(d), "CMD").startswith(f"interrupted. {d} is resumable")
    result = run(compose_cfg(*args))
    assert (result.total, result.ok, result.complete) == (4, 4, True)


def test_ctrl_c_mid_shard_gives_up_its_claim_so_a_rerun_resumes_it_at_once(tmp_path):
    """The default lease (120 s): a re-run that had to wait for the interrupted claim to expire would idle at the
    end of the run for up to two minutes."""
    from shardgen.run.runner import run_rank

    d = tmp_path / "run"
    args = (f"run_dir={d}", "prompts.limit=8", "samples_per_shard=4", "batch_size=2", *FAST)
    ends = []

    def stop_at_the_second_batch(event, worker):
        if event == "end":
            ends.append(event)
            if len(ends) == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_rank(compose_cfg(*args), on_batch=stop_at_the_second_batch)
    assert list((d / "work").glob("*.ckpt.json"))  # half a shard made: resumed, not started over
    assert not [p for p in (d / "claims").rglob("*") if p.is_file()]
    t0 = time.monotonic()
    result = run_rank(compose_cfg(*args))
    assert (result.total, result.ok, result.complete) == (8, 8, True)
    assert time.monotonic() - t0 < 60


def test_a_foreign_run_dir_and_a_resume_with_other_settings_are_refused_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    from shardgen.dataio.prompts import prompt_file_path
    from shardgen.dataio.resume.fingerprint import (check_or_write_fingerprint, compute_fingerprint, prompt_file_hash,
                                                    remember_prompt_hash)
    from shardgen.dataio.rundir import RunDir
    from shardgen.models.versions import model_version

    cfg, made = compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts.limit=2", *FAST), RunDir(tmp_path / "run")
    digest, identity = prompt_file_hash(made, prompt_file_path(cfg.prompts.path))  # a run with a sample, as a launch
    check_or_write_fingerprint(made, compute_fingerprint(cfg, digest, model_version(cfg.model)))  # leaves it
    remember_prompt_hash(made, digest, identity)
    made.create()
    made.shard_file(0).write_bytes(b"")
    code = ("import sys\nfrom jobs.generate import run\nfrom shardgen.errors import UserError\n"
            "from tests.conftest import compose_cfg\n"
            f"for args in [('run_dir={tmp_path / 'mine'}',), ('run_dir={tmp_path / 'run'}', 'prompts.limit=2', "
            f"{', '.join(repr(a) for a in FAST if a != 'steps=1')}, 'steps=2')]:\n"
            "    try:\n        run(compose_cfg(*args))\n    except UserError as e:\n        print(str(e).splitlines()[0])\n"
            "print('torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.stdout.splitlines()[-3:] == [
        f"run_dir {tmp_path / 'mine'} holds files (notes.txt) and is not a shardgen run (no .shardgen-run); shardgen "
        f"writes only into a new or empty directory or an existing run, so nothing of yours is touched. Choose another "
        f"run_dir (e.g. run_dir={tmp_path / 'mine' / 'run'})",
        f"{tmp_path / 'run' / 'fingerprint.json'} says {tmp_path / 'run'} was made with other settings; resuming would "
        "mix different samples:", "False"], p.stderr


def test_a_rejected_row_is_counted_as_rejected_not_as_generated(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\na dog\n   \na tree\n")
    result = run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={tmp_path / 'p.txt'}",
                             "prompts.on_bad_row=skip", *FAST))
    assert (result.ok, result.rejected, result.generated_here) == (3, 2, 3)  # the images/s counts 3 images
    prom = (tmp_path / "run" / "metrics" / "rank000.prom").read_text()
    assert re.search(r"^shardgen_generated_samples_total(\{[^}]*\})? 3(\.0)?$", prom, re.M), prom


@pytest.mark.parametrize("source, says", [
    ("{tmp}/models/FLUX", "model.source={tmp}/models/FLUX: no such directory ({tmp} exists, 'models' in it does not)"),
    ("{tmp}/p.txt", "model.source={tmp}/p.txt: a file, not a model directory"),
    ("{tmp}", "model.source={tmp}: no model_index.json in this directory"),
])
def test_a_local_model_source_that_is_no_model_is_named_as_such(tmp_path, source, says):
    (tmp_path / "p.txt").write_text("a cat\n")
    source, says = source.format(tmp=tmp_path), says.format(tmp=tmp_path)
    with pytest.raises(ValueError) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", "model=flux_dev", f"model.source={source}", "progress=false"))
    assert str(e.value).startswith(says) and "hub" not in str(e.value).split(";")[0]
    assert not (tmp_path / "run").exists()


def test_an_unreachable_hub_is_said_with_its_cause_and_no_pointer_to_a_stack_trace(tmp_path, monkeypatch):
    from diffusers import FluxPipeline

    from shardgen.models.loader import ModelLoadError

    def offline(source, **kw):
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as cause:
            raise OSError(f"Cannot load model {source}: an error occurred while trying to fetch metadata from the "
                          "Hub. Please check out the root cause in the stacktrace above.") from cause

    monkeypatch.setattr(FluxPipeline, "from_pretrained", offline)
    with pytest.raises(ModelLoadError) as e:
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", "model=flux_dev", "prompts.limit=1", "progress=false"))
    assert "stacktrace" not in str(e.value)
    assert "(cause: ConnectionError: [Errno -2] Name or service not known)" in str(e.value)
    assert "point model.source at the local directory" in str(e.value)


def test_a_hub_model_missing_from_the_cache_under_hf_hub_offline_is_refused_before_planning(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 (an offline cluster) and a hub id that is not in the Hugging Face cache: a ConfigError (one
    line, exit 2) naming the cache and what to do, before the prompts are planned and before any weight is read;
    the same id in the cache (a snapshot its ref names) passes that check and is left to loading."""
    from huggingface_hub import constants

    from shardgen.errors import ConfigError
    from shardgen.models.loader import check_source

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    d = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        run(compose_cfg(f"run_dir={d}", "model=flux_dev", "prompts.limit=1", "progress=false"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.source=black-forest-labs/FLUX.1-dev: not in the Hugging Face "
                                              f"cache ({cache})"), msg
    assert "hf download black-forest-labs/FLUX.1-dev" in msg
    assert not (d / "plan").exists()
    repo = cache / "models--black-forest-labs--FLUX.1-dev"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    check_source(compose_cfg("model=flux_dev").model)  # cached: no refusal
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    check_source(compose_cfg("model=flux_dev", "model.source=someone/not-cached").model)  # online: left to loading


def test_a_repeated_launch_keeps_no_new_config_file_and_a_changed_one_keeps_one(tmp_path, capsys):
    d = tmp_path / "run"
    args = (f"run_dir={d}", "prompts.limit=2", *FAST)
    run(compose_cfg(*args))
    run(compose_cfg(*args))
    assert "nothing to do" in capsys.readouterr().out
    assert sorted(p.name for p in d.glob("config*.yaml")) == ["config.yaml"]
    run(compose_cfg(*args, "batch_size=2"))
    run(compose_cfg(*args, "batch_size=2"))
    later = sorted(p.name for p in d.glob("config.*.yaml"))
    assert len(later) == 1 and "batch_size: 2" in (d / later[0]).read_text()
