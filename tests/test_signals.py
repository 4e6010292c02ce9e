"""Curation signals on the tiny model: phash (identical images, equal hashes; jobs.dedup groups them),
the FLUX reference watermark (it decodes from the written PNG), a CLIP score with a tiny random CLIP."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from jobs.generate import run
from shardgen.dataio.shards.signals import (ClipScorer, SignalConfigError, WATERMARK_BITS, WATERMARK_MESSAGE,
                                            decode_watermark)
from shardgen.tools.verify import read_shard_members
from tests.conftest import compose_cfg

FAST = ("steps=1", "progress=false", "batch_size=2")


def _index(run_dir: Path) -> pd.DataFrame:
    return pd.concat(pd.read_parquet(p) for p in sorted((run_dir / "shards").glob("*.parquet"))).set_index("key")


def _images(run_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for key, mem in read_shard_members(tar).items():
            out[key] = np.asarray(Image.open(io.BytesIO(mem["png"])).convert("RGB"))
    return out


def test_phash_equal_for_identical_images_and_dedup_lists_them(tmp_path, capsys):
    from jobs.dedup import main as dedup

    rows = [{"prompt": "a cat", "seed": 1}, {"prompt": "a dog", "seed": 2}, {"prompt": "a cat", "seed": 1},
            {"prompt": "a bird", "seed": 3}]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(compose_cfg(f"run_dir={tmp_path / 'run'}", "prompts=jsonl", f"prompts.path={f}", "signals=[phash]",
                    "height=32", "width=32", *FAST))
    idx = _index(tmp_path / "run")
    assert idx.loc["0000000000", "phash"] == idx.loc["0000000002", "phash"]
    assert idx["phash"].str.fullmatch("[0-9a-f]{16}").all()
    meta = json.loads(idx.loc["0000000001", "json"])
    assert meta["signals"]["phash"] == idx.loc["0000000001", "phash"]
    capsys.readouterr()
    assert dedup([str(tmp_path / "run"), "--max-distance", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [["0000000000", "0000000002"]]


def test_watermark_is_embedded_and_decodes_from_the_png(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a cat\na dog\n")
    run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "signals=[watermark]", "height=256",
                    "width=256", *FAST))
    idx = _index(tmp_path / "run")
    assert idx["watermark_ok"].all() and (idx["watermark"] == f"{WATERMARK_MESSAGE:012x}").all()
    for px in _images(tmp_path / "run").values():
        assert decode_watermark(px) == WATERMARK_BITS


def _tiny_clip(path: Path) -> Path:
    """A randomly initialised CLIP with the tiny model's CLIP tokenizer, saved like a real one."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    from shardgen.families.flux.tiny import tiny_model_path

    tok = CLIPTokenizer.from_pretrained(str(tiny_model_path()), subfolder="tokenizer")
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=77,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id),
                     vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37,
                                        num_hidden_layers=2, num_attention_heads=2), projection_dim=16)
    CLIPModel(cfg).save_pretrained(path)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(path)
    return path


def test_clip_score_with_a_tiny_random_clip(tmp_path):
    model = _tiny_clip(tmp_path / "clip")
    f = tmp_path / "p.txt"
    f.write_text("a cat\na dog\na bird\n")
    run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "signals=[phash,clip]",
                    f"signals.clip.model={model}", "height=32", "width=32", *FAST))
    idx = _index(tmp_path / "run")
    scorer = ClipScorer(str(model))
    for key, px in _images(tmp_path / "run").items():
        assert idx.loc[key, "clip_score"] == pytest.approx(scorer(px, idx.loc[key, "prompt"]), abs=1e-3)
    assert idx["clip_score"].notna().all() and idx["clip_score"].abs().max() <= 100
    assert idx["clip_score"].nunique() > 1  # image and prompt both matter


@pytest.mark.parametrize("override,needle", [
    (("signals=[clip]",), "set signals.clip.model=PATH"),  # the config's mandatory-value check says it first
    (("signals=[watermark]", "height=16", "width=16"), "at least 256x256"),
])
def test_a_signal_that_cannot_run_fails_before_anything_is_written(tmp_path, override, needle):
    from shardgen.config.validate import ConfigError

    with pytest.raises((SignalConfigError, ConfigError), match=needle):
        run(compose_cfg(f"run_dir={tmp_path / 'run'}", *override, *FAST))
    assert not (tmp_path / "run").exists()


def test_resuming_with_other_signals_is_refused(tmp_path):
    from shardgen.dataio.resume.fingerprint import FingerprintMismatch

    f = tmp_path / "p.txt"
    f.write_text("a cat\n")
    args = (f"run_dir={tmp_path / 'run'}", f"prompts.path={f}", "height=32", "width=32", *FAST)
    run(compose_cfg(*args))
    with pytest.raises(FingerprintMismatch, match=r"signals: run has None, this launch has \['phash'\]"):
        run(compose_cfg(*args, "signals=[phash]"))


def test_phash_after_the_fact_lets_dedup_work_on_a_run_made_without_signals(tmp_path, capsys, monkeypatch):
    """jobs.signals fills the index's phash from the committed tars (the tars untouched); killed after its
    first shard, a rerun does only the rest; then jobs.dedup finds the identical pair and jobs.verify passes."""
    import jobs.signals
    import jobs.verify
    import shardgen.tools.signals_after as after
    from jobs.dedup import main as dedup

    rows = [{"prompt": "a cat", "seed": 1}, {"prompt": "a dog", "seed": 2}, {"prompt": "a bird", "seed": 3},
            {"prompt": "a cat", "seed": 1}]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    assert run(compose_cfg(f"run_dir={run_dir}", "prompts=jsonl", f"prompts.path={f}", "samples_per_shard=2",
                           "height=32", "width=32", *FAST)).ok == 4
    assert dedup([str(run_dir)]) == 2 and "generate with signals=[phash]" in capsys.readouterr().err
    tars = {p.name: p.read_bytes() for p in (run_dir / "shards").glob("*.tar")}
    real, calls = after._add_to_shard, []

    def killed_after_one(plan, shard, functions):
        if calls:
            raise KeyboardInterrupt  # the kill, between two shards' atomic index replacements
        calls.append(shard)
        return real(plan, shard, functions)

    monkeypatch.setattr(after, "_add_to_shard", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        jobs.signals.main([str(run_dir), "--signals", "phash"])
    first = (run_dir / "shards" / "000000.parquet").read_bytes()
    assert _index(run_dir).phash.notna().sum() == 2
    monkeypatch.setattr(after, "_add_to_shard", real)
    capsys.readouterr()
    assert jobs.signals.main([str(run_dir), "signals=[phash]"]) == 0
    assert "phash added to 2 images in 1 shard(s); 1 of 2 committed shards had them already" in capsys.readouterr().out
    assert (run_dir / "shards" / "000000.parquet").read_bytes() == first  # not redone
    assert {p.name: p.read_bytes() for p in (run_dir / "shards").glob("*.tar")} == tars
    assert dedup([str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [["0000000000", "0000000003"]]
    assert jobs.verify.main([str(run_dir)]) == 0
    assert jobs.signals.main([str(run_dir), "--signals", "watermark"]) == 2
    assert "watermark changes pixels" in capsys.readouterr().err
