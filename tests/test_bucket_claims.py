"""Shard claims in a bucket (claimstore.BucketClaims) against a real S3-compatible server (tests/s3_server.py): the
claim protocol where two replicas meet (races, take-overs, the right to commit), run over both stores; claim objects
edited by hand, throttling, a lost answer, what claims cost in requests; and the probe of a store's conditional
writes. tests/test_claims.py runs its ``BOTH`` tests over both stores too."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from shardgen.dataio.rundir.claims import Claimer, owner_record, read_claim, scan_claims
from shardgen.dataio.rundir.claimstore import (CLAIM_BYTES, BucketClaims, ConditionalWritesUnsupported,
                                               probe_conditional_writes)
from shardgen.errors import UserError
from tests.test_claims import BOTH, claim_store, claimers, run  # noqa: F401 (fixtures)


def by_hand():
    """A client of the test server that is no claimer's: what a person editing the bucket would use."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def delete_by_hand(run, store, shard: int, gen: int) -> None:
    if store is None:
        os.unlink(run.claim(shard, gen))
    else:
        by_hand().rm(f"{store.bucket}/{store.key(shard, gen)}")


@pytest.fixture
def url(bucket) -> str:
    return f"s3://{bucket}/run"


@BOTH
def test_of_claimers_racing_for_each_generation_exactly_one_wins(run, claimers, claim_store):
    """Two replicas claim the same 30 free shards at once, then two others take every one of them over at once:
    each generation of each shard has exactly one winner."""
    shards = list(range(30))

    def race(pair, latest) -> list[dict]:
        barrier, won = threading.Barrier(2), [{}, {}]

        def go(i: int) -> None:
            barrier.wait()
            for s in shards if i == 0 else shards[::-1]:  # opposite orders: they meet on every shard
                won[i][s] = pair[i].try_claim(s, latest.get(s))

        threads = [threading.Thread(target=go, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return won

    first = race([claimers(i, lease_s=1.0, own_thread=False) for i in (0, 1)], {})
    assert all((first[0][s] is None) != (first[1][s] is None) for s in shards), first
    time.sleep(1.2)  # both silent past their lease
    latest = scan_claims(run, claim_store())
    assert latest == dict.fromkeys(shards, 1)
    second = race([claimers(i, lease_s=1.0, own_thread=False) for i in (2, 3)], latest)
    assert all({second[0][s], second[1][s]} == {None, 2} for s in shards), second
    assert scan_claims(run, claim_store()) == dict.fromkeys(shards, 2)


@BOTH
def test_a_stalled_claim_is_taken_over_and_its_holder_loses_it_at_its_next_beat(run, claimers, claim_store):
    """(A lease of 2 s: a bucket's heartbeat, LastModified, is in whole seconds.)"""
    a, b = claimers(0, lease_s=2.0, own_thread=False), claimers(1, lease_s=2.0, own_thread=False)
    assert a.try_claim(0, None) == 1 and a.try_claim(1, None) == 1
    assert b.try_claim(0, 1) is None  # fresh
    time.sleep(2.2)  # a misses its heartbeats
    assert b.try_claim(0, scan_claims(run, claim_store()).get(0)) == 2
    assert not a.still_mine(0) and b.still_mine(0)
    a.beat()  # shard 0 noted lost; shard 1 renewed
    assert a.lost == {0} and a.still_mine(1)
    assert b.try_claim(1, 1) is None


@BOTH
def test_take_commit_goes_to_exactly_one_of_a_silent_holder_and_the_replica_that_took_over(run, claimers):
    """The holder, alive but silent past its lease, takes the right to commit (generation + 1) while another replica
    takes the shard over (the same generation): in either order, and racing on ten shards, exactly one gets it."""
    a, b = claimers(0, lease_s=1.0, own_thread=False), claimers(1, lease_s=1.0, own_thread=False)
    shards = list(range(12))
    assert all(a.try_claim(s, None) == 1 for s in shards)
    time.sleep(1.2)
    assert b.try_claim(0, 1) == 2 and not a.take_commit(0) and 0 in a.lost and b.take_commit(0)
    assert a.take_commit(1) and b.try_claim(1, 1) is None and a.still_mine(1)
    racing, barrier, committed, took = shards[2:], threading.Barrier(2), {}, {}

    def holder() -> None:
        barrier.wait()
        for s in racing:
            committed[s] = a.take_commit(s)

    def taker() -> None:
        barrier.wait()
        for s in racing[::-1]:
            took[s] = b.try_claim(s, 1) is not None

    threads = [threading.Thread(target=holder), threading.Thread(target=taker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(committed[s] != took[s] for s in racing), (committed, took)
    assert all(a.still_mine(s) == committed[s] and b.still_mine(s) == took[s] for s in racing)


@BOTH
def test_a_claim_deleted_by_hand_is_lost_at_the_next_beat(run, claimers, claim_store):
    a = claimers(0, lease_s=60, own_thread=False)
    assert a.try_claim(0, None) == 1 and a.try_claim(1, None) == 1
    delete_by_hand(run, claim_store(), 0, 1)
    a.beat()
    assert a.lost == {0} and not a.still_mine(0) and a.still_mine(1)


def test_a_claim_object_overwritten_by_hand_is_lost_at_the_next_beat(url):
    """A PutObject without If-Match (someone rewriting the object) changes its ETag: the holder's next renewal is
    refused and it stops; readers take the rewritten object for a claim not written by shardgen, alive by its
    time."""
    store = BucketClaims(url)
    a = Claimer(None, owner_record(0), lease_s=60, own_thread=False, store=store)
    assert a.try_claim(0, None) == 1 and a.try_claim(1, None) == 1
    by_hand().pipe(f"{store.bucket}/{store.key(0, 1)}", b"edited by hand")
    a.beat()
    assert a.lost == {0} and a.still_mine(1)
    record, beat = read_claim(None, 0, 1, BucketClaims(url))
    assert record == {} and abs(beat - time.time()) < 5


def test_the_heartbeat_thread_keeps_a_bucket_claim_alive_past_its_lease(url):
    """Renewal after renewal (each If-Match the ETag the last one wrote) keeps the claim from being taken over."""
    a = Claimer(None, owner_record(0), lease_s=2.5, heartbeat_s=0.3, store=BucketClaims(url))
    b = Claimer(None, owner_record(1), lease_s=2.5, own_thread=False, store=BucketClaims(url))
    try:
        assert a.try_claim(0, None) == 1
        time.sleep(3.5)
        assert b.try_claim(0, 1) is None and a.still_mine(0) and not a.lost
        assert a.store.requests["put_object"] >= 5  # the create, then a renewal a heartbeat
    finally:
        a.close()


def test_slow_down_answers_are_retried_and_the_claim_still_works(s3, url, caplog):
    """503 SlowDown on every request of a claim's life, more than the S3 client's own attempts (2 in the tests)
    absorb: each is retried with backoff, logged, and the claim, its heartbeat and its release work."""
    a = Claimer(None, owner_record(0), lease_s=60, own_thread=False, store=BucketClaims(url))
    b = Claimer(None, owner_record(1), lease_s=60, own_thread=False, store=BucketClaims(url))
    s3.proxy.fail_next(3)
    assert a.try_claim(0, None) == 1 and s3.proxy.served_errors == 3
    s3.proxy.fail_next(3)
    a.beat()
    assert s3.proxy.served_errors == 3 and not a.lost
    s3.proxy.fail_next(3)
    assert b.try_claim(0, 1) is None and s3.proxy.served_errors == 3  # read through the throttling: alive
    s3.proxy.fail_next(3)
    a.release(0)
    assert s3.proxy.served_errors == 3 and scan_claims(None, b.store) == {}
    assert "retry 1 of" in caplog.text


def test_a_create_whose_answer_was_lost_is_ours_and_one_refused_after_a_timeout_is_not(url, monkeypatch):
    """A create applied by the store whose answer never came back is retried and refused (the object exists): the
    object holds our bytes, so the claim is ours. A create that timed out before the store saw it, whose retry is
    refused because another replica created the claim meanwhile, is a lost race."""
    store, other = BucketClaims(url), BucketClaims(url)
    send, calls = store.send, []

    def answer_lost(op, key, answers, **kw):
        calls.append(op)
        if op == "put_object" and len(calls) == 1 and key.endswith("000001.g1"):
            other.create(1, 1, b'{"replica": 1}')
            raise TimeoutError("timed out before the store saw it")
        resp = send(op, key, answers, **kw)
        if op == "put_object" and len(calls) == 1:
            raise TimeoutError("the store applied it; its answer was lost")
        return resp

    monkeypatch.setattr(store, "send", answer_lost)
    assert store.create(0, 1, b'{"replica": 0}') and store.renew(0, 1)
    assert calls == ["put_object", "put_object", "get_object", "put_object"]  # the 412's object read: ours
    calls.clear()
    assert not store.create(1, 1, b'{"replica": 0}') and not store.renew(1, 1)
    assert calls == ["put_object", "put_object", "get_object"]  # not ours: nothing to renew
    assert read_claim(None, 1, 1, store)[0] == {"replica": 1}


def test_readers_see_claim_objects_as_they_see_claim_files(url):
    """read_claim/scan_claims over a bucket (the ledger's and status's view): a record and its time, a vanished
    claim, an object that is not a claim shardgen wrote (not JSON, too large) alive by its time, other keys passed
    over, a listing of several pages."""
    store = BucketClaims(url)
    assert store.create(4, 2, json.dumps(dict(host="h", pid=1)).encode())
    record, beat = read_claim(None, 4, 2, store)
    assert record == dict(host="h", pid=1) and abs(beat - time.time()) < 5
    assert read_claim(None, 4, 3, store) == (None, None)
    hand, prefix = by_hand(), f"{store.bucket}/{store.claims_prefix}"
    hand.pipe({f"{prefix}000005.g1": b"not json", f"{prefix}000006.g1": b"x" * (CLAIM_BYTES + 1),
               f"{prefix}README": b"", f"{prefix}000007.g1.tmp": b"{}", f"{prefix}sub/000008.g1": b"{}"})
    for shard in (5, 6):
        record, beat = read_claim(None, shard, 1, store)
        assert record == {} and beat is not None
    store.list_page = 2
    assert scan_claims(None, store) == {4: 2, 5: 1, 6: 1} and store.requests["list_objects_v2"] == 3


def test_what_claims_cost_in_requests(url):
    """A claim of a free shard: one PutObject. A look at a live holder's claim: one GetObject. A heartbeat: a
    HeadObject (the next generation) and a PutObject (the renewal) per claim held. The right to commit: one
    PutObject; a release: a DeleteObject per generation. A scan: a ListObjectsV2 per 1,000 claims."""
    a = Claimer(None, owner_record(0), lease_s=60, own_thread=False, store=BucketClaims(url))
    b = Claimer(None, owner_record(1), lease_s=60, own_thread=False, store=BucketClaims(url))
    assert [a.try_claim(s, None) for s in range(3)] == [1, 1, 1] and a.store.requests == {"put_object": 3}
    assert b.try_claim(0, 1) is None and b.store.requests == {"get_object": 1}
    a.store.requests.clear()
    a.beat()
    assert a.store.requests == {"head_object": 3, "put_object": 3}
    a.store.requests.clear()
    assert a.still_mine(1) and a.store.requests == {"head_object": 1}
    a.store.requests.clear()
    assert a.take_commit(0)
    a.release(0)
    assert a.store.requests == {"put_object": 1, "delete_object": 2}
    b.store.requests.clear()
    assert scan_claims(None, b.store) == {1: 1, 2: 1} and b.store.requests == {"list_objects_v2": 1}


def test_the_probe_passes_on_the_test_server_and_leaves_nothing_behind(url, bucket):
    probe_conditional_writes(url)
    assert by_hand().find(bucket) == []


def test_the_probe_names_a_store_that_ignores_conditional_writes_in_one_line(s3, url, bucket):
    s3.proxy.ignore_conditions()  # requests reach the server without If-None-Match and If-Match
    with pytest.raises(ConditionalWritesUnsupported) as raised:
        probe_conditional_writes(url)
    message = str(raised.value)
    assert isinstance(raised.value, UserError) and "\n" not in message
    assert message.startswith(f"{url}/claims (at {s3.endpoint}): the object store ignores If-None-Match: two "
                              "creates of one object both succeeded; shardgen needs conditional writes"), message
    assert by_hand().find(bucket) == []
