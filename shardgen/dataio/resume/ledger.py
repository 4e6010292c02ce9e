"""Reading a run's state back from its directory: shard states, claims, counts, failures.

The run directory is the only source of truth (no pickled state, no database), so progress
bars, ``jobs.status``, ``jobs.verify`` and a requeued job all read it the same way.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from shardgen.dataio.prompts.plan import Plan
from shardgen.dataio.rundir.claims import LEASE_S, claim_state, owner_record, read_claim, scan_claims
from shardgen.dataio.rundir.fileio import atomic_write_bytes, map_io, open_regular
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.dataio.shards.shardwork import all_checkpoints, committed_stats


@dataclass
class ShardState:
    """One shard as seen on disk."""

    shard: int
    rows: int
    state: str               # done | running | future (heartbeat ahead of our clock) | stalled | dead | pending | damaged
    samples: int = 0         # committed (done) or checkpointed (in progress)
    claim_age_s: float | None = None
    holder: dict | None = None
    stats: dict | None = None
    started: float | None = None   # in progress: when the shard's first generation started (its checkpoint)
    updated: float | None = None   # in progress: when its last batch became durable (its checkpoint)


@dataclass
class Ledger:
    """A snapshot of a run."""

    plan: Plan
    shards: list[ShardState]
    failures_by_reason: Counter = field(default_factory=Counter)

    @property
    def done_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def count(self, state: str) -> int:
        return sum(s.state == state for s in self.shards)

    def totals(self) -> Counter:
        """ok / failed / rejected / truncated over committed shards (stats written before truncated was
        counted there have none)."""
        c: Counter = Counter()
        for s in self.shards:
            if s.stats:
                c.update({k: s.stats.get(k, 0) for k in ("ok", "failed", "rejected", "truncated")})
        return c


def read_ledger(plan: Plan, lease_s: float = LEASE_S, stats_cache: dict | None = None) -> Ledger:
    """Snapshot every shard's state; ``stats_cache`` (shard -> stats) avoids re-reading done shards.

    Each directory is listed once (not once per shard), and the done shards' stats are read by a few threads:
    on NFS or Lustre each read is a round trip, and 100k of them one after the other would take minutes."""
    run = plan.run
    cache = stats_cache if stats_cache is not None else {}
    done = run.done_shards()
    claims = scan_claims(run) if run.store or run.claims_dir.exists() else {}
    ckpts_of = all_checkpoints(run) if run.work_dir.exists() else {}
    cache.update(_read_stats_parallel(run, sorted(done - cache.keys())))
    now, me = time.time(), owner_record(-1)
    shards, reasons = [], Counter()
    for shard in range(plan.num_shards):
        rows = _rows(plan, shard)
        if shard in done:
            st = cache.get(shard)
            if st is None:  # shown as damaged; the next launch (or jobs.verify --repair) repairs it
                cache.pop(shard, None)
                shards.append(ShardState(shard, rows, "damaged"))
                continue
            if st.get("failures_by_reason") and isinstance(st["failures_by_reason"], dict):
                reasons.update(st["failures_by_reason"])
            shards.append(ShardState(shard, rows, "done", st["count"], stats=st))
            continue
        shards.append(_open_shard(run, shard, rows, claims, ckpts_of, now, lease_s, me))
    return Ledger(plan=plan, shards=shards, failures_by_reason=reasons)


def _rows(plan: Plan, shard: int) -> int:
    """A shard's rows; by arithmetic with one segment (shard_range 100k times costs a second)."""
    if plan.extensions or plan.per_row_images:
        return len(plan.shard_range(shard))
    per, total = plan.samples_per_shard, (plan.meta["num_rows"] * plan.images if plan.meta else plan.num_rows)
    return min(per, total - shard * per)


def _open_shard(run: RunDir, shard: int, rows: int, claims: dict, ckpts_of: dict, now: float, lease_s: float,
                me: dict) -> ShardState:
    """A shard not committed: pending, or its claim's state, with its best checkpoint's samples and times."""
    best = max(ckpts_of.get(shard, []), key=lambda c: c["n_done"], default=None)
    n = best["n_done"] if best else 0
    times = dict(started=best.get("started"), updated=best.get("updated")) if best else {}
    gen = claims.get(shard)
    if gen is None:
        return ShardState(shard, rows, "pending", n, **times)
    record, mtime = read_claim(run, shard, gen)
    age = None if mtime is None else now - mtime
    state = claim_state(record, mtime, now, lease_s, me)
    return ShardState(shard, rows, "pending" if state == "gone" else state, n, claim_age_s=age,
                      holder=record if isinstance(record, dict) else {}, **times)


@dataclass
class DoneSummary:
    """What ``jobs.status`` needs of the committed shards, summed (not one object per shard)."""

    shards: int = 0          # committed with readable stats
    damaged: int = 0         # committed, stats unreadable
    lost: list = field(default_factory=list)  # committed here, but the shard file is gone (and never uploaded)
    resized: list = field(default_factory=list)  # committed, but the shard file is not the size its stats record
    samples: int = 0
    totals: Counter = field(default_factory=Counter)            # ok / failed / rejected / truncated
    failures_by_reason: Counter = field(default_factory=Counter)
    shapes: Counter = field(default_factory=Counter)            # images per shape (shard stats' ``shapes``)
    first_started: float | None = None
    last_finished: float | None = None


@dataclass
class StatusLedger:
    """A run's snapshot for ``jobs.status``: the committed shards summed, a state per shard only for the shards
    with a claim or a checkpoint (``active``), and how many are pending without either."""

    plan: Plan
    done: DoneSummary
    active: list[ShardState]
    idle_pending: int

    @property
    def done_samples(self) -> int:
        return self.done.samples + sum(s.samples for s in self.active)

    def count(self, state: str) -> int:
        base = {"done": self.done.shards, "damaged": self.done.damaged, "pending": self.idle_pending}.get(state, 0)
        return base + sum(s.state == state for s in self.active)


_COLS = ("shard", "size", "mtime_ns", "count", "ok", "failed", "rejected", "truncated", "tar_bytes")  # int64
_TIMES = ("started", "finished")  # float64 columns, NaN where the stats have no number


def read_status_ledger(plan: Plan, lease_s: float = LEASE_S) -> StatusLedger:
    """The run's state for ``jobs.status``, from one listing of each directory.

    What status needs of each committed shard's stats is kept in ``stats_cache.npz`` (columns, not a JSON object
    per shard: 100k of those take seconds to parse), each row valid while its stats file's size and mtime (from
    the listing) are unchanged; a call reads only the stats committed or changed since the last one."""
    run = plan.run
    names, sig, lost, tar_sizes = _stats_listing(run)
    names = {s for s in names if s < plan.num_shards}  # (as read_ledger, which walks the plan's shards)
    sig = {s: v for s, v in sig.items() if s < plan.num_shards}
    claims = scan_claims(run) if run.store or run.claims_dir.exists() else {}
    ckpts_of = all_checkpoints(run) if run.work_dir.exists() else {}
    table, reasons, shapes = _load_table(run)
    keep = _valid_rows(table, sig)
    table = {k: v[keep] for k, v in table.items()}
    kept = set(table["shard"].tolist())
    reasons = {s: r for s, r in reasons.items() if s in kept}
    shapes = {s: r for s, r in shapes.items() if s in kept}
    todo = sorted(names - kept)
    fresh = _read_stats_parallel(run, todo)
    damaged = sum(st is None for st in fresh.values())
    rows = [(s, st) for s, st in fresh.items() if st is not None and s in sig]
    if rows:
        table = _append_rows(table, rows, sig)
        reasons.update(_dicts_of(rows, "failures_by_reason"))
        shapes.update(_dicts_of(rows, "shapes"))
        _save_table(run, table, reasons, shapes)
    # stats read but gone from the listing meanwhile (not in sig) still count, as read_ledger counts them
    extra = {s: st for s, st in fresh.items() if st is not None and s not in sig}
    reasons.update(_dicts_of(extra.items(), "failures_by_reason"))
    shapes.update(_dicts_of(extra.items(), "shapes"))
    summary = _summarize(table, reasons, list(extra.values()))
    for s in sorted(shapes):
        summary.shapes.update({k: v for k, v in shapes[s].items() if _int_or_zero(v)})
    summary.damaged = damaged
    summary.lost = sorted(x for x in lost if x < plan.num_shards)
    recorded = dict(zip(table["shard"].tolist(), table["tar_bytes"].tolist()))
    recorded.update({s: _int_or_zero(st.get("tar_bytes")) for s, st in extra.items()})
    summary.resized = sorted(s for s, size in tar_sizes.items()
                             if recorded.get(s) and size != recorded[s] and s < plan.num_shards)
    now, me = time.time(), owner_record(-1)
    open_shards = sorted((claims.keys() | ckpts_of.keys()) - names)
    active = [_open_shard(run, s, _rows(plan, s), claims, ckpts_of, now, lease_s, me)
              for s in open_shards if 0 <= s < plan.num_shards]
    idle = plan.num_shards - summary.shards - damaged - len(active)
    return StatusLedger(plan=plan, done=summary, active=active, idle_pending=idle)


def _dicts_of(items, name: str) -> dict[int, dict]:
    """shard -> its stats' ``name`` (failures by reason, images per shape), for the (shard, stats) pairs that have
    one (as read_ledger adds them)."""
    return {s: st[name] for s, st in items if st.get(name) and isinstance(st[name], dict)}


def _stats_listing(run: RunDir) -> tuple[set[int], dict[int, tuple[int, int]], set[int], dict[int, int]]:
    """(committed shards, shard -> (size, mtime_ns) of the file its stats are read from, lost shards, shard -> the
    size of its shard file), from one
    listing of shards/ and one of uploads/: a shard's stats file, else its upload record (keep_local=false deletes
    the local files once uploaded). Lost: committed here (stats in shards/) with no shard file beside them and no
    upload record (deleted by hand, or by a clean-up that took the wrong files): the next launch makes them again."""
    if run.store:
        return _bucket_stats_listing(run)
    names: set[int] = set()
    sig: dict[int, tuple[int, int]] = {}
    local = _shard_names(run.shards_dir)
    uploaded = _shard_names(run.uploads_dir)
    _list_signatures(run.shards_dir, local, ".stats.json", names, sig)
    _list_signatures(run.uploads_dir, uploaded, ".json", names, sig)
    def shards(listed: dict[str, list[str]], suffix: str) -> set[int]:
        return {int(n[:6]) for n in listed.get(suffix, ())}

    lost = shards(local, ".stats.json") - shards(local, "." + run.container) - shards(uploaded, ".json")
    tar_sig: dict[int, tuple[int, int]] = {}
    _list_signatures(run.shards_dir, local, "." + run.container, set(), tar_sig)
    return names, sig, lost, {s: v[0] for s, v in tar_sig.items()}


def _bucket_stats_listing(run: RunDir) -> tuple[set[int], dict[int, tuple[int, int]], set[int], dict[int, int]]:
    """``_stats_listing`` of a run kept in a bucket, from one listing of its shards/ and one of its uploads/ (with
    each object's size and LastModified): none lost, as the uploaded stats come after their tar."""
    sig: dict[int, tuple[int, int]] = {}
    tars: dict[int, int] = {}
    for folder, suffix in ((run.shards_dir, ".stats.json"), (run.uploads_dir, ".json")):
        for name, signature in run.files.signatures(folder).items():
            if name[:6].isdigit() and name[6:] == suffix:
                sig.setdefault(int(name[:6]), signature)
            elif folder == run.shards_dir and name[:6].isdigit() and name[6:] == "." + run.container:
                tars[int(name[:6])] = signature[0]
    return set(sig), sig, set(), tars


def _shard_names(directory) -> dict[str, list[str]]:
    """Suffix (``.stats.json``, ``.tar``, ...) -> the names ``NNNNNN<suffix>`` in ``directory``, from one
    ``os.listdir`` ({} for a missing directory)."""
    out: dict[str, list[str]] = {}
    try:
        listed = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for n in listed:
        if n[:6].isdigit() and n[6:7] == ".":
            out.setdefault(n[6:], []).append(n)
    return out


def _list_signatures(directory, listed: dict[str, list[str]], suffix: str, names: set[int],
                     sig: dict[int, tuple[int, int]]) -> None:
    """Add the shards with a file ``NNNNNN<suffix>`` in ``directory`` (``listed``: ``_shard_names``) to ``names``,
    and its (size, mtime_ns) to ``sig`` unless a shard there has one already.

    A stat relative to the directory's descriptor: a ``DirEntry`` for each of the 300k names of a 100k-shard run
    costs a second more, and only the stats files are stat'ed."""
    if not listed.get(suffix):
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        for name in listed[suffix]:
            shard = int(name[:6])
            if shard in names:
                continue
            names.add(shard)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            sig[shard] = (st.st_size, st.st_mtime_ns)
    finally:
        os.close(fd)


def _empty_table() -> dict:
    return {**{k: np.zeros(0, np.int64) for k in _COLS}, **{k: np.zeros(0, np.float64) for k in _TIMES}}


def _load_table(run: RunDir) -> tuple[dict, dict[int, dict], dict[int, dict]]:
    """The saved columns, failures by reason and images per shape (shard -> its dict); empty when there is none or
    it is damaged (or from before shapes were kept: the stats are read again once)."""
    path = run.stats_cache_path
    try:
        if path.is_symlink():
            raise ValueError("a symlink")
        with open_regular(path, follow=False) as f, np.load(f, allow_pickle=False) as z:
            table = {k: np.asarray(z[k], np.int64) for k in _COLS} | {k: np.asarray(z[k], np.float64) for k in _TIMES}
            reasons, shapes = json.loads(str(z["reasons"])), json.loads(str(z["shapes"]))
        if len({len(v) for v in table.values()}) != 1 or not isinstance(reasons, dict) or not isinstance(shapes, dict):
            raise ValueError("columns of different lengths")
        return table, {int(s): r for s, r in reasons.items()}, {int(s): r for s, r in shapes.items()}
    except Exception:  # none yet, or damaged (any of numpy's and zipfile's errors): the stats are read again
        return _empty_table(), {}, {}


def _valid_rows(table: dict, sig: dict[int, tuple[int, int]]) -> np.ndarray:
    """Which saved rows still describe their stats file (same size and mtime as listed now)."""
    if not len(table["shard"]) or not sig:
        return np.zeros(len(table["shard"]), bool)
    keys = np.fromiter(sig.keys(), np.int64, len(sig))
    vals = np.array(list(sig.values()), np.int64).reshape(-1, 2)
    order = np.argsort(keys)
    keys, vals = keys[order], vals[order]
    pos = np.clip(np.searchsorted(keys, table["shard"]), 0, len(keys) - 1)
    return (keys[pos] == table["shard"]) & (vals[pos, 0] == table["size"]) & (vals[pos, 1] == table["mtime_ns"])


def _num_or_nan(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else np.nan


def _int_or_zero(x) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def _append_rows(table: dict, rows: list[tuple[int, dict]], sig: dict) -> dict:
    add = dict(shard=[s for s, _ in rows], size=[sig[s][0] for s, _ in rows], mtime_ns=[sig[s][1] for s, _ in rows])
    for k in ("count", "ok", "failed", "rejected", "truncated", "tar_bytes"):
        add[k] = [_int_or_zero(st.get(k, 0)) for _, st in rows]
    for k in _TIMES:
        add[k] = [_num_or_nan(st.get(k)) for _, st in rows]
    return {k: np.concatenate([table[k], np.asarray(add[k], table[k].dtype)]) for k in table}


def _save_table(run: RunDir, table: dict, reasons: dict[int, dict], shapes: dict[int, dict]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **table, reasons=np.array(json.dumps({str(s): r for s, r in reasons.items()})),
             shapes=np.array(json.dumps({str(s): r for s, r in shapes.items()})))
    try:
        atomic_write_bytes(run.stats_cache_path, buf.getvalue())
    except OSError:  # a run directory this user may only read: the next call reads the stats again
        pass


def _summarize(table: dict, reasons: dict[int, dict], extra: list[dict]) -> DoneSummary:
    out = DoneSummary(shards=len(table["shard"]) + len(extra))
    out.samples = int(table["count"].sum()) + sum(st["count"] for st in extra)
    for k in ("ok", "failed", "rejected", "truncated"):
        out.totals[k] = int(table[k].sum()) + sum(_int_or_zero(st.get(k, 0)) for st in extra)
    for s in sorted(reasons):  # in shard order, as read_ledger adds them (most_common keeps ties in that order)
        out.failures_by_reason.update(reasons[s])
    starts = np.concatenate([table["started"], [_num_or_nan(st.get("started")) for st in extra]])
    ends = np.concatenate([table["finished"], [_num_or_nan(st.get("finished")) for st in extra]])
    if (starts == starts).any():
        out.first_started = float(np.nanmin(starts))
    if (ends == ends).any():
        out.last_finished = float(np.nanmax(ends))
    return out


def _read_stats_parallel(run: RunDir, shards: list[int]) -> dict[int, dict | None]:
    """shard -> its stats (None: unreadable), read concurrently."""
    def one(shard: int) -> dict | None:
        try:
            return committed_stats(run, shard)
        except RunDirError:
            return None

    return dict(zip(shards, map_io(one, shards)))


def run_lease_s(run: RunDir, default: float = LEASE_S) -> float:
    """The lease the run was configured with (from its resolved config), for status displays."""
    import yaml
    from omegaconf import OmegaConf

    try:
        data = run.files.read(run.config_path, limit=1 << 22)
        if data is None:
            return default
        text = data.decode("utf-8")
        return float(OmegaConf.create(text).get("lease_s", default))
    except (OSError, ValueError, TypeError, AttributeError, RunDirError, yaml.YAMLError):  # missing or damaged
        return default
