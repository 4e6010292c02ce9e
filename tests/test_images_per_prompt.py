"""Several images per prompt (``images_per_prompt``): one sample per image, each with its own key and seed, the same
bytes whatever the batch size, exactly once through a kill."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from jobs import verify
from shardgen.dataio.prompts.plan import image_seed, sample_seed
from shardgen.tools.verify import read_shard_members
from shardgen.run.runner import run_rank
from tests.conftest import compose_cfg
from tests.test_generate import shard_images

PROMPTS = ["a cat", "a dog", "a red car", "a tree in fog", "a boat", "a cup of tea"]
ARGS = ("height=32", "width=32", "steps=1", "progress=false", "images_per_prompt=4", "samples_per_shard=8",
        "lease_s=1", "heartbeat_s=0.25")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ipp") / "p.txt"
    path.write_text("".join(p + "\n" for p in PROMPTS))
    return path


def gen(run_dir: Path, prompts: Path, *extra: str, **kw):
    return run_rank(compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *ARGS, *extra), **kw)


def interrupted_after(batches: int):
    """An ``on_batch`` hook that stops the job as Ctrl-C would once ``batches`` batches ended."""
    ends = []

    def hook(event, worker):
        if event == "end":
            ends.append(event)
            if len(ends) == batches:
                raise KeyboardInterrupt

    return hook


def tars(run_dir: Path) -> dict[str, bytes]:
    return {t.name: t.read_bytes() for t in sorted((run_dir / "shards").glob("*.tar"))}


def samples(run_dir: Path) -> dict[str, dict]:
    return {k: json.loads(m["json"]) for t in sorted((run_dir / "shards").glob("*.tar"))
            for k, m in read_shard_members(t).items()}


@pytest.fixture(scope="module")
def batch3(prompts, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("b3") / "run"
    result = gen(d, prompts, "batch_size=3")
    assert (result.ok, result.total, result.complete) == (24, 24, True)
    return d


def test_four_images_of_six_prompts_are_24_samples_with_their_own_keys_and_seeds(batch3, capsys):
    got = samples(batch3)
    assert len(got) == 24 and sorted(got) == [f"{i:010d}" for i in range(24)]
    for key, meta in got.items():
        i, k = divmod(int(key), 4)
        assert (meta["index"], meta["prompt_index"], meta["image"], meta["prompt"]) == (int(key), i, k, PROMPTS[i])
        assert meta["seed"] == image_seed(sample_seed(0, i), k)
    assert len({m["seed"] for m in got.values()}) == 24
    assert got["0000000000"]["seed"] == sample_seed(0, 0)  # image 0: the seed one image per prompt gives
    assert verify.main([str(batch3)]) == 0
    assert "24/24 samples (24 ok)" in capsys.readouterr().out


def test_the_index_records_the_prompt_and_the_image(batch3):
    import pandas as pd

    df = pd.read_parquet(sorted((batch3 / "shards").glob("*.parquet"))).sort_values("index")
    assert df["prompt_index"].tolist() == [i // 4 for i in range(24)]
    assert df["image"].tolist() == [i % 4 for i in range(24)]


def test_images_are_the_same_bytes_at_batch_1(batch3, prompts, tmp_path):
    assert gen(tmp_path / "b1", prompts, "batch_size=1").complete
    assert tars(tmp_path / "b1") == tars(batch3)


def test_a_killed_run_resumes_to_every_image_exactly_once(batch3, prompts, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        gen(tmp_path / "k", prompts, "batch_size=3", on_batch=interrupted_after(3))
    assert len(list((tmp_path / "k" / "shards").glob("*.tar"))) < 3  # stopped part-way
    time.sleep(1.1)  # our own claim expires (lease_s=1)
    assert gen(tmp_path / "k", prompts, "batch_size=2").complete
    assert tars(tmp_path / "k") == tars(batch3)
    assert verify.main([str(tmp_path / "k")]) == 0


def test_shards_hold_whole_prompts_and_another_count_is_another_run(prompts, tmp_path):
    from shardgen.config.validate import ConfigError
    from shardgen.dataio.resume.fingerprint import FingerprintMismatch

    with pytest.raises(ConfigError, match=r"samples_per_shard=6: a shard holds whole prompts, images_per_prompt=4 "
                                          r"images each: use a multiple of 4 \(e.g. samples_per_shard=4\)"):
        gen(tmp_path / "r", prompts, "samples_per_shard=6")
    assert gen(tmp_path / "r", prompts, "prompts.limit=2").ok == 8
    with pytest.raises(FingerprintMismatch, match="images_per_prompt: run has 4, this launch has 2"):
        gen(tmp_path / "r", prompts, "prompts.limit=2", "images_per_prompt=2")


ROWS = ['{"prompt": "a cat", "images_per_prompt": 2}', '{"prompt": "a dog"}',
        '{"prompt": "a car", "images_per_prompt": 3}', '{"prompt": "a hat", "images_per_prompt": 2.0}',
        '{"prompt": "a cup", "images_per_prompt": 0}']
OWN = ("prompts.row_settings=[images_per_prompt]", "images_per_prompt=1", "samples_per_shard=2",
       "prompts.on_bad_row=skip")


@pytest.fixture(scope="module")
def own_counts(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("own")
    (d / "p.jsonl").write_text("\n".join(ROWS) + "\n")
    result = gen(d / "b3", d / "p.jsonl", *OWN, "batch_size=3")
    assert (result.ok, result.rejected, result.complete) == (8, 1, True)
    return d / "p.jsonl", d / "b3"


def test_a_row_asking_for_two_images_gets_two(own_counts, capsys):
    _, run_dir = own_counts
    got = samples(run_dir)
    assert [(m["prompt_index"], m["image"]) for _, m in sorted(got.items())] == \
        [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1)]
    assert got["0000000001"]["seed"] == image_seed(sample_seed(0, 0), 1)
    assert verify.main([str(run_dir)]) == 0
    assert "9/9 samples (8 ok, 1 rejected)" in capsys.readouterr().out


def test_rows_own_counts_give_the_same_bytes_at_batch_1_and_through_a_kill(own_counts, tmp_path):
    prompts, run_dir = own_counts
    assert gen(tmp_path / "b1", prompts, *OWN, "batch_size=1").complete
    assert tars(tmp_path / "b1") == tars(run_dir)
    with pytest.raises(KeyboardInterrupt):
        gen(tmp_path / "k", prompts, *OWN, "batch_size=1", on_batch=interrupted_after(3))
    time.sleep(1.1)  # our own claim expires (lease_s=1)
    assert gen(tmp_path / "k", prompts, *OWN, "batch_size=2").complete
    assert tars(tmp_path / "k") == tars(run_dir)


@pytest.mark.slow
def test_tensor_parallel_ranks_make_the_one_rank_images(batch3, prompts, tmp_path, caplog):
    """tp-2 under gloo: two ranks share each pipeline call of a replica, with one generator per image. Typed as
    ``strategy=tp tp_degree=2`` alone: the job starts the replica's two ranks itself (as launcher=local would)."""
    from jobs.generate import run

    with caplog.at_level("INFO", logger="shardgen"):
        run(compose_cfg(f"run_dir={tmp_path / 'tp2'}", f"prompts.path={prompts}", *ARGS, "batch_size=3",
                        "strategy=tp", "tp_degree=2"))
    assert "one replica of tp 2 takes 2 ranks: starting them on this machine" in caplog.text
    assert shard_images(tmp_path / "tp2") == shard_images(batch3) and len(shard_images(batch3)) == 24
    assert {m["strategy"] for m in samples(tmp_path / "tp2").values()} == {"tp"}  # the json says how it was made


def test_a_changed_count_of_samples_per_shard_is_refused_naming_its_file(own_counts, tmp_path):
    import shutil

    import numpy as np

    from shardgen.dataio.prompts.plan import PlanError, load_plan
    from shardgen.dataio.rundir.layout import RunDir

    shutil.copytree(own_counts[1], tmp_path / "run")
    path = tmp_path / "run" / "plan" / "samples.npy"
    np.save(path, np.load(path) + 1)
    with pytest.raises(PlanError, match=r"samples.npy: does not match the checksum in plan.json"):
        load_plan(RunDir(tmp_path / "run"))


def test_a_dry_run_counts_the_images_and_sizes_the_tars_by_them(prompts, tmp_path):
    from shardgen.run.dryrun import describe, dry_run

    d = dry_run(compose_cfg(f"run_dir={tmp_path / 'r'}", f"prompts.path={prompts}", *ARGS, "dry_run=true"))
    assert "  prompts   6 (0 rejected rows) x 4 images = 24 samples" in describe(d)
    assert (d.prompts, d.shards, d.samples_per_shard) == (24, 3, 8)
    one = dry_run(compose_cfg(f"run_dir={tmp_path / 'r'}", f"prompts.path={prompts}", *ARGS, "dry_run=true",
                              "images_per_prompt=1"))
    assert d.expected_bytes == pytest.approx(4 * one.expected_bytes)
