"""A shard's samples reach the writer in row order, whatever order the batches (by shape) make them in."""

from types import SimpleNamespace

from shardgen.run.shardrun import ShardRun


def test_samples_made_ahead_wait_for_the_rows_before_them():
    run = ShardRun(shard=7, n_done=10, rows=[SimpleNamespace(index=10 + i) for i in range(5)])
    assert run.in_order([2, 3], ["c", "d"]) == [] and run.made == 12  # made ahead: counted, not handed over
    assert run.in_order([0], ["a"]) == ["a"] and run.written == 1
    assert run.in_order([1, 4], ["b", "e"]) == ["b", "c", "d", "e"]
    assert (run.written, run.made) == (5, 15)


def test_only_the_rows_to_redo_are_generated():
    rows = [SimpleNamespace(index=i) for i in range(4)]
    assert ShardRun(0, 0, rows).todo(rows) == rows
    assert [r.index for r in ShardRun(0, 0, rows, redo={1, 3}).todo(rows)] == [1, 3]
