"""The run directory: one output directory holds everything needed to resume, audit or extend a run.

Layout (all names zero-padded shard ids)::

    RUN_DIR/
      .shardgen-run             the owner record: this directory is a shardgen run (written first, when created)
      config.yaml               resolved config of the first launch (later launches: config.<time>.yaml)
      fingerprint.json          what determines the pixels; a resume with other values is refused
      fingerprint_changes.jsonl every accepted allow_fingerprint_change=true: when, by whom, what changed
      attention.json            sdpa_backend=auto_8bit: the attention kernel chosen at the first launch, kept
      plan/plan.json            prompt file, row count, shard size, shard count (fixed once)
      plan/starts.npy           where each shard's rows start in the prompt file (older plans: plan/000000.jsonl)
      plan/digests.npy          sha256 of each shard's rows, checked when they are read
      plan_digests.json         sha256 and size of each plan file, checked before a plan file is used
      shards/000000.tar         a committed shard (complete, readable)
      shards/000000.stats.json  written last: the shard's done marker (with the tar's size and sha256)
      uploads/000000.json       with output_uri: the shard's confirmed upload (its stats, each object's size, ETag,
                                sha256); with keep_local=false its local files are then deleted and this is its done
                                marker
      work/000000.g3.tar        shard 0's partial tar, claim generation 3
      work/000000.g3.ckpt.json  its checkpoint: samples, tar bytes and their sha256, durably written
      claims/000000.g3          the claim of generation 3 (mtime = heartbeat)
      summary.json              totals, rewritten at the end of each launch
      shards_checked.npy        committed shards a launch found sound (sizes, mtimes): later launches skip them
      stats_cache.npz           what jobs.status needs of each stats file (columns), valid while it is unchanged
      logs/failures, logs/slurm per-job failure counts and per-rank logs (SLURM)
      stray/                    files found in shards/ named like a shard the plan does not have, moved out by
                                repair (shardgen/dataio/resume/repair.py): loaders of shards/* never read them

This module builds every path of the run directory (``RunDir``), creates and cleans it up, and refuses a directory
shardgen may not write into (``check_run_root``); checks.py refuses a run_dir value that can only be a mistake. How
its files are written and read (whole, atomically, never through a symlink) is fileio.py's; the errors the storage
raises are storage.py's; whether a recorded process still runs is liveness.py's. The owner record, fingerprint, plan,
config, summary, logs of launches and fingerprint changes, the prompt file's hash, output_uri.json and done markers
are read and written through ``RunDir.files`` (runfiles.py), the claims through ``RunDir.claims`` (claimstore.py): the
directory itself, or, for a run kept in a bucket (``run_dir=s3://bucket/prefix``: ``store`` names it), the bucket.
Such a run's shards are committed by uploading them into the bucket (shardgen/dataio/shards/upload.py), and its upload
records are its only done markers; its ``root`` is this machine's scratch folder (``scratch_root``), holding the shard
being written, its checkpoints and the launch's logs and metrics.

Only a shardgen run is ever written into or cleaned up: a run_dir that exists, holds files and is
neither marked by ``.shardgen-run`` nor laid out like a run of an older version (``fingerprint.json``,
``plan/plan.json``, or ``shards/`` with ``claims/``) is refused before anything is written, as are
``/``, the home directory and an empty run_dir. Clean-up removes only names shardgen itself makes:
temp files ``.<name>~<host>~<pid>~<random>.tmp``, planning directories ``.plan-<host>-<pid>-<random>``
and ``.plan-damaged~<host>~<pid>~<ns>``, and symlinks at the names of shardgen's own files.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from shardgen.dataio.rundir.checks import URL_SCHEME, check_run_dir_text
from shardgen.dataio.rundir.fileio import TEMP_FILE_NAME, create_exclusive, json_bytes, temp_owner
from shardgen.dataio.rundir.liveness import gone_from_this_host
from shardgen.dataio.rundir.storage import RunDirError

if TYPE_CHECKING:
    from shardgen.dataio.rundir.claimstore import ClaimStore
    from shardgen.dataio.rundir.runfiles import RunFiles

LEFTOVER_AGE_S = 600.0  # a temp file or plan directory untouched this long belongs to a killed job
RUN_MARKER = ".shardgen-run"  # the owner record of a run directory
MARKER_VERSION = 1
_OWN_NAMES = {"shards": re.compile(r"[0-9]{6}\.(tar|stats\.json|parquet)"),
              "uploads": re.compile(r"[0-9]{6}\.json"),
              "work": re.compile(r"[0-9]{6}\.g[0-9]+\.(tar|ckpt\.json|index\.jsonl)"),
              "claims": re.compile(r"[0-9]{6}\.g[0-9]+"),
              "logs": re.compile(r"rank[0-9]+\.log|events\.[^/]+\.jsonl")}
PLAN_TEMP_NAME = re.compile(r"\.plan-[^-/]+-[0-9]+-[A-Za-z0-9_]+|\.plan-damaged~[^~/]+~[0-9]+~[0-9]+")


def shard_name(shard: int) -> str:
    """Zero-padded shard id: 6 digits, like img2dataset and webdataset brace patterns expect."""
    return f"{shard:06d}"


def run_dir_arg(text: str) -> str:
    """A run directory given on the command line; ``run_dir=PATH`` (how jobs.generate spells it) is
    accepted too, so a command line can be reused between the tools. An empty one is an argument error."""
    import argparse

    text = text[len("run_dir="):] if text.startswith("run_dir=") else text
    if not text.strip():
        raise argparse.ArgumentTypeError("the run directory is empty; give its path")
    return os.path.expanduser(text)  # the shell leaves run_dir=~/x alone


@dataclass(frozen=True)
class RunDir:
    """Every path inside one run directory (nothing else builds them); I/O only in ``create`` and ``clean_leftovers``."""

    root: Path
    container: str = "tar"
    """The shard container (``shard_container``): the extension of the shard files. A plan read back sets the one
    the run was planned with (plan/plan.json)."""
    store: str = ""
    """Where the run's small files are kept (``files``): "" for the run directory itself, or ``s3://bucket/prefix``
    whose objects are named like the files below ``root``."""

    @classmethod
    def at(cls, run_dir: str | os.PathLike, container: str = "tar") -> "RunDir":
        """The run directory a config or command line names: ``~`` expanded (a shell leaves ``run_dir=~/x``
        alone), relative paths taken from the current directory. A bucket URL (``s3://bucket/prefix``) is a run kept
        in the bucket (``store``), with this machine's scratch folder (``scratch_root``) as its local root."""
        text = os.fspath(run_dir)
        if URL_SCHEME.match(str(text).strip()):
            check_run_dir_text(str(text))  # a URL no run can be kept at: its one line, wherever it is given
            url = str(text).strip().rstrip("/")
            return cls(scratch_root(url), container, store=url)
        return cls(Path(os.path.expanduser(text)).absolute(), container)

    @property
    def name(self) -> str:
        """What the run is called in messages: its bucket URL, else its directory."""
        return self.store or str(self.root)

    @property
    def files(self) -> "RunFiles":
        """The store of the run's small shared files: owner record, fingerprint, plan, config, summary, logs of
        launches and changes, prompt hash, output_uri.json and done markers (runfiles.py)."""
        from shardgen.dataio.rundir.runfiles import DIR_FILES, bucket_files

        return bucket_files(self.store, self.root) if self.store else DIR_FILES

    @property
    def plan_dir(self) -> Path:
        return self.root / "plan"

    @property
    def shards_dir(self) -> Path:
        return self.root / "shards"

    @property
    def uploads_dir(self) -> Path:
        """The records of the shards' confirmed uploads to output_uri (shardgen/dataio/shards/upload.py)."""
        return self.root / "uploads"

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    @property
    def claims_dir(self) -> Path:
        return self.root / "claims"

    @property
    def claims(self) -> "ClaimStore":
        """Where the run's shard claims live: its claims/ folder, or, for a run kept in a bucket, the objects under
        ``<store>/claims/`` (claimstore.py)."""
        from shardgen.dataio.rundir.claimstore import DirClaims, bucket_claims

        return bucket_claims(self.store) if self.store else DirClaims(self)

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def failures_dir(self) -> Path:
        """Per-job failure counters of SLURM requeues."""
        return self.logs_dir / "failures"

    def failure_mark_path(self, job_id: str, attempt: int | str) -> Path:
        """The mark of one failed attempt of a SLURM job (created O_EXCL by its first failing rank); ``attempt="*"``
        gives the glob of them all."""
        return self.failures_dir / f"{job_id}.attempt{attempt}"

    @property
    def slurm_logs_dir(self) -> Path:
        return self.logs_dir / "slurm"

    @property
    def ray_logs_dir(self) -> Path:
        """launcher=ray: one log per actor, ``replicaNNN.rankN.log``."""
        return self.logs_dir / "ray"

    def rank_log_path(self, rank: int) -> Path:
        """Global rank ``rank``'s log, appended across launches."""
        return self.logs_dir / f"rank{rank:03d}.log"

    EVENTS_GLOB = "events.*.jsonl"
    """Pattern (in ``logs_dir``) of the commit-event files, one per writing process."""

    def events_path(self, host: str, pid: int) -> Path:
        """The commit events written by process ``pid`` on ``host`` (jobs.report reads them all)."""
        return self.logs_dir / f"events.{host}.{pid}.jsonl"

    @property
    def stray_dir(self) -> Path:
        """Files named like shards the plan does not have, moved out of shards/ (shardgen/dataio/resume/repair.py)."""
        return self.root / "stray"

    @property
    def metrics_dir(self) -> Path:
        """Prometheus textfile-collector files, one per writing rank (shardgen/dataio/rundir/metrics.py)."""
        return self.root / "metrics"

    def metrics_path(self, rank: int, job: str = "") -> Path:
        """Rank ``rank``'s metrics file; under SLURM named by its job too (an array's jobs each have a rank 0)."""
        return self.metrics_dir / (f"job{job}.rank{rank:03d}.prom" if job else f"rank{rank:03d}.prom")

    @property
    def latents_dir(self) -> Path:
        """Denoising-loop checkpoints of video batches (run/latent_ckpt.py)."""
        return self.root / "latents"

    @property
    def plan_json_path(self) -> Path:
        return self.plan_dir / "plan.json"

    @property
    def starts_path(self) -> Path:
        """Where each shard of the base plan starts in the prompt file."""
        return self.plan_dir / "starts.npy"

    @property
    def report_path(self) -> Path:
        return self.root / "report.html"

    def events_paths(self) -> list[Path]:
        """Every writer process's events file."""
        return sorted(self.logs_dir.glob(self.EVENTS_GLOB))

    @property
    def fingerprint_path(self) -> Path:
        return self.root / "fingerprint.json"

    @property
    def fingerprint_changes_path(self) -> Path:
        return self.root / "fingerprint_changes.jsonl"

    @property
    def plan_digests_path(self) -> Path:
        """sha256 and size of every plan file, recorded when the plan was made (checked before use)."""
        return self.root / "plan_digests.json"

    @property
    def prompt_hash_path(self) -> Path:
        return self.root / "prompt_hash.json"

    @property
    def output_uri_path(self) -> Path:
        """Where the run's shards are uploaded (output_uri), fixed by the first launch that set it."""
        return self.root / "output_uri.json"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    @property
    def launches_path(self) -> Path:
        """Every launch's summary, one JSON line each (shardgen/dataio/rundir/runlog.py)."""
        return self.root / "launches.jsonl"

    @property
    def shards_checked_path(self) -> Path:
        """Committed shards a launch found sound, with their files' sizes and mtimes (the next launch skips those
        unchanged: shardgen/dataio/resume/repair.py)."""
        return self.root / "shards_checked.npy"

    @property
    def stats_cache_path(self) -> Path:
        """What ``jobs.status`` needs of each committed shard's stats, with the stats file's size and mtime (a
        status call reads only the stats that changed since: shardgen/dataio/resume/ledger.py)."""
        return self.root / "stats_cache.npz"

    @property
    def config_path(self) -> Path:
        """The resolved config of the first launch."""
        return self.root / "config.yaml"

    def later_config_path(self, when: float) -> Path:
        """The resolved config of a later launch."""
        return self.root / f"config.{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}.yaml"

    @property
    def preview_path(self) -> Path:
        return self.root / "preview.png"

    @property
    def attention_path(self) -> Path:
        """The attention kernel ``sdpa_backend=auto_8bit`` chose for the run, kept for it
        (shardgen/run/auto_8bit.py)."""
        return self.root / "attention.json"

    @property
    def calibration_path(self) -> Path:
        """The quality gate's figures (``calibrate_samples``, shardgen/quality/gate.py), written by the job."""
        return self.root / "calibration.json"

    @property
    def compare_path(self) -> Path:
        """``jobs.compare``'s summary against a reference run (shardgen/quality/compare.py): a few kilobytes."""
        return self.root / "compare.json"

    @property
    def compare_samples_path(self) -> Path:
        """``jobs.compare``'s figures of every compared sample, one JSON line each."""
        return self.root / "compare_samples.jsonl"

    @property
    def tool_outputs(self) -> tuple[Path, ...]:
        """The only files inside a run directory that an operator tool writes (``jobs.preview``, ``jobs.report``,
        ``jobs.compare``)."""
        return self.preview_path, self.report_path, self.compare_path, self.compare_samples_path

    @property
    def marker_path(self) -> Path:
        """The owner record: its presence says this directory is a shardgen run (clean-up happens only in one)."""
        return self.root / RUN_MARKER

    def start(self) -> Path | None:
        """Make the run directory and its owner record (the first write of a new run; RunDirError when the path
        cannot be a run directory). Where the run's files are in a bucket, the record there is the run's and the
        directory holds a copy of it. The topmost directory this call created (None: it existed), for ``undo_start``."""
        check_run_root(self.root)
        top = first_missing_dir(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create {self.root} ({e.strerror}); choose a writable run_dir") from None
        if self.marker_path.is_symlink():
            self.marker_path.unlink()  # never written through, nor taken for the record
        record = json_bytes(dict(shardgen_run=MARKER_VERSION, created=time.time()))
        if self.store:  # the store's record is the run's (upload.run_id); the directory gets a copy of it
            self.files.create(self.marker_path, record)
            record = self.files.read(self.marker_path) or record
        if not self.marker_path.is_file():  # a concurrent job may create it first: then this one keeps it
            create_exclusive(self.marker_path, record)
        return top

    def undo_start(self, top: Path | None) -> None:
        """Remove the owner record and the directories ``start`` created, when nothing else was put in them
        (a new run refused before it began leaves nothing behind)."""
        self.marker_path.unlink(missing_ok=True)
        if self.store:
            self.files.delete(self.marker_path)
        if top is None:
            return
        for d in (self.root, *self.root.parents):
            try:
                os.rmdir(d)  # only an empty directory goes
            except OSError:
                return
            if d == top:
                return

    def create(self) -> None:
        """Create the directory skeleton and the owner record (idempotent); RunDirError when the path cannot be
        a run directory."""
        self.start()
        for d in (self.shards_dir, self.work_dir, self.claims_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except FileExistsError:
                raise RunDirError(f"{d} exists and is not a directory; move it away or choose another run_dir") from None
            except OSError as e:
                raise RunDirError(f"cannot create {d} ({e.strerror}); choose a writable run_dir") from None
        self.check_own_dirs()

    @property
    def own_dirs(self) -> tuple[Path, ...]:
        """Every directory of the run shardgen writes into (each checked by ``check_own_dirs``)."""
        return (self.plan_dir, self.shards_dir, self.uploads_dir, self.work_dir, self.claims_dir, self.logs_dir,
                self.metrics_dir, self.stray_dir)

    def check_own_dirs(self, dirs: Iterable[Path] | None = None) -> None:
        """RunDirError naming the first of ``dirs`` (default: ``own_dirs``) that is a symlink: shardgen never writes
        through one (a link to a directory elsewhere would have the run replace files there)."""
        for d in self.own_dirs if dirs is None else dirs:
            if d.is_symlink():
                raise RunDirError(f"{d} is a symlink; shardgen writes only into real directories inside a run "
                                  f"directory. Replace it by a directory (make run_dir itself the link instead)")

    def shard_file(self, shard: int) -> Path:
        """The committed shard's samples, in the run's container (``000042.tar``)."""
        return self.shards_dir / f"{shard_name(shard)}.{self.container}"

    def shard_files(self) -> list[Path]:
        """Every committed shard file in shards/, in shard order."""
        if not self.shards_dir.is_dir():
            return []
        return sorted(p for p in self.shards_dir.glob(f"*.{self.container}") if p.name[:6].isdigit())

    def shard_stats(self, shard: int) -> Path:
        return self.shards_dir / f"{shard_name(shard)}.stats.json"

    def shard_uploaded(self, shard: int) -> Path:
        """The record of ``shard``'s confirmed upload to output_uri (shardgen/dataio/shards/upload.py)."""
        return self.uploads_dir / f"{shard_name(shard)}.json"

    def partial_shard(self, shard: int, gen: int) -> Path:
        """Generation ``gen``'s shard file under construction."""
        return self.work_dir / f"{shard_name(shard)}.g{gen}.{self.container}"

    def checkpoint(self, shard: int, gen: int) -> Path:
        return self.work_dir / f"{shard_name(shard)}.g{gen}.ckpt.json"

    def claim(self, shard: int, gen: int) -> Path:
        return self.claims_dir / f"{shard_name(shard)}.g{gen}"

    def is_done(self, shard: int) -> bool:
        """Whether ``shard`` is committed: its stats file (the done marker) exists, or its upload record (with
        keep_local=false its local files are deleted once uploaded)."""
        if self.store:  # a run kept in a bucket commits by the upload record alone (no stats object is written)
            return self.files.exists(self.shard_uploaded(shard))
        return self.files.exists(self.shard_stats(shard)) or self.files.exists(self.shard_uploaded(shard))

    def done_shards(self) -> set[int]:
        """Shards whose stats file (the done marker) exists, or whose upload is recorded (with keep_local=false
        their local files are deleted once uploaded)."""
        if self.store:  # one listing of uploads/: a run kept in a bucket commits by the upload record alone
            return self.listed_shards(self.uploads_dir, ".json")
        return self.listed_shards(self.shards_dir, ".stats.json") | self.listed_shards(self.uploads_dir, ".json")

    def listed_shards(self, directory: Path, suffix: str) -> set[int]:
        """Shards with a file ``NNNNNN<suffix>`` in ``directory`` (one listing of the run's files; none when it does
        not exist)."""
        return {int(n[:6]) for n in self.files.names(directory) if n[:6].isdigit() and n[6:] == suffix}

    def clean_leftovers(self, max_age_s: float = LEFTOVER_AGE_S, listed: dict[Path, list[str]] | None = None) -> list[Path]:
        """Remove what killed jobs left behind (temp files, temporary plan directories); the removed paths.

        Only names shardgen itself makes are touched (``TEMP_FILE_NAME``, ``PLAN_TEMP_NAME``): a user's
        ``.session.tmp`` or ``.plan-backup/`` stays. Safe with other jobs running: a temp file goes at once
        only when its owner (host and pid in its name) is this host's and dead, anything else only when
        untouched for ``max_age_s`` (a live writer renames its temp file within seconds; a planner adds a
        file per shard). ``listed``: directories the caller has just listed (their names), not listed again."""
        removed = []
        for d in (self.root, self.plan_dir, self.shards_dir, self.uploads_dir, self.work_dir, self.claims_dir,
                  self.latents_dir):
            try:
                names = (listed[d] if listed and d in listed else os.listdir(d)) if not d.is_symlink() else []
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                if not (name.startswith(".") and (name.endswith(".tmp") or name.startswith(".plan-"))):
                    continue  # (checked before making a Path: shards/ holds 300k names on a 100k-shard run)
                path = d / name
                ours = TEMP_FILE_NAME.fullmatch(name) or (d == self.root and PLAN_TEMP_NAME.fullmatch(name))
                if ours and _leftover(path, name, max_age_s):
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() \
                        else path.unlink(missing_ok=True)
                    removed.append(path)
        return removed


def _leftover(path: Path, name: str, max_age_s: float) -> bool:
    owner = temp_owner(name)
    if owner is not None and gone_from_this_host(*owner):
        return True
    try:
        return time.time() - path.lstat().st_mtime > max_age_s
    except FileNotFoundError:
        return False


def own_file_name(directory: str, name: str) -> bool:
    """Whether ``name`` in the run's ``directory`` (shards, work, claims, logs) is a name shardgen writes."""
    pattern = _OWN_NAMES.get(directory)
    return bool(pattern and pattern.fullmatch(name))


def first_missing_dir(path: Path) -> Path | None:
    """The outermost directory of ``path`` (itself included) that does not exist yet; None if it exists."""
    path = Path(path)
    return next((p for p in reversed((path, *path.parents)) if not p.exists()), None)


def is_run_dir(root: Path) -> bool:
    """Whether ``root`` is a shardgen run: it has the owner record, or the layout of a run made before the
    record existed (``fingerprint.json``, ``plan/plan.json``, or both ``shards/`` and ``claims/``)."""
    root = Path(root)
    marker = root / RUN_MARKER
    if marker.is_file() and not marker.is_symlink():
        return True
    return (os.path.lexists(root / "fingerprint.json") or os.path.lexists(root / "plan" / "plan.json")
            or ((root / "shards").is_dir() and (root / "claims").is_dir()))


def scratch_root(url: str) -> Path:
    """This machine's folder for a run kept in the bucket ``url``: the shard being written, its checkpoints and the
    launch's logs (``$SHARDGEN_CACHE/runs/<16 hex digits of the URL's sha256>``), shared by the launches of one
    machine as a run directory is."""
    import hashlib

    from shardgen.cache import default_cache_dir

    return default_cache_dir() / "runs" / hashlib.sha256(url.encode()).hexdigest()[:16]


def _same_dir(a: Path, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def check_run_root(root: Path) -> bool:
    """RunDirError unless ``root`` is (or can become) a writable run directory: ``/`` and the home directory
    are refused, and so is an existing non-empty directory that is not a shardgen run (``is_run_dir``), before
    anything is written. True when no run is there yet (absent, or an empty directory)."""
    root = Path(root)
    if _same_dir(root, "/") or _same_dir(root, os.path.expanduser("~")):
        raise RunDirError(f"run_dir {root} is {'the root directory' if _same_dir(root, '/') else 'your home directory'}; "
                          "shardgen creates plan/ shards/ work/ claims/ logs/ in its run_dir. Choose a directory of "
                          f"its own, e.g. run_dir={root / 'runs' / 'mine'}")
    if root.exists() and not root.is_dir():
        raise RunDirError(f"run_dir {root} exists and is not a directory; choose another run_dir")
    probe = root
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise RunDirError(f"run_dir {root}: {probe} is not a directory; choose another run_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunDirError(f"run_dir {root}: {probe} is not writable by this user; choose a writable run_dir "
                          "or fix its permissions")
    if probe != root:
        return True
    try:
        # a concurrent job's temp files (its owner record being written) do not make the directory foreign
        names = sorted(n for n in os.listdir(root) if not (TEMP_FILE_NAME.fullmatch(n) or PLAN_TEMP_NAME.fullmatch(n)))
    except OSError as e:
        raise RunDirError(f"run_dir {root} cannot be listed ({e.strerror}); fix its permissions") from None
    if not names:
        return True
    if is_run_dir(root):
        return False
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise RunDirError(f"run_dir {root} holds files ({shown}) and is not a shardgen run (no {RUN_MARKER}); shardgen "
                      "writes only into a new or empty directory or an existing run, so nothing of yours is touched. "
                      f"Choose another run_dir (e.g. run_dir={root / 'run'})")
