"""The run directory at cluster scale, simulated: N replicas (threads) against one run directory.

Everything but the GPU is real: the plan (``build_plan``), the claims and their heartbeats (``Claimer``), the
replica loop (``ReplicaWorker``: ``next_shard``, checkpoints, commits through ``ShardSink``), the launch-time
repair and the ledger read by ``jobs.status``. The generator is fake: a sleep and an 8x8 image per sample.

It counts the filesystem metadata operations each part makes (os.* calls and ``open``, wrapped in-process),
per committed shard, the claim latency (time in ``next_shard`` until a shard is claimed), duplicated samples
in the committed shards (must be 0), the heartbeat traffic, a replica's start-up on the run and ``jobs.status``
on it, and the tail (from the first replica finding nothing left to do to the end of the run).

    PYTHONPATH=$PWD python benchmarks/sim_cluster.py --replicas 256 --shards 10000 --seconds 60 [--prefill 0.9]
        [--kill-prob 0.01] [--json out.json]
    PYTHONPATH=$PWD nice -n 10 python benchmarks/sim_cluster.py --replicas 1000 --shards 10000 --prefill 0.85 \
        --scale 5 --procs 16 --jitter 0.05 --seconds 1300

``--scale K`` divides production's lease, heartbeat, idle poll and a shard's GPU time together (their ratios,
and so the operations per shard, stay production's); ``--procs P`` spreads the replica threads over P forked
processes, each with one thread beating all its replicas' claims (``Claimer.beat``): a heartbeat thread per
replica, or hundreds of replicas in one interpreter, starve the heartbeats of the GIL (docs/scaling.md).

``--prefill F`` fabricates F of the shards as committed (copies of one real committed shard, renamed and
with their own stats) so the claims and the start-up are measured on a run that is mostly done, the case
where a listing of shards/ is largest. ``--seconds`` bounds the run: the figures are per committed shard.
One machine cannot be 1,000 GPUs: all replicas share the GIL and this host's disk, so latencies are upper
bounds of the protocol's own cost; operation counts are what a shared filesystem would see.

``--bucket s3://BUCKET/PREFIX`` keeps the run in a bucket instead (the S3 server of ``AWS_ENDPOINT_URL``, e.g. a
standalone ``moto_server``; the prefix must hold no run yet), as ``run_dir=s3://...`` does: the plan, the claims
(``BucketClaims``: If-None-Match creates, If-Match renewals) and the done markers (the upload records in
``uploads/``) are objects there; each process (``--procs``) is a machine with its own scratch folder for the shard
being written; a replica commits as a bucket run's does (``ShardUploader`` with ``commits``: tar and index into
``shards/``, then the record, then the claim released). Every S3 request the processes send is counted at the S3
client by operation and phase (claim, process, write, heartbeat, idle), beside the run stores' own ``requests``
counters; ``--kill-upload-prob`` also kills replicas between their shard's upload and its record. At the end the
run is read back from the bucket: every shard done, each committed once, each prompt in exactly one sample of the
uploaded indexes, every object as its record says.

    AWS_ENDPOINT_URL=http://127.0.0.1:PORT PYTHONPATH=$PWD nice -n 10 python benchmarks/sim_cluster.py \
        --bucket s3://sim/run120 --replicas 120 --shards 300 --per-shard 2 --batch 1 --gen-s 10 --jitter 0.3 \
        --stagger-s 20 --lease-s 20 --heartbeat-s 5 --procs 4 --kill-prob 0.03 --kill-upload-prob 0.03 --seconds 500
"""

from __future__ import annotations

import argparse
import builtins
import contextvars
import errno
import io
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from shardgen.dataio.prompts import PromptSource, build_plan, load_plan
from shardgen.dataio.resume import record_plan_digests, repair_run_dir
from shardgen.dataio.rundir import HEARTBEAT_S, LEASE_S, Claimer, RunDir, owner_record
from shardgen.dataio.rundir.claimstore import bucket_claims, probe_conditional_writes
from shardgen.dataio.rundir.checks import check_run_dir_text
from shardgen.dataio.rundir.runfiles import bucket_files
from shardgen.dataio.shards import Sample, ShardSink
from shardgen.dataio.shards import index as shard_index
from shardgen.dataio.shards.upload import ShardUploader, staged_shards
from shardgen.dataio.shards.uploaded import fetch, missing_uploads
from shardgen.tools import run_status
from shardgen.run import shardrun, shardwalk
from shardgen.run.generation import GenSettings
from shardgen.run.replica import ReplicaContext, ReplicaWorker

# what the fake generator's replicas are given: the shape of every batch (tiny samples, one call key)
SIM_SETTINGS = GenSettings(height=8, width=8, steps=1, guidance=0.0, true_cfg_scale=1.0, negative_prompt=None,
                           max_sequence_length=77, model="sim", strategy="dp")

HEARTBEAT_WORKERS = 8  # claimers a process beats at a time on a run kept in a bucket (``Heartbeats``)
OPS = ("stat", "lstat", "listdir", "scandir", "open", "rename", "replace", "unlink", "mkdir", "rmdir", "utime",
       "link", "fsync")


class OpCounter:
    """Counts metadata operations by (phase, call); the phase is the thread's (``phase`` below) or its name."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.entries: Counter = Counter()  # directory entries listed, by phase
        self.s3: Counter = Counter()  # S3 requests sent by (phase, operation), with --bucket (``count_s3``)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._saved: dict = {}

    def phase(self) -> str:
        p = getattr(self._local, "phase", None)
        if p:
            return p
        name = threading.current_thread().name
        return "heartbeat" if "heartbeat" in name else "write" if "writer" in name or "encode" in name else "other"

    def set_phase(self, p: str | None) -> None:
        self._local.phase = p

    def _wrap(self, name: str, fn):
        def counted(*a, **k):
            with self._lock:
                self.counts[(self.phase(), name)] += 1
            out = fn(*a, **k)
            if name == "listdir":  # a listing's cost on NFS grows with its entries (READDIRPLUS pages)
                with self._lock:
                    self.entries[self.phase()] += len(out)
            return out
        return counted

    def install(self) -> None:
        for name in OPS:
            self._saved[(os, name)] = getattr(os, name)
            setattr(os, name, self._wrap(name, getattr(os, name)))
        self._saved[(builtins, "open")] = builtins.open
        builtins.open = self._wrap("open", builtins.open)

    def count_s3(self) -> None:
        """Count every S3 request of this process by (phase, operation) in ``s3``: at s3fs's one door to the client
        (``S3FileSystem._call_s3``), which the run's stores (``Bucket.send``: claims, run files, done markers) and the
        uploader's fsspec calls (a shard's tar and index) all go through. A request runs on fsspec's event-loop
        thread, so the calling thread's phase is carried to it by ``fsspec.asyn.sync`` (every blocking fsspec call
        goes through it) in a context variable. Undone by ``uninstall``."""
        import fsspec.asyn
        import s3fs

        real_sync, real_call = fsspec.asyn.sync, s3fs.S3FileSystem._call_s3

        def sync(loop, func, *args, timeout=None, **kwargs):
            phase = self.phase()

            async def phased():
                _S3_PHASE.set(phase)
                return await func(*args, **kwargs)
            return real_sync(loop, phased, timeout=timeout)

        async def call_s3(fs, method, *args, **kwargs):
            with self._lock:
                self.s3[(_S3_PHASE.get(), method if isinstance(method, str) else method.__name__)] += 1
            return await real_call(fs, method, *args, **kwargs)

        self._saved[(fsspec.asyn, "sync")] = real_sync
        self._saved[(s3fs.S3FileSystem, "_call_s3")] = real_call
        fsspec.asyn.sync, s3fs.S3FileSystem._call_s3 = sync, call_s3

    def s3_total(self) -> int:
        """S3 requests so far, every phase's."""
        with self._lock:
            return sum(self.s3.values())

    def clear(self) -> None:
        with self._lock:
            self.counts.clear()
            self.entries.clear()
            self.s3.clear()

    def uninstall(self) -> None:
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        self._saved.clear()

    def by_phase(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        with self._lock:
            for (p, name), n in self.counts.items():
                out.setdefault(p, Counter())[name] += n
        return out

    def total(self) -> int:
        """All operations so far, every thread's (helper pools included)."""
        with self._lock:
            return sum(self.counts.values())


_S3_PHASE = contextvars.ContextVar("sim_s3_phase", default="other")  # the phase of the thread an S3 request is for
COUNTER = OpCounter()


class _IdleClock:
    """The shard walk's ``time``, but its ``sleep`` (only ``ShardWalk.next``'s idle poll sleeps there) marks the
    calling thread's operations from then on as ``idle``: an idle replica's polls at the tail are counted apart
    from the claims of replicas finding work (``timed`` in ``_replica_group`` sets ``claim`` again)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(s: float) -> None:
        COUNTER.set_phase("idle")
        time.sleep(s)


class Heartbeats:
    """One thread beating the claims of every simulated replica (``Claimer.beat``), as each replica's own
    heartbeat thread would: 1,000 threads waking every ``heartbeat_s`` on 2 cores are themselves the load that
    made leases expire. Records how late its passes ran (a pass late by more than the lease would be a spurious
    takeover: the figures say whether the machine kept up). ``workers`` > 1: each pass beats that many claimers at a
    time (a bucket's renewals are round trips of milliseconds each, not a syscall: one after another, a pass over a
    process's replicas outlasted the heartbeat on a busy server, where each replica's own thread would not)."""

    def __init__(self, heartbeat_s: float, workers: int = 1):
        self.heartbeat_s = heartbeat_s
        self.workers = workers
        self.claimers: dict[int, Claimer] = {}  # by id (a Claimer, a dataclass, is not hashable)
        self.max_gap_s = 0.0  # the longest time between the starts of two passes
        self.renewals = 0  # claims beaten (a claim held during a pass counts once per pass)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sim-heartbeat", daemon=True)
        self._thread.start()

    def add(self, claimer: Claimer) -> None:
        with self._lock:
            self.claimers[id(claimer)] = claimer

    def remove(self, claimer: Claimer) -> None:
        with self._lock:
            self.claimers.pop(id(claimer), None)

    def _loop(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sim-heartbeat") if self.workers > 1 else None
        last = time.perf_counter()
        while not self._stop.wait(max(0.0, last + self.heartbeat_s - time.perf_counter())):
            now = time.perf_counter()
            self.max_gap_s, last = max(self.max_gap_s, now - last), now
            with self._lock:
                claimers = list(self.claimers.values())
            if pool is not None:
                self.renewals += sum(len(c.held) for c in claimers)
                list(pool.map(Claimer.beat, claimers))
                continue
            for c in claimers:
                self.renewals += len(c.held)
                c.beat()
        if pool is not None:
            pool.shutdown(wait=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Killed(Exception):
    """A simulated kill of a replica (its heartbeat stops; its claim expires)."""


def make_plan(root: Path, shards: int, per_shard: int, store: str = "") -> RunDir:
    """A run directory planned from a prompt file of shards * per_shard short prompts (``store``: a run kept in that
    bucket, ``root`` the planning machine's scratch folder)."""
    run = RunDir(root, store=store)
    root.mkdir(parents=True, exist_ok=True)
    prompts = root.parent / f"{root.name}.prompts.txt"
    with open(prompts, "w") as f:
        f.writelines(f"prompt {i}\n" for i in range(shards * per_shard))
    source = PromptSource(path=str(prompts), format="txt", field="prompt")
    plan = build_plan(run, source, samples_per_shard=per_shard, run_seed=0)
    run.create()
    record_plan_digests(plan)
    return run


def fake_generator(gen_s: float, kill_prob: float, rng: random.Random, jitter: float = 0.0):
    """A generator that sleeps ``gen_s`` a batch (times a factor uniform in 1 +- ``jitter``: GPUs and prompts differ,
    so a cluster's replicas do not all finish their shards in the same second), raises Killed with ``kill_prob``."""
    def generate_batch(pipe, settings, rows, replica_ranks=1, images=None):
        time.sleep(gen_s * (1 + jitter * (2 * rng.random() - 1)) if jitter else gen_s)
        if kill_prob and rng.random() < kill_prob:
            raise Killed()
        return [Sample(key=r.key, index=r.index, prompt=r.prompt,
                       meta=dict(prompt=r.prompt, index=r.index, seed=r.seed),
                       pixels=np.full((8, 8, 3), r.index % 251, np.uint8)) for r in rows]
    return generate_batch


def prefill(run: RunDir, plan, fraction: float, seed: int = 0) -> int:
    """Fabricate ``fraction`` of the shards as committed: shard 0 is made for real (one replica), the others are
    copies of its tar and index with their own stats (what a launch's repair and the ledger read)."""
    n = int(plan.num_shards * fraction)
    if n == 0:
        return 0
    sink = ShardSink("png", threads=1)
    claimer = Claimer(run, owner_record(0), heartbeat_s=3600)
    w = ReplicaWorker(plan=plan, pipe=None, settings=SIM_SETTINGS, batch_size=plan.samples_per_shard,
                      ctx=ReplicaContext(0, 1), sink=sink, claimer=claimer)
    shardrun.generate_batch = fake_generator(0, 0, random.Random(0))
    shard, gen, done = w.next_shard()
    w.process(shard, gen, done)
    w.close()
    stats = json.loads(run.shard_stats(shard).read_text())
    tar, idx = run.shard_file(shard), run.shards_dir / f"{shard:06d}.parquet"
    picks = random.Random(seed).sample([s for s in range(plan.num_shards) if s != shard], n - 1)
    for s in picks:
        try:
            os.link(tar, run.shard_file(s))
            os.link(idx, run.shards_dir / f"{s:06d}.parquet")
        except OSError as e:  # ext4 allows 65,000 links to a file: go on from a copy (as many links again)
            if e.errno != errno.EMLINK:
                raise
            tar, idx = _copy_next_to(tar, run, s), _copy_next_to(idx, run, s)
            run.shard_file(s).unlink(missing_ok=True)
            os.link(tar, run.shard_file(s))
            os.link(idx, run.shards_dir / f"{s:06d}.parquet")
        run.shard_stats(s).write_text(json.dumps(dict(stats, shard=s)))
    return n


def _copy_next_to(path: Path, run: RunDir, s: int) -> Path:
    """A copy of a prefilled file, with as many links left as a fresh file (beside the run dir, not in it)."""
    out = run.root.parent / f"{run.root.name}.prefill-{s}{path.suffix}"
    shutil.copy2(path, out)
    return out


def simulate(*args, **kwargs) -> dict:
    """``_simulate`` with the shard run's generator and the shard walk's clock put back afterwards (a test process
    goes on to real jobs)."""
    real, clock = shardrun.generate_batch, shardwalk.time
    shardwalk.time = _IdleClock()
    try:
        return _simulate(*args, **kwargs)
    finally:
        shardrun.generate_batch, shardwalk.time = real, clock


def machine_run(root: Path, store: str, machine: int) -> RunDir:
    """Process ``machine``'s RunDir of the run kept in the bucket ``store``: its own scratch folder beside ``root``
    (the planning machine's), created as a launch creates it (the owner record is the bucket's)."""
    run = RunDir(root.parent / f"{root.name}.machine{machine}", store=store)
    run.create()
    return run


def _simulate(root: Path, replicas: int, shards: int, per_shard: int = 1, batch: int = 1, gen_s: float = 0.02,
             seconds: float = 60.0, prefill_frac: float = 0.0, kill_prob: float = 0.0, lease_s: float = 2.0,
             heartbeat_s: float = 0.5, seed: int = 0, stagger_s: float = 0.0, poll_s: float | None = None,
             procs: int = 1, jitter: float = 0.0, store: str = "", kill_upload_prob: float = 0.0) -> dict:
    """Run the simulation; the figures as a dict. ``poll_s``: the replicas' idle poll (default: as the runner
    sets it, ``min(2, heartbeat_s)``); ``procs``: processes the replicas are spread over. ``store``: keep the run in
    that bucket (``s3://bucket/prefix``, holding no run yet), ``root`` being the planning machine's scratch folder;
    ``kill_upload_prob``: there, the chance that a replica dies between its shard's upload and its record."""
    t_plan = time.perf_counter()
    if store:
        check_run_dir_text(store)
        probe_conditional_writes(store)  # as a launch does: a store without conditional writes is refused
        if prefill_frac:
            raise ValueError("--prefill fabricates committed shards in a run directory; it does not take --bucket")
        planned = RunDir(root, store=store)
        if planned.files.exists(planned.plan_json_path):
            raise ValueError(f"{store} holds a run already; give a new prefix")
        run = make_plan(root, shards, per_shard, store)
        plan_s, prefilled = time.perf_counter() - t_plan, 0
        plan = load_plan(run)
    elif (root / "plan" / "plan.json").exists():  # --dir of an earlier run: measured again as it is (--prefill ignored)
        run = RunDir(root)
        plan_s, prefilled = 0.0, len(run.done_shards())
        plan = load_plan(run)
    else:
        run = make_plan(root, shards, per_shard)
        plan_s = time.perf_counter() - t_plan
        plan = load_plan(run)
        prefilled = prefill(run, plan, prefill_frac, seed)

    COUNTER.install()
    if store:
        COUNTER.count_s3()
    try:
        # a replica's start-up on this run: load the plan, the launch's repair (what prepare_run does on it)
        # (nothing else runs yet: every operation counted meanwhile is theirs, their thread pools' included)
        # the first launch on the run checks every committed shard; a later one (every other job) only changed ones
        ops0, req0, t0 = COUNTER.total(), COUNTER.s3_total(), time.perf_counter()
        plan = load_plan(run)
        repair_run_dir(plan, lease_s)
        first_s, first_ops, first_req = time.perf_counter() - t0, COUNTER.total() - ops0, COUNTER.s3_total() - req0
        ops0, req0, t0 = COUNTER.total(), COUNTER.s3_total(), time.perf_counter()
        plan = load_plan(run)
        repair_run_dir(plan, lease_s)
        startup_s, startup_ops, startup_req = (time.perf_counter() - t0, COUNTER.total() - ops0,
                                               COUNTER.s3_total() - req0)
        # jobs.status: the first call reads every committed shard's stats; a later one only those new since
        ops0, req0, t0 = COUNTER.total(), COUNTER.s3_total(), time.perf_counter()
        run_status(plan, lease_s)
        first_status_s, first_status_ops = time.perf_counter() - t0, COUNTER.total() - ops0
        first_status_req = COUNTER.s3_total() - req0
        ops0, req0, t0 = COUNTER.total(), COUNTER.s3_total(), time.perf_counter()
        run_status(plan, lease_s)
        status_s, status_ops, status_req = time.perf_counter() - t0, COUNTER.total() - ops0, COUNTER.s3_total() - req0
        COUNTER.clear()  # the figures per committed shard count the replicas' operations only
        poll_s = min(2.0, heartbeat_s) if poll_s is None else poll_s
        fig = _run_replicas(run, plan, replicas, batch, gen_s, seconds, kill_prob, lease_s, heartbeat_s, seed,
                            stagger_s, poll_s, procs, jitter, kill_upload_prob)
    finally:
        COUNTER.uninstall()
    if store:
        fig.update(_bucket_check(run, plan, fig))
        dup, committed_samples = fig.pop("duplicated_samples"), fig.pop("committed_samples")
    else:
        dup, committed_samples = _duplicates(run)
    fig.update(replicas=replicas, shards=shards, per_shard=per_shard, prefilled=prefilled, plan_s=round(plan_s, 2),
               gen_s=gen_s, lease_s=lease_s, heartbeat_s=heartbeat_s, poll_s=poll_s, stagger_s=stagger_s, jitter=jitter,
               first_startup_s=round(first_s, 3), first_startup_ops=first_ops,
               startup_s=round(startup_s, 3), startup_ops=startup_ops,
               first_status_s=round(first_status_s, 3), first_status_ops=first_status_ops, status_s=round(status_s, 3),
               status_ops=status_ops, duplicated_samples=dup, committed_samples=committed_samples,
               load=os.getloadavg()[0])
    if store:  # the operations above are this machine's scratch folder's; the requests are the bucket's
        fig.update(store=store, kill_upload_prob=kill_upload_prob, first_startup_requests=first_req,
                   startup_requests=startup_req, first_status_requests=first_status_req, status_requests=status_req)
    return fig


def _run_replicas(run, plan, replicas, batch, gen_s, seconds, kill_prob, lease_s, heartbeat_s, seed, stagger_s,
                  poll_s, procs: int = 1, jitter: float = 0.0, kill_upload_prob: float = 0.0) -> dict:
    """The replicas, split over ``procs`` processes (forked: each a group of replica threads with one heartbeat
    thread, as a node's processes would be); their figures merged."""
    t_start = time.time()
    groups = [list(range(replicas))[i::procs] for i in range(max(1, procs))]
    args = (run, plan, replicas, batch, gen_s, t_start + seconds, kill_prob, lease_s, heartbeat_s, stagger_s, poll_s,
            jitter)
    if len(groups) == 1:
        switch = sys.getswitchinterval()  # the group shortens it: put it back for the process (a test's) going on
        try:
            parts = [_replica_group(groups[0], *args, seed=seed, t_start=t_start, kill_upload_prob=kill_upload_prob)]
        finally:
            sys.setswitchinterval(switch)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("fork")  # the plan and the installed operation counter come along
        queue = ctx.Queue()
        children = [ctx.Process(target=lambda g=g, i=i: queue.put(_replica_group(
                        g, *args, seed=seed + i, t_start=t_start, machine=i, forked=True,
                        kill_upload_prob=kill_upload_prob)), daemon=True)
                    for i, g in enumerate(groups)]
        for c in children:
            c.start()
        parts = [queue.get() for _ in children]
        for c in children:
            c.join()
    t_end = max(p["t_end"] for p in parts)
    complete = len(run.done_shards()) == plan.num_shards
    commits, counts, entries = Counter(), Counter(), Counter()
    for part in parts:
        commits.update(part["commits"])
        counts.update(part["counts"])
        entries.update(part["entries"])
    n = sum(commits.values())
    phases: dict[str, Counter] = {}
    for (ph, name), k in counts.items():
        phases.setdefault(ph, Counter())[name] += k
    per = {ph: round(sum(c.values()) / max(1, n), 2) for ph, c in phases.items()}
    claim_calls = {k: round(v / max(1, n), 2) for k, v in sorted(phases.get("claim", Counter()).items())}
    lat = sorted(x for part in parts for x in part["latencies"])
    first = sorted(x for part in parts for x in part["first_claims"])
    end = max(p["last_commit"] for p in parts)
    first_idle = min(p["first_idle"] for p in parts)
    idle_s = sum(max(0.0, end - t) for p in parts for t in p["idle_from"])  # replica-seconds spent idle at the tail
    return dict(seconds=round(t_end - t_start, 1), complete=complete, procs=len(groups),
                stuck=sum(p["stuck"] for p in parts), committed_shards=n,
                shards_per_s=round(n / (t_end - t_start), 1), ops_per_shard=per,
                ops_per_shard_total=round(sum(per.values()), 1), claim_ops_by_call=claim_calls,
                # without the idle replicas' polls at the tail: what a shard costs while there is work
                ops_per_shard_working=round(sum(v for ph, v in per.items() if ph != "idle"), 1),
                idle_ops_by_call=dict(sorted(phases.get("idle", Counter()).items())),
                idle_ops_per_replica_s=round(sum(phases.get("idle", Counter()).values()) / idle_s, 2) if idle_s else None,
                listed_entries_per_shard={ph: round(e / max(1, n), 1) for ph, e in entries.items()},
                claim_median_ms=_ms(lat, 0.5), claim_p99_ms=_ms(lat, 0.99),
                # the herd at start: time from the replicas' start to each one's first claim
                first_claim_median_ms=_ms(first, 0.5), first_claim_max_ms=_ms(first, 1.0),
                heartbeat_ops=sum(phases.get("heartbeat", Counter()).values()),
                heartbeat_max_gap_s=max(p["max_gap_s"] for p in parts), kills=sum(p["kills"] for p in parts),
                takeovers=sum(p["takeovers"] for p in parts),  # claims of a generation above 1: with no kills, spurious
                # the claims killed replicas left held: each is taken over once; takeovers beyond them were spurious
                # (a live holder's lease lapsed)
                abandoned_claims=sum(p["abandoned"] for p in parts),
                # the tail: from the first replica finding nothing left to do to the end of the run (its last commit)
                tail_s=round(max(0.0, end - first_idle), 2) if complete and first_idle < end else None,
                last_claim_to_end_s=round(max(0.0, end - max(p["last_claim"] for p in parts)), 2) if complete else None,
                run_s=round(end - t_start, 2) if complete else None,
                # the replicas' time with nothing to do at the end, as a share of all replicas' time (GPU time lost)
                tail_idle_share=round(idle_s / (replicas * (end - t_start)), 4) if complete else None,
                cpu_share=round(sum(p["cpu_s"] for p in parts) / max(1e-9, t_end - t_start), 2),
                commits_twice=sum(1 for c in commits.values() if c > 1),
                heartbeat_renewals=sum(p["renewals"] for p in parts),  # claims beaten, summed over passes
                **(_s3_figures(parts, n, idle_s, t_end - t_start) if run.store else {}))


def _s3_figures(parts: list[dict], shards: int, idle_s: float, seconds: float) -> dict:
    """The S3 requests of the replicas' processes (counted at the client, by phase and operation): per committed
    shard, per claim heartbeat, per idle replica-second; and the run stores' own ``requests`` counters, summed."""
    by_phase: dict[str, Counter] = {}
    stores, upload_kills = Counter(), 0
    for part in parts:
        for (phase, op), k in part["s3"].items():
            by_phase.setdefault(phase, Counter())[op] += k
        stores.update(part["requests"])
        upload_kills += part["upload_kills"]
    renewals = sum(p["renewals"] for p in parts)
    total = sum(by_phase.values(), Counter())
    working = sum((c for ph, c in by_phase.items() if ph not in ("heartbeat", "idle")), Counter())

    def per(c: Counter, d: float) -> dict:
        return {op: round(k / d, 2) for op, k in sorted(c.items())} if d else {}

    idle = by_phase.get("idle", Counter())
    return dict(
        s3_requests=dict(sorted(total.items())), s3_requests_total=sum(total.values()),
        s3_requests_per_s=round(sum(total.values()) / max(1e-9, seconds), 1),
        s3_requests_by_phase={ph: dict(sorted(c.items())) for ph, c in sorted(by_phase.items())},
        # a shard's own requests (claim, the replica's checks, checkpoints and the commit: the upload and its record)
        s3_per_shard_working=per(working, shards), s3_per_shard_working_total=round(sum(working.values()) / max(1, shards), 1),
        s3_per_shard_by_phase={ph: per(c, shards) for ph, c in sorted(by_phase.items())},
        s3_per_shard_total=round(sum(total.values()) / max(1, shards), 1),
        s3_per_heartbeat=per(by_phase.get("heartbeat", Counter()), renewals),  # per claim renewed, one pass
        s3_idle_per_replica_s=round(sum(idle.values()) / idle_s, 3) if idle_s else None,
        # BucketClaims.requests + BucketFiles.requests: claims, run files, done markers (not the tar and index
        # uploads, which go through fsspec)
        store_requests=dict(sorted(stores.items())), store_requests_total=sum(stores.values()),
        upload_kills=upload_kills)


def _shared_done_shards(num_shards: int):
    """``RunDir.done_shards`` for the simulated replicas: the same listing (one ``os.listdir``, counted) and the same
    set, its shard numbers taken from one table of the process instead of parsed by each replica. 1,000 replicas'
    sets of 100k freshly parsed ints, and the interpreter arenas their parsing pinned between the listings' names,
    took 23 GB of this 24 GB machine at 100k shards (docs/scaling.md); on a cluster each replica has its own host.
    The listings of one process are taken one at a time (a lock; counted as before).
    Returns the method it replaced (to put back)."""
    table = {f"{s:06d}.stats.json": s for s in range(num_shards)}
    # one listing at a time per process: when 1,000 replicas finish together each confirms the run is complete with
    # a listing (300k names at 100k shards); 31 threads' lists alive at once in each of 32 processes took the
    # machine's last 20 GB (1,000 replicas on 100k shards: the run completed, then was killed for memory before writing its figures)
    one_at_a_time = threading.Lock()

    def done_shards(self) -> set[int]:
        if not self.shards_dir.exists():
            return set()
        with one_at_a_time:
            return {table[n] for n in os.listdir(self.shards_dir) if n in table}

    real, RunDir.done_shards = RunDir.done_shards, done_shards
    return real


def _replica_group(indices, run, plan, replicas, batch, gen_s, deadline, kill_prob, lease_s, heartbeat_s, stagger_s,
                   poll_s, jitter, *, seed, t_start, machine: int = 0, forked: bool = False,
                   kill_upload_prob: float = 0.0) -> dict:
    """Run the replicas ``indices`` as threads of this process, their claims beaten by one thread; raw figures.
    A run kept in a bucket: the process is machine ``machine``, with its own scratch folder and its own clients of
    the bucket (``forked``: those of the parent ran on its event loop, which is not in this process)."""
    kw = dict(seed=seed, t_start=t_start, kill_upload_prob=kill_upload_prob)
    if run.store:  # no shared listing (_shared_done_shards): each replica lists the bucket itself, as on a cluster
        if forked:
            bucket_claims.cache_clear()
            bucket_files.cache_clear()
        run = machine_run(run.root, run.store, machine)
        plan = load_plan(run)
        return _replica_threads(indices, run, plan, replicas, batch, gen_s, deadline, kill_prob, lease_s, heartbeat_s,
                                stagger_s, poll_s, jitter, **kw)
    real_done_shards = _shared_done_shards(plan.num_shards)
    try:
        return _replica_threads(indices, run, plan, replicas, batch, gen_s, deadline, kill_prob, lease_s, heartbeat_s,
                                stagger_s, poll_s, jitter, **kw)
    finally:
        RunDir.done_shards = real_done_shards


def _replica_threads(indices, run, plan, replicas, batch, gen_s, deadline, kill_prob, lease_s, heartbeat_s, stagger_s,
                     poll_s, jitter, *, seed, t_start, kill_upload_prob: float = 0.0) -> dict:
    """``_replica_group``'s body."""
    COUNTER.clear()
    stores = (run.claims, run.files) if run.store else ()  # their requests counters, shared by the process
    requests0 = sum((Counter(st.requests) for st in stores), Counter())
    # hundreds of threads in one interpreter: a thread back from a syscall waits for the GIL up to the switch interval
    # per waiting thread; the heartbeat thread makes two syscalls per replica per pass, so shorter turns keep it on time
    sys.setswitchinterval(0.001)
    stop = threading.Event()
    rng = random.Random(seed)
    shardrun.generate_batch = fake_generator(gen_s, kill_prob, rng, jitter)
    latencies, first_claims, idle_from, lock = [], [], [], threading.Lock()
    commits, kills, takeovers, upload_kills, abandoned = Counter(), Counter(), Counter(), Counter(), Counter()
    last_commit, last_claim, first_idle = [0.0], [0.0], [float("inf")]
    beats = Heartbeats(heartbeat_s, workers=HEARTBEAT_WORKERS if run.store else 1)
    cpu0 = os.times()

    def one(index: int, attempt: int = 0):
        if stagger_s:
            time.sleep(rng.random() * stagger_s)
        claimer = Claimer(run, dict(owner_record(index), attempt=attempt), lease_s=lease_s, heartbeat_s=heartbeat_s,
                          own_thread=False)
        beats.add(claimer)
        sink = ShardSink("png", threads=1)
        # a run kept in a bucket commits as the runner's replicas do: the upload (tar, index, then the record, the
        # done marker) is the commit, made on the writer under the claim (ReplicaWorker._committed)
        uploader = ShardUploader.committing(run, lease_s) if run.store else None
        dead = threading.Event()  # killed on the writer, between the upload and its record
        if uploader is not None and kill_upload_prob:
            index_suffix = shard_index.index_path(run, 0).suffix

            def send(local: Path, real=uploader._send):
                sent = real(local)
                if local.suffix == index_suffix and rng.random() < kill_upload_prob:  # tar and index are in the bucket
                    dead.set()
                    beats.remove(claimer)  # the process is gone: its heartbeat stops at once
                    raise Killed()
                return sent
            uploader._send = send
        w = ReplicaWorker(plan=plan, pipe=None, settings=SIM_SETTINGS, batch_size=batch, ctx=ReplicaContext(index, replicas),
                          sink=sink, claimer=claimer, poll_s=poll_s, uploader=uploader)
        next_shard, claims = w.next_shard, [0]

        def timed():
            if dead.is_set():
                raise Killed()
            if stop.is_set():
                return None
            COUNTER.set_phase("claim")
            t, wall = time.perf_counter(), time.time()
            got = next_shard()
            COUNTER.set_phase("process")  # the replica's own work on the shard until the next claim
            with lock:
                if got is None:  # nothing was left for this replica from the call's start on: the tail began
                    first_idle[0] = min(first_idle[0], wall)
                    idle_from.append(wall)
                    return None
                latencies.append(time.perf_counter() - t)
                if claims[0] == 0 and attempt == 0:
                    first_claims.append(time.time() - t_start)
                claims[0] += 1
                last_claim[0] = max(last_claim[0], time.time())
                takeovers[got[1] > 1] += 1
            return got

        def committed(shard, stats, orig=w._committed):
            orig(shard, stats)
            if stats is not None:
                with lock:
                    commits[shard] += 1
                    last_commit[0] = max(last_commit[0], time.time())
        w.next_shard, w._committed = timed, committed
        try:
            w.run()
            w.close()
        except (Killed, RuntimeError) as e:  # a kill on the writer comes back as the sink's error
            if not isinstance(e, Killed) and not isinstance(e.__cause__, Killed):
                raise
            with lock:
                kills[index] += 1
                upload_kills[index] += dead.is_set()
            try:
                sink.close()  # the process is gone: its heartbeat stops, its claim expires after lease_s
            except RuntimeError:
                if not dead.is_set():
                    raise
            with lock:  # the claims it leaves: each one taken over once its lease is out
                abandoned[index] += len(claimer.held)
        finally:
            beats.remove(claimer)
            claimer.close()
        if kills[index] > attempt and not stop.is_set():
            one(index, attempt + 1)  # SLURM requeues it

    threads = [threading.Thread(target=one, args=(i,), name=f"replica-{i}", daemon=True) for i in indices]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and time.time() < deadline:
        time.sleep(0.2)
    stop.set()  # replicas stop at their next claim; a replica in its shard finishes it
    t_end = time.time()
    for t in threads:
        t.join(timeout=max(0.1, t_end + 60 - time.time()))
    beats.close()
    cpu = os.times()
    requests = sum((Counter(st.requests) for st in stores), Counter())
    requests.subtract(requests0)
    return dict(t_end=t_end, stuck=sum(t.is_alive() for t in threads), commits=commits, counts=Counter(COUNTER.counts),
                entries=Counter(COUNTER.entries), latencies=latencies, first_claims=first_claims,
                max_gap_s=round(beats.max_gap_s, 3), kills=sum(kills.values()), takeovers=takeovers[True],
                last_commit=last_commit[0], last_claim=last_claim[0], first_idle=first_idle[0], idle_from=idle_from,
                cpu_s=cpu.user + cpu.system - cpu0.user - cpu0.system, renewals=beats.renewals,
                s3=Counter(COUNTER.s3), requests=+requests, upload_kills=sum(upload_kills.values()),
                abandoned=sum(abandoned.values()))


def _ms(sorted_s: list[float], q: float) -> float | None:
    """The q quantile of sorted seconds, in ms."""
    return round(1000 * sorted_s[int(q * (len(sorted_s) - 1))], 2) if sorted_s else None


def _duplicates(run: RunDir) -> tuple[int, int]:
    """(samples committed more than once, samples committed), from the committed shards' index files."""
    import pyarrow.parquet as pq

    seen: Counter = Counter()
    for p in sorted(run.shards_dir.glob("*.parquet")):
        if os.path.islink(p) or p.stat().st_nlink > 1:
            continue  # a prefilled copy (hard link): not made by the simulation
        seen.update(pq.read_table(p, columns=["key"]).column("key").to_pylist())
    return sum(n - 1 for n in seen.values() if n > 1), sum(seen.values())


def _bucket_check(run: RunDir, plan, fig: dict) -> dict:
    """Exactly once, read back from the bucket: every shard done (its upload record), each sample key of the plan in
    exactly one committed index (each index fetched and checked against its record: ``fetch``), every recorded object
    in the bucket as uploaded (``missing_uploads``), no claim left; with what the machines' scratch folders still
    stage (a shard committed elsewhere after this machine died in its upload: the machine's next launch drops it)."""
    import pyarrow.parquet as pq

    from shardgen.dataio.prompts.plan import sample_key

    done = run.done_shards()
    bad = missing_uploads(run)
    seen: Counter = Counter()
    for shard in sorted(done - set(bad)):
        data = fetch(run, shard, shard_index.index_path(run, shard).suffix)
        seen.update(pq.read_table(io.BytesIO(data), columns=["key"]).column("key").to_pylist())
    missing = sum(sample_key(i) not in seen for s in range(plan.num_shards) for i in plan.shard_range(s))
    dup = sum(n - 1 for n in seen.values() if n > 1)
    machines = sorted(run.root.parent.glob(f"{run.root.name}.machine*"))
    staged = sum(len(staged_shards(RunDir(m))) for m in machines)
    once = len(done) == plan.num_shards and not fig["commits_twice"] and not dup and not missing and not bad
    return dict(complete=len(done) == plan.num_shards, done_shards=len(done), duplicated_samples=dup,
                committed_samples=sum(seen.values()), missing_samples=missing, objects_not_as_uploaded=len(bad),
                claims_left=len(run.claims.latest()), staged_left_on_machines=staged, exactly_once=once)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--per-shard", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen-s", type=float, default=0.02, help="seconds per fake batch")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--prefill", type=float, default=0.0)
    ap.add_argument("--kill-prob", type=float, default=0.0)
    ap.add_argument("--lease-s", type=float, default=2.0)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--stagger-s", type=float, default=0.0)
    ap.add_argument("--jitter", type=float, default=0.0, help="each fake batch's time varies by up to this share")
    ap.add_argument("--procs", type=int, default=1, help="processes the replica threads are spread over (forked)")
    ap.add_argument("--scale", type=float, default=None,
                    help="time scale K: the production lease (120 s), heartbeat (15 s) and idle poll (2 s) and a "
                    "shard's GPU time (--shard-gpu-s) all divided by K (overrides --gen-s, --lease-s, --heartbeat-s)")
    ap.add_argument("--shard-gpu-s", type=float, default=2000.0,
                    help="with --scale: a real shard's generation time (1,000 samples x 2 s)")
    ap.add_argument("--dir", default=None, help="where to make the run (default: a temp dir, removed after); "
                    "a run left there by an earlier call is used as it is. With --bucket: the machines' scratch folders")
    ap.add_argument("--bucket", default="", metavar="s3://BUCKET/PREFIX",
                    help="keep the run in this bucket (a prefix without a run), at the S3 server of AWS_ENDPOINT_URL")
    ap.add_argument("--kill-upload-prob", type=float, default=0.0,
                    help="with --bucket: the chance that a replica dies after uploading its shard, before its record")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.kill_upload_prob and not a.bucket:
        ap.error("--kill-upload-prob needs --bucket (a run directory commits without an upload)")
    if a.bucket and a.prefill:
        ap.error("--prefill fabricates committed shards in a run directory; it does not take --bucket")
    poll_s = None
    if a.scale:
        batches = -(-a.per_shard // a.batch)
        a.gen_s, a.lease_s, a.heartbeat_s = a.shard_gpu_s / a.scale / batches, LEASE_S / a.scale, HEARTBEAT_S / a.scale
        poll_s = min(2.0, HEARTBEAT_S) / a.scale  # as the runner sets it from the production heartbeat
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="simcluster-"))
    try:
        fig = simulate(tmp / "run", a.replicas, a.shards, a.per_shard, a.batch, a.gen_s, a.seconds, a.prefill,
                       a.kill_prob, a.lease_s, a.heartbeat_s, stagger_s=a.stagger_s, poll_s=poll_s, procs=a.procs,
                       jitter=a.jitter, store=a.bucket.rstrip("/"), kill_upload_prob=a.kill_upload_prob)
        fig.update(scale=a.scale)
    finally:
        if a.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(fig, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
