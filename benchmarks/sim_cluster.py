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

``--prefill F`` fabricates F of the shards as committed (copies of one real committed shard, renamed and
with their own stats) so the claims and the start-up are measured on a run that is mostly done, the case
where a listing of shards/ is largest. ``--seconds`` bounds the run: the figures are per committed shard.
One machine cannot be 1,000 GPUs: all replicas share the GIL and this host's disk, so latencies are upper
bounds of the protocol's own cost; operation counts are what a shared filesystem would see.
"""

from __future__ import annotations

import argparse
import builtins
import errno
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from shardgen.dataio.prompts import PromptSource, build_plan, load_plan
from shardgen.dataio.resume import record_plan_digests, repair_run_dir
from shardgen.dataio.rundir import Claimer, RunDir, owner_record
from shardgen.dataio.shards import Sample, ShardSink
from shardgen.dataio.tools import run_status
from shardgen.run import replica as replica_mod
from shardgen.run.generation import GenSettings
from shardgen.run.replica import ReplicaContext, ReplicaWorker

# what the fake generator's replicas are given: the shape of every batch (tiny samples, one call key)
SIM_SETTINGS = GenSettings(height=8, width=8, steps=1, guidance=0.0, true_cfg_scale=1.0, negative_prompt=None,
                           max_sequence_length=77, model="sim", strategy="dp")

OPS = ("stat", "lstat", "listdir", "scandir", "open", "rename", "replace", "unlink", "mkdir", "rmdir", "utime",
       "link", "fsync")


class OpCounter:
    """Counts metadata operations by (phase, call); the phase is the thread's (``phase`` below) or its name."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.entries: Counter = Counter()  # directory entries listed, by phase
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

    def uninstall(self) -> None:
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)

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


COUNTER = OpCounter()


class Killed(Exception):
    """A simulated kill of a replica (its heartbeat stops; its claim expires)."""


def make_plan(root: Path, shards: int, per_shard: int) -> RunDir:
    """A run directory planned from a prompt file of shards * per_shard short prompts."""
    run = RunDir(root)
    root.mkdir(parents=True, exist_ok=True)
    prompts = root.parent / f"{root.name}.prompts.txt"
    with open(prompts, "w") as f:
        f.writelines(f"prompt {i}\n" for i in range(shards * per_shard))
    source = PromptSource(path=str(prompts), format="txt", field="prompt")
    plan = build_plan(run, source, samples_per_shard=per_shard, run_seed=0)
    run.create()
    record_plan_digests(plan)
    return run


def fake_generator(gen_s: float, kill_prob: float, rng: random.Random):
    def generate_batch(pipe, settings, rows, replica_ranks=1):
        time.sleep(gen_s)
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
    replica_mod.generate_batch = fake_generator(0, 0, random.Random(0))
    shard, gen, done = w.next_shard()
    w.process(shard, gen, done)
    w.close()
    stats = json.loads(run.shard_stats(shard).read_text())
    tar, idx = run.shard_tar(shard), run.shards_dir / f"{shard:06d}.parquet"
    picks = random.Random(seed).sample([s for s in range(plan.num_shards) if s != shard], n - 1)
    for s in picks:
        try:
            os.link(tar, run.shard_tar(s))
            os.link(idx, run.shards_dir / f"{s:06d}.parquet")
        except OSError as e:  # ext4 allows 65,000 links to a file: go on from a copy (as many links again)
            if e.errno != errno.EMLINK:
                raise
            tar, idx = _copy_next_to(tar, run, s), _copy_next_to(idx, run, s)
            run.shard_tar(s).unlink(missing_ok=True)
            os.link(tar, run.shard_tar(s))
            os.link(idx, run.shards_dir / f"{s:06d}.parquet")
        run.shard_stats(s).write_text(json.dumps(dict(stats, shard=s)))
    return n


def _copy_next_to(path: Path, run: RunDir, s: int) -> Path:
    """A copy of a prefilled file, with as many links left as a fresh file (beside the run dir, not in it)."""
    out = run.root.parent / f"{run.root.name}.prefill-{s}{path.suffix}"
    shutil.copy2(path, out)
    return out


def simulate(*args, **kwargs) -> dict:
    """``_simulate`` with the replica module's generator put back afterwards (a test process goes on to real jobs)."""
    real = replica_mod.generate_batch
    try:
        return _simulate(*args, **kwargs)
    finally:
        replica_mod.generate_batch = real


def _simulate(root: Path, replicas: int, shards: int, per_shard: int = 1, batch: int = 1, gen_s: float = 0.02,
             seconds: float = 60.0, prefill_frac: float = 0.0, kill_prob: float = 0.0, lease_s: float = 2.0,
             heartbeat_s: float = 0.5, seed: int = 0, stagger_s: float = 0.0) -> dict:
    """Run the simulation; the figures as a dict."""
    t_plan = time.perf_counter()
    if (root / "plan" / "plan.json").exists():  # --dir of an earlier run: measured again as it is (--prefill ignored)
        run = RunDir(root)
        plan_s, prefilled = 0.0, len(run.done_shards())
        plan = load_plan(run)
    else:
        run = make_plan(root, shards, per_shard)
        plan_s = time.perf_counter() - t_plan
        plan = load_plan(run)
        prefilled = prefill(run, plan, prefill_frac, seed)

    COUNTER.install()
    try:
        # a replica's start-up on this run: load the plan, the launch's repair (what prepare_run does on it)
        # (nothing else runs yet: every operation counted meanwhile is theirs, their thread pools' included)
        # the first launch on the run checks every committed shard; a later one (every other job) only changed ones
        ops0, t0 = COUNTER.total(), time.perf_counter()
        plan = load_plan(run)
        repair_run_dir(plan, lease_s)
        first_s, first_ops = time.perf_counter() - t0, COUNTER.total() - ops0
        ops0, t0 = COUNTER.total(), time.perf_counter()
        plan = load_plan(run)
        repair_run_dir(plan, lease_s)
        startup_s, startup_ops = time.perf_counter() - t0, COUNTER.total() - ops0
        # jobs.status: the first call reads every committed shard's stats; a later one only those new since
        ops0, t0 = COUNTER.total(), time.perf_counter()
        run_status(plan, lease_s)
        first_status_s, first_status_ops = time.perf_counter() - t0, COUNTER.total() - ops0
        ops0, t0 = COUNTER.total(), time.perf_counter()
        run_status(plan, lease_s)
        status_s, status_ops = time.perf_counter() - t0, COUNTER.total() - ops0
        COUNTER.counts.clear()
        COUNTER.entries.clear()  # the figures per committed shard count the replicas' operations only
        fig = _run_replicas(run, plan, replicas, batch, gen_s, seconds, kill_prob, lease_s, heartbeat_s, seed,
                            stagger_s)
    finally:
        COUNTER.uninstall()
    dup, committed_samples = _duplicates(run)
    fig.update(replicas=replicas, shards=shards, per_shard=per_shard, prefilled=prefilled, plan_s=round(plan_s, 2),
               first_startup_s=round(first_s, 3), first_startup_ops=first_ops,
               startup_s=round(startup_s, 3), startup_ops=startup_ops,
               first_status_s=round(first_status_s, 3), first_status_ops=first_status_ops, status_s=round(status_s, 3),
               status_ops=status_ops, duplicated_samples=dup, committed_samples=committed_samples,
               load=os.getloadavg()[0])
    return fig


def _run_replicas(run, plan, replicas, batch, gen_s, seconds, kill_prob, lease_s, heartbeat_s, seed, stagger_s) -> dict:
    stop = threading.Event()
    rng = random.Random(seed)
    replica_mod.generate_batch = fake_generator(gen_s, kill_prob, rng)
    latencies, lock = [], threading.Lock()
    commits = Counter()
    kills = Counter()
    last_commit, last_claim = [0.0], [0.0]

    def one(index: int, attempt: int = 0):
        if stagger_s:
            time.sleep(rng.random() * stagger_s)
        claimer = Claimer(run, dict(owner_record(index), attempt=attempt), lease_s=lease_s, heartbeat_s=heartbeat_s)
        sink = ShardSink("png", threads=1)
        w = ReplicaWorker(plan=plan, pipe=None, settings=SIM_SETTINGS, batch_size=batch, ctx=ReplicaContext(index, replicas),
                          sink=sink, claimer=claimer, poll_s=min(2.0, heartbeat_s))
        next_shard = w.next_shard

        def timed():
            if stop.is_set():
                return None
            COUNTER.set_phase("claim")
            t = time.perf_counter()
            got = next_shard()
            COUNTER.set_phase("process")  # the replica's own work on the shard until the next claim
            if got is not None:
                with lock:
                    latencies.append(time.perf_counter() - t)
                    last_claim[0] = max(last_claim[0], time.time())
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
        except Killed:
            with lock:
                kills[index] += 1
            claimer.close()  # the process is gone: its heartbeat stops, its claim expires after lease_s
            sink.close()
            if not stop.is_set():
                one(index, attempt + 1)  # SLURM requeues it

    t_start = time.time()
    threads = [threading.Thread(target=one, args=(i,), name=f"replica-{i}", daemon=True) for i in range(replicas)]
    for t in threads:
        t.start()
    deadline = t_start + seconds
    while any(t.is_alive() for t in threads) and time.time() < deadline:
        time.sleep(0.2)
    stop.set()  # replicas stop at their next claim; a replica in its shard finishes it
    t_end = time.time()
    for t in threads:
        t.join(timeout=max(0.1, t_end + 60 - time.time()))
    complete = len(run.done_shards()) == plan.num_shards
    n = sum(commits.values())
    phases = COUNTER.by_phase()
    per = {p: round(sum(c.values()) / max(1, n), 2) for p, c in phases.items()}
    claim_calls = {k: round(v / max(1, n), 2) for k, v in sorted(phases.get("claim", Counter()).items())}
    lat = sorted(latencies)
    return dict(seconds=round(t_end - t_start, 1), complete=complete,
                stuck=sum(t.is_alive() for t in threads), committed_shards=n,
                shards_per_s=round(n / (t_end - t_start), 1), ops_per_shard=per,
                ops_per_shard_total=round(sum(per.values()), 1), claim_ops_by_call=claim_calls,
                listed_entries_per_shard={p: round(e / max(1, n), 1) for p, e in COUNTER.entries.items()},
                claim_median_ms=round(1000 * statistics.median(lat), 2) if lat else None,
                claim_p99_ms=round(1000 * lat[int(0.99 * (len(lat) - 1))], 2) if lat else None,
                heartbeat_ops=sum(phases.get("heartbeat", Counter()).values()), kills=sum(kills.values()),
                # the tail: from the last claim (from then on a replica looking for work finds none) to the last commit
                tail_s=round(max(0.0, last_commit[0] - last_claim[0]), 2) if complete else None,
                commits_twice=sum(1 for c in commits.values() if c > 1))


def _duplicates(run: RunDir) -> tuple[int, int]:
    """(samples committed more than once, samples committed), from the committed shards' index files."""
    import pyarrow.parquet as pq

    seen: Counter = Counter()
    for p in sorted(run.shards_dir.glob("*.parquet")):
        if os.path.islink(p) or p.stat().st_nlink > 1:
            continue  # a prefilled copy (hard link): not made by the simulation
        seen.update(pq.read_table(p, columns=["key"]).column("key").to_pylist())
    return sum(n - 1 for n in seen.values() if n > 1), sum(seen.values())


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
    ap.add_argument("--dir", default=None, help="where to make the run (default: a temp dir, removed after); "
                    "a run left there by an earlier call is used as it is")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="simcluster-"))
    try:
        fig = simulate(tmp / "run", a.replicas, a.shards, a.per_shard, a.batch, a.gen_s, a.seconds, a.prefill,
                       a.kill_prob, a.lease_s, a.heartbeat_s, stagger_s=a.stagger_s)
    finally:
        if a.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(fig, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
