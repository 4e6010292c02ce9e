"""The operator's view (issue 22): messages, help, progress of a run in progress, dry runs, exact resumes."""

from __future__ import annotations

import logging

import pytest

from shardgen.dataio.plan import PromptSource, resolve_samples_per_shard
from tests.conftest import compose_cfg


def test_a_tsv_header_is_not_counted_and_a_video_plan_says_mp4(tmp_path, caplog):
    from shardgen.run.runner import shard_sizing

    tsv = tmp_path / "p.tsv"
    tsv.write_text("Prompt\tCategory\n" + "".join(f"prompt {i}\tc\n" for i in range(30)))
    with caplog.at_level(logging.INFO, logger="shardgen"):
        resolve_samples_per_shard(None, PromptSource(str(tsv), "tsv", field="Prompt"),
                                  **shard_sizing(compose_cfg("height=64", "width=64"), 1))
        resolve_samples_per_shard(None, PromptSource(str(tsv), "tsv", field="Prompt"),
                                  **shard_sizing(compose_cfg("model=tiny_video"), 1))
    image, video = [r.getMessage() for r in caplog.records if "samples_per_shard=" in r.getMessage()]
    assert "30 prompts over 1 replica" in image and "64x64 png sample" in image
    assert "64x64 mp4 of 9 frames sample" in video and "png" not in video


@pytest.mark.slow
def test_a_resumed_run_has_the_uninterrupted_runs_tar_bytes(tmp_path):
    """Member mtimes are fixed and timing stays out of the sample json: the tars are identical, not only the PNGs."""
    import time

    from shardgen.run.runner import run_rank

    args = ("height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=6", "batch_size=2",
            "prompts.limit=12", "lease_s=1", "heartbeat_s=0.25")  # our own interrupted claim expires soon
    run_rank(compose_cfg(f"run_dir={tmp_path / 'whole'}", *args))
    batches = []

    def stop_at_the_second_batch(event, worker):
        if event == "end" and len(batches) == 1:
            raise KeyboardInterrupt
        batches.append(event) if event == "end" else None

    time.sleep(1.1)  # a member mtime taken from the clock would differ now
    with pytest.raises(KeyboardInterrupt):
        run_rank(compose_cfg(f"run_dir={tmp_path / 'resumed'}", *args), on_batch=stop_at_the_second_batch)
    assert list((tmp_path / "resumed" / "work").glob("*.ckpt.json"))  # a partial shard to resume
    assert run_rank(compose_cfg(f"run_dir={tmp_path / 'resumed'}", *args)).complete
    whole = sorted((tmp_path / "whole" / "shards").glob("*.tar"))
    assert len(whole) == 2
    for tar in whole:
        assert (tmp_path / "resumed" / "shards" / tar.name).read_bytes() == tar.read_bytes()
    import pandas as pd

    index = pd.read_parquet(tmp_path / "resumed" / "shards" / "000001.parquet")
    assert index.gen_s.notna().all()  # the timing is kept in the index (jobs.report's histogram)
