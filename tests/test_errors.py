"""shardgen.errors: every error class in the codebase is classified by type (user error, job-ending, or bug)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import parallel
import shardgen
from shardgen.errors import JobEndingError, ShardgenError, UserError, ends_job, is_user_error, never_retry

# every error class shardgen defines, and what it must be: a fix for the user, or the end of a job
EXPECTED = {
    "ConfigError": "user", "PromptFileError": "user", "FingerprintMismatch": "user", "ParallelConfigError": "user",
    "ModelLoadError": "user", "LocalRankError": "user", "SlurmConfigError": "user", "SlurmSubmitError": "user", "BrokenSetupError": "user",
    "RemoteError": "user", "AccelError": "user", "LpipsWeightsError": "user", "CompatError": "user", "ReplicaBatchError": "job",
    "PinnedKernelUnavailable": "user",
    "AttentionChoiceChanged": "user", "MissingPin": "user",
    "CfgParallelError": "user", "PlanError": "user", "SignalConfigError": "user", "VideoConfigError": "user",
    "RunDirError": "user", "NotRegularFileError": "user", "DiskFullError": "user", "StorageError": "user", "ForeignPrefixError": "user", "PromptFileChanging": "user", "MemoryCheckError": "user", "BadSetting": "user",
    "LoraError": "user", "BadRow": "user",
    "BadImage": "user", "ImageGone": "user", "NotARaster": "user", "ContainerError": "user", "LoadError": "user",
    "PlanMismatch": "user", "GpuOutOfMemory": "user", "BatchOutOfMemory": "job", "CalibrationFailed": "user",
    "RayMissingError": "user", "RayClusterError": "user", "RayReplicaLostError": "user", "RayRankError": "user",
    "ConditionalWritesUnsupported": "user",
}


def _error_classes() -> dict[str, type]:
    found = {}
    for pkg in (shardgen, parallel):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                # a stop request (SIGTERM's Terminated) is a KeyboardInterrupt: no error to classify
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                        and not issubclass(obj, KeyboardInterrupt)
                        and not name.startswith("_") and obj not in (ShardgenError, UserError, JobEndingError)):
                    found[name] = obj
    return found


def test_every_error_class_is_classified_by_type():
    classes = _error_classes()
    assert set(classes) == set(EXPECTED), "a new error class must derive from UserError or JobEndingError (add it here)"
    for name, cls in classes.items():
        e = cls("x")
        assert isinstance(e, ShardgenError), name
        assert is_user_error(e) == (EXPECTED[name] == "user"), name
        assert ends_job(e) == (EXPECTED[name] == "job"), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_user_errors_are_never_retried_and_job_ending_ones_are(name):
    e = _error_classes()[name]("x")
    assert never_retry(e) == (EXPECTED[name] == "user")


def test_bugs_and_submitits_end_of_time():
    assert not is_user_error(KeyError("x")) and not ends_job(KeyError("x")) and not never_retry(KeyError("x"))
    from submitit.core.utils import UncompletedJobError

    over = UncompletedJobError("time is up")
    assert ends_job(over) and never_retry(over) and not is_user_error(over)
