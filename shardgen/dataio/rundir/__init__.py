"""The run directory, the floor of dataio: where every file of a run lives and how it is written.

layout.py (``RunDir``: every path of the run directory, its creation and clean-up, a directory refused), checks.py (a
run_dir value refused before anything is written), fileio.py (atomic and exclusive writes, reads of regular files
only), storage.py (``RunDirError``, ``DiskFullError``: what the storage refused, said so the user can fix it),
liveness.py (host name, whether a recorded process runs), claims.py (a replica's lease on a shard), claimstore.py
(where claims live: claims/ or a bucket, through conditional writes), runfiles.py (where the run's fingerprint, plan
record, config, summary and done markers live: the directory or a bucket), bucket.py (small objects of a bucket:
conditional writes, retries), runlog.py (the run's event and rank logs), metrics.py (Prometheus files), slurm_jobs.py
(asking SLURM whether a job has ended), remote.py (files at fsspec URLs: ranged reads, retries, ``StorageError``).
Imports nothing else of dataio.
"""

from typing import TYPE_CHECKING

from shardgen.dataio import lazy_names

if TYPE_CHECKING:
    from .claims import Claimer, FUTURE_TOLERANCE_S, HEARTBEAT_S, LEASE_S, owner_record, scan_claims
    from .claimstore import BucketClaims, ClaimStore, DirClaims, probe_conditional_writes
    from .runfiles import BucketFiles, DirFiles, RunFiles
    from .remote import StorageError, bytes_read, is_url, public_url, redact_urls
    from .fileio import atomic_write_bytes, atomic_write_json, create_exclusive
    from .checks import check_run_dir_text, near_url_advice
    from .layout import RunDir, check_run_root, first_missing_dir, run_dir_arg
    from .metrics import RankMetrics, exposition, read_rank_metrics
    from .runlog import (attach_rank_log, detach_rank_log, escape_log_lines, log_to_file_only, read_jsonl,
                         read_run_jsonl, record_commit, record_launch)

__all__ = ["BucketClaims", "BucketFiles", "ClaimStore", "Claimer", "DirClaims", "DirFiles", "FUTURE_TOLERANCE_S", "HEARTBEAT_S", "LEASE_S",
           "RankMetrics", "RunDir", "StorageError", "atomic_write_bytes", "atomic_write_json", "attach_rank_log",
           "bytes_read", "check_run_dir_text", "check_run_root", "create_exclusive", "detach_rank_log",
           "escape_log_lines", "exposition",
           "first_missing_dir", "is_url", "near_url_advice", "log_to_file_only", "owner_record", "public_url",
           "redact_urls",
           "read_jsonl", "read_rank_metrics", "read_run_jsonl", "record_commit", "record_launch", "probe_conditional_writes", "RunFiles",
           "run_dir_arg", "scan_claims"]
__getattr__ = lazy_names(__name__, __all__)  # each name imported from its module on first use
