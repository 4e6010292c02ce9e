"""The operator's view (issue 22): messages, help, progress of a run in progress, dry runs, exact resumes."""

from __future__ import annotations

import logging

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
