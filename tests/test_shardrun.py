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


def test_a_batch_takes_the_samples_made_ahead_only_for_its_own_rows_and_settings():
    from dataclasses import replace

    from shardgen.dataio.shards import Sample
    from shardgen.run.generation import GenSettings
    from shardgen.run.shardrun import MadeAhead
    from tests.conftest import compose_cfg

    eager = GenSettings.from_cfg(compose_cfg("fp8=true", "compile=false"), "dp")
    rows = [SimpleNamespace(index=i) for i in range(4)]
    ok = [Sample(str(i), i, "p", {}, object()) for i in range(4)]
    failed = Sample("9", 9, "p", {}, None, "non-finite pixels", "failed")

    def ahead():
        return MadeAhead(eager, {(0, 1): (ok[:2], 2.0), (2, 3): (ok[2:], 1.5), (8, 9): ([ok[0], failed], 1.0)})

    made = ahead()
    untuned = replace(eager, accel=replace(eager.accel, compile_tuning=not eager.accel.compile_tuning))
    untuned = replace(untuned, latents="mid-sample checkpoints")  # the run's, which the calibration leaves out
    assert made.take(untuned, rows[:2]) == (ok[:2], 2.0)  # tuning counts only where the blocks are compiled
    assert made.take(eager, rows[2:]) == (ok[2:], 1.5)
    assert made.take(eager, [SimpleNamespace(index=8), SimpleNamespace(index=9)]) is None  # a failure: made again
    made = ahead()
    assert made.take(eager, rows[1:3]) is None and not made.batches  # the run went another way: all dropped
    made = ahead()
    compiled = replace(eager, accel=replace(eager.accel, compile=True))
    assert made.take(compiled, rows[:2]) is None and not made.batches
    assert ahead().take(replace(eager, steps=eager.steps + 1), rows[:2]) is None
