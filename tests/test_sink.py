"""The background writer: what waits, what is ordered, and what is never written after an error."""

from __future__ import annotations

import threading
import time

import pytest

from shardgen.dataio.shards.sink import ShardSink


def _encoder(delay_s: float = 0.0, gate: threading.Event | None = None):
    def encode(sample):
        if gate is not None:
            gate.wait(10)
        time.sleep(delay_s)
        return b"png:" + sample.key.encode()
    encode.ext = "png"
    return encode


class Sample:
    def __init__(self, key):
        self.key, self.pixels, self.meta, self.status = key, object(), {}, "ok"


class Work:
    """Records what the writer did, in order."""

    def __init__(self, log, fail_write=False):
        self.log, self.fail_write = log, fail_write

    def write(self, samples, encoded, fmt):
        if self.fail_write:
            raise OSError(28, "No space left on device")
        self.log.append(("write", [e.decode() for e in encoded]))

    def commit(self):
        self.log.append(("commit",))
        return {"count": 1}


def test_a_shard_commit_is_queued_without_waiting_for_its_last_batch_and_follows_it():
    """A short run's shards hold one batch each: the loop hands over the batch and the commit and goes on to the
    next batch while the images are encoded (it used to wait there, with the GPU idle, every batch)."""
    gate, log, done = threading.Event(), [], []
    sink = ShardSink(encoder=_encoder(gate=gate))
    work = Work(log)
    sink.submit(work, [Sample("a"), Sample("b")])
    t0 = time.perf_counter()
    sink.commit(work, on_done=done.append)
    assert time.perf_counter() - t0 < 0.5 and log == [], "commit waited for the batch's encoding"
    assert not sink.wait_idle(0.1), "the sink said idle with a batch and a commit still queued"
    gate.set()
    sink.flush()
    assert log == [("write", ["png:a", "png:b"]), ("commit",)] and done == [{"count": 1}]
    sink.close()


def test_the_next_batch_waits_until_the_shard_before_it_is_committed():
    """At most one batch (and its shard's commit) is ever not durable: handing over the next batch waits for both."""
    log = []
    sink = ShardSink(encoder=_encoder(delay_s=0.2))
    first, second = Work(log), Work(log)
    sink.submit(first, [Sample("a")])
    sink.commit(first)
    sink.submit(second, [Sample("b")])
    assert log == [("write", ["png:a"]), ("commit",)], "the next batch was handed over before the commit"
    sink.close()
    assert log[-1] == ("write", ["png:b"])


def test_a_shard_whose_last_batch_failed_to_write_is_never_committed():
    """The commit is already queued when the batch fails (disk full): it is dropped, and the loop's next call raises
    the writer's error instead of carrying on."""
    log = []
    sink = ShardSink(encoder=_encoder(delay_s=0.1))
    work = Work(log, fail_write=True)
    sink.submit(work, [Sample("a")])
    sink.commit(work)
    with pytest.raises((OSError, RuntimeError), match="No space left"):
        sink.flush()
    assert log == [], "a shard was committed after its batch failed to write"
    with pytest.raises((OSError, RuntimeError)):
        sink.commit(Work(log))
    assert log == []
