"""A run's state for an operator (``jobs.status``, also as JSON): progress, rate and ETA, each replica's rate,
what each claim holder is doing, the last error and warning in the rank logs.

Everything is read from the run directory: committed shards' stats, the checkpoints of shards in progress
(so a rate and an ETA exist before the first shard commits), claims and their heartbeats (a run without a
live claim is stopped: it has no ETA), the commit events and the rank logs. Images per shape (width x height
[x frames], a run with ``prompts.row_settings`` makes several) are the committed shards' stats summed.
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict

from shardgen.dataio.prompts.plan import Plan
from shardgen.dataio.rundir.fileio import open_regular
from shardgen.dataio.resume.ledger import StatusLedger, read_status_ledger
from shardgen.dataio.shards.upload import upload_state
from shardgen.tools.runfiles import launch_label, launch_of, read_events

LIVE = ("running", "future")      # a claim whose heartbeat is fresh: its holder is working
LOG_TAIL_BYTES = 256 * 1024       # the last error is looked for in the end of each rank log
_ERROR_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (ERROR|WARNING|CRITICAL) (\S+): (.*)$")


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _span(led: StatusLedger, now: float, live: bool) -> tuple[float | None, float | None]:
    """(first start, end) of the work on record: the end is now while a claim is live, else the last activity."""
    starts = [led.done.first_started] + [_num(s.started) for s in led.active if s.state != "done" and s.samples]
    ends = [led.done.last_finished] + [_num(s.updated) for s in led.active if s.state != "done" and s.samples]
    starts, ends = [t for t in starts if t is not None], [t for t in ends if t is not None]
    if not starts:
        return None, None
    return min(starts), now if live else max(ends, default=None)


def _replica_rates(plan: Plan, led: StatusLedger, now: float) -> list[dict]:
    """Per replica of each launch (its process: host and pid, SLURM job): samples committed (commit events) plus in
    its live shards, and its rate over that span; most recently active first. Two launches on one run each have a
    replica 0: ``launch`` tells them apart."""
    acc: dict[tuple, dict] = defaultdict(lambda: dict(samples=0, first=None, last=None))

    def add(who: dict, samples, first, last):
        key = (str(who.get("replica", "?")), *launch_of(who))
        a = acc[key]
        a["samples"] += samples
        if first is not None:
            a["first"] = first if a["first"] is None else min(a["first"], first)
        if last is not None:
            a["last"] = last if a["last"] is None else max(a["last"], last)

    for e in read_events(plan.run):  # typed records: a torn or odd line of a log is skipped
        t, wall = _num(e["t"]), _num(e.get("wall_s")) or 0.0
        add(e, e["samples"], t - wall, t)
    for s in led.active:
        if s.state in LIVE and s.holder is not None:
            add(s.holder, s.samples, _num(s.started), now)
    out = []
    for (replica, host, pid, job), a in sorted(acc.items(), key=lambda kv: -(kv[1]["last"] or 0)):
        span = (a["last"] - a["first"]) if a["first"] is not None and a["last"] is not None else 0
        out.append(dict(replica=replica, launch=launch_label(host, pid, job), samples=a["samples"], last=a["last"],
                        rate=round(a["samples"] / span, 3) if span > 0 else None))
    return out


def _claims(led: StatusLedger, now: float) -> list[dict]:
    out = []
    for s in led.active:
        if s.state not in ("running", "future", "stalled", "dead"):
            continue
        h = s.holder or {}
        out.append(dict(shard=s.shard, state=s.state, samples=s.samples, rows=s.rows, heartbeat_age_s=s.claim_age_s,
                        last_batch_age_s=None if s.updated is None else round(now - s.updated, 1),
                        host=h.get("host"), pid=h.get("pid"), job=h.get("job"), replica=h.get("replica")))
    return out


def last_problems(plan: Plan) -> dict[str, dict | None]:
    """The latest ERROR (or CRITICAL) line and the latest WARNING line of the rank logs (logs/rank*.log), as
    ``{"error": ..., "warning": ...}``: rank, time, level, logger, message (its first line); None without one."""
    best: dict[str, dict | None] = {"error": None, "warning": None}
    logs = sorted(plan.run.logs_dir.glob("rank*.log")) if plan.run.logs_dir.is_dir() else []
    for path in logs:
        if path.is_symlink():  # a link where a rank log should be is not followed
            continue
        try:
            with open_regular(path, follow=False) as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        for line in text.splitlines():
            if not (m := _ERROR_LINE.match(line)):
                continue
            kind = "warning" if m.group(2) == "WARNING" else "error"
            if best[kind] is None or m.group(1) >= best[kind]["time"]:
                best[kind] = dict(rank=path.stem.removeprefix("rank"), time=m.group(1), level=m.group(2),
                                  logger=m.group(3), message=m.group(4))
    return best


def run_status(plan: Plan, lease_s: float, now: float | None = None) -> dict:
    """The run's state as JSON-ready data (``python -m jobs.status RUN --json`` prints it)."""
    now = time.time() if now is None else now
    led = read_status_ledger(plan, lease_s)  # reads only the stats committed since the last call
    lost, resized = led.done.lost, led.done.resized
    done, complete = led.done_samples, led.count("done") == plan.num_shards and not lost and not resized
    live = any(s.state in LIVE for s in led.active)
    t0, end = _span(led, now, live)
    if complete:
        end = led.done.last_finished or end
    elapsed = (end - t0) if t0 is not None and end is not None else None
    rate = done / elapsed if elapsed and elapsed > 0 and done else None
    state = ("complete" if complete else "running" if live else "damaged" if lost or resized else "stopped" if done
             else "not started")
    eta = 0.0 if complete else ((plan.num_rows - done) / rate if live and rate else None)
    totals = led.done.totals
    return dict(
        run_dir=plan.run.name, state=state, samples_total=plan.num_rows, samples_done=done,
        samples_committed=led.done.samples,
        rejected_in_plan=plan.num_rejects,
        shards=dict(total=plan.num_shards, done=led.count("done") - len(resized), running=led.count("running") + led.count("future"),
                    stalled=led.count("stalled") + led.count("dead"), pending=led.count("pending"),
                    damaged=led.count("damaged"), lost=len(lost), resized=len(resized)),
        lost_shards=lost[:20], resized_shards=resized[:20],
        rate=None if rate is None else round(rate, 3), elapsed_s=None if elapsed is None else round(elapsed, 1),
        eta_s=None if eta is None else round(eta, 1), replicas=_replica_rates(plan, led, now),
        claims=_claims(led, now), results=dict(ok=totals["ok"], failed=totals["failed"], rejected=totals["rejected"],
                                                     truncated=totals.get("truncated", 0)),
        failures_by_reason=dict(led.done.failures_by_reason.most_common()),
        **{f"last_{kind}": line for kind, line in last_problems(plan).items()},
        row_settings=row_setting_names(plan), shapes=dict(led.done.shapes.most_common()),
        uploads=upload_state(plan.run))


def row_setting_names(plan: Plan) -> list[str]:
    """The prompt-file fields the run reads as generation settings (``prompts.row_settings``; [] for none)."""
    return list(plan.row_rules.names) if plan.row_rules else []


def run_metrics(st: dict, plan: Plan) -> bytes:
    """The run as a Prometheus exposition: its figures from ``st`` (``run_status``) under a ``run`` label, then every
    rank's own counters from its metrics/ file."""
    from prometheus_client.core import GaugeMetricFamily

    from shardgen.dataio.rundir import exposition, read_rank_metrics

    def gauge(name: str, doc: str, value: float | None = None, by: tuple[str, dict] | None = None):
        family = GaugeMetricFamily(name, doc, labels=["run", by[0]] if by else ["run"])
        for label, v in (by[1].items() if by else [(None, value)]):
            family.add_metric([st["run_dir"]] + ([label] if by else []), v)
        return family

    res, shards = st["results"], st["shards"]
    families = [
        gauge("shardgen_run_prompts", "Prompts of the run's plan (valid rows)", st["samples_total"]),
        gauge("shardgen_run_samples_done", "Samples committed or checkpointed", st["samples_done"]),
        gauge("shardgen_run_samples", "Samples in committed shards, by status",
              by=("status", {k: res[k] for k in ("ok", "failed", "rejected")})),
        gauge("shardgen_run_truncated_samples", "Samples whose prompt a text encoder cut", res.get("truncated", 0)),
        gauge("shardgen_run_shards", "Shards by state",
              by=("state", {k: shards[k] for k in ("done", "running", "stalled", "pending", "damaged", "lost")})),
        gauge("shardgen_run_claims", "Claims of unfinished shards (live, stalled or dead holders)",
              len(st["claims"])),
        gauge("shardgen_run_complete", "1 once every shard is committed", int(st["state"] == "complete")),
    ]
    if st["rate"] is not None:  # none before a first sample, nor an ETA without a live claim
        families.append(gauge("shardgen_run_samples_per_second", "The run's rate over its span", st["rate"]))
    if st["eta_s"] is not None:
        families.append(gauge("shardgen_run_eta_seconds", "Seconds until the run completes at its rate", st["eta_s"]))
    return exposition(families + read_rank_metrics(plan.run))
