"""The replica worker's teardown and the launcher's handle on a rank: no thread outlives the worker, even when
closing the sink fails; the writers a preempted rank drains are exactly the ones still open."""

from __future__ import annotations

import threading

import pytest

from shardgen.dataio.rundir.claims import Claimer, owner_record
from shardgen.dataio.rundir.layout import RunDir
from shardgen.run.replica import ReplicaContext, ReplicaWorker
from shardgen.run.runner import RankControl
from shardgen.run.watchdog import StallWatchdog


class FailingSink:
    """A sink whose close fails (a full disk while making the last batch durable)."""

    wait_s = 0.0

    def close(self):
        raise OSError("no space left on device")


def shardgen_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("shardgen-") and t.is_alive()}


def test_worker_stops_its_threads_even_when_the_sink_fails_to_close(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    before = shardgen_threads()
    worker = ReplicaWorker(plan=None, pipe=None, settings=None, batch_size=1, ctx=ReplicaContext(),
                           watchdog=StallWatchdog(60), sink=FailingSink(),
                           claimer=Claimer(run, owner_record(0), lease_s=30, heartbeat_s=1))
    assert {"shardgen-watchdog", "shardgen-heartbeat"} <= shardgen_threads() - before
    with pytest.raises(OSError, match="no space left"):
        with worker:
            pass
    assert shardgen_threads() == before


class CountingSink:
    def __init__(self):
        self.waits = []

    def wait_idle(self, timeout_s):
        self.waits.append(timeout_s)
        return True


def test_rank_control_drains_the_open_writers_only():
    control, sink = RankControl(), CountingSink()
    with control.writing(sink):
        assert control.drain_writers(5) == 1
    assert control.drain_writers(5) == 0
    assert sink.waits == [5]


def test_a_sink_closed_while_its_writer_is_busy_leaves_it_the_pool_to_finish(monkeypatch, caplog):
    """close() reached through an error while the writer has a batch in hand and is slower than the close timeout
    (an overloaded filesystem, a starved thread): the batch is still encoded and written, not failed by a pool shut
    down under it (what the 1,000-replica simulation printed at load 400)."""
    from shardgen.dataio.shards.sink import ShardSink

    release, written = threading.Event(), []

    class Work:
        def write(self, samples, encoded, fmt):
            written.append(encoded)

    def encoder(sample):
        return b"encoded"
    encoder.ext = "png"

    sink = ShardSink(encoder=encoder)
    encode_all = sink._encode_all
    monkeypatch.setattr(sink, "_encode_all", lambda samples: (release.wait(10), encode_all(samples))[1])
    monkeypatch.setattr(sink, "CLOSE_TIMEOUT_S", 0.2)
    sample = type("S", (), {"pixels": object(), "meta": {}, "status": "ok"})()
    sink.submit(Work(), [sample])
    monkeypatch.setattr(sink, "flush", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))  # a signal mid-flush
    with caplog.at_level("WARNING", logger="shardgen.sink"), pytest.raises(KeyboardInterrupt):
        sink.close()
    release.set()
    sink._thread.join(5)
    assert written == [[b"encoded"]] and sink._error is None
    assert "still writing after 0 s" in caplog.text
