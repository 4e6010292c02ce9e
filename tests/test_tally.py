"""A replica's counts of what its batches made, and the stop when every sample keeps failing."""

import pytest

from shardgen.dataio.shards import Sample
from shardgen.run.tally import MAX_FAILED_BATCHES, BatchTally, BrokenSetupError


def sample(status: str) -> Sample:
    return Sample(key="k", index=0, prompt="p", meta={}, status=status, failure="boom" if status == "failed" else None)


def test_rejected_rows_are_not_generated_and_share_no_time():
    tally, made = BatchTally(), [sample("ok"), sample("ok"), sample("rejected")]
    tally.count(made, 3.0)
    assert (tally.generated, tally.gen_s) == (2, 3.0)
    assert [s.gen_s for s in made[:2]] == [1.5, 1.5]


def test_only_consecutive_batches_of_failures_stop_the_replica():
    tally = BatchTally()
    for _ in range(MAX_FAILED_BATCHES - 1):
        tally.count([sample("failed")], 1.0)
    tally.count([sample("rejected")], 1.0)  # nothing generated: the streak goes on
    tally.count([sample("failed"), sample("ok")], 1.0)  # one good sample ends it
    for _ in range(MAX_FAILED_BATCHES - 1):
        tally.count([sample("failed")], 1.0)
    with pytest.raises(BrokenSetupError, match=f"every sample of the last {MAX_FAILED_BATCHES} batches failed, "
                                               "last with: boom"):
        tally.count([sample("failed")], 1.0)
