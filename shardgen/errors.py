"""One error hierarchy: what a user can fix, what ends a job, and everything else (a bug).

- ``UserError``: the message says what to change (a key, a file, a row). Printed without a traceback,
  never retried by a requeue: it would fail the same way again.
- ``JobEndingError``: the job stops here, not just one sample; a requeue or re-run may succeed
  (e.g. a batch that failed on one rank of a model-parallel replica).
- anything else is a bug: printed with its traceback.

Classification is by type (``is_user_error``, ``ends_job``), never by class-name strings.
"""

from __future__ import annotations


class ShardgenError(Exception):
    """Base of every error shardgen raises on purpose."""


class UserError(ShardgenError):
    """Something the user can fix; the message names what and how. Never retried."""


class ConfigError(UserError, ValueError):
    """A setting that cannot work; the message names the key and what to set instead. Raised by the checks of a
    composed config (shardgen/config/validate.py) and by those that live beside what they check (a model's
    source, its scheduler, its adapters)."""


class JobEndingError(ShardgenError):
    """The job must stop (not only the current sample); re-running or a requeue may succeed."""


def is_user_error(e: BaseException) -> bool:
    """True for errors printed as a message (no traceback) and never retried."""
    return isinstance(e, UserError)


def ends_job(e: BaseException) -> bool:
    """True for errors that end the job instead of marking a sample failed: ours, and submitit's signal that
    the job's time is over (raised into the loop by its signal handler)."""
    if isinstance(e, JobEndingError):
        return True
    try:
        from submitit.core.utils import UncompletedJobError
    except ImportError:  # submitit is a dependency, but the check must not need it
        return False
    return isinstance(e, UncompletedJobError)


def never_retry(e: BaseException) -> bool:
    """True where a self-requeue would be pointless: user errors and submitit's used-up time."""
    return is_user_error(e) or (ends_job(e) and not isinstance(e, JobEndingError))
