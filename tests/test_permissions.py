"""A run folder this user may not write (chmod 555: EACCES; chattr +i: EPERM) is one message naming the folder and
the fix, never a traceback, and the run resumes once it is fixed (docs/guarantees.md: "a run_dir that is ... not
writable"). Tests run as root, which ignores permissions: the refusals are simulated where the file is opened."""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from jobs import verify
from jobs.generate import run
from shardgen.dataio.rundir.storage import DiskFullError, storage_error
from shardgen.errors import is_user_error
from shardgen.tools.verify import read_shard_members
from tests.conftest import compose_cfg

ARGS = ("height=16", "width=16", "steps=1", "progress=false", "prompts.limit=6", "samples_per_shard=3",
        "lease_s=1", "heartbeat_s=0.2")  # the refused launch's claims are this process's own: soon expired


def gen(run_dir: Path):
    return run(compose_cfg(f"run_dir={run_dir}", *ARGS))


def content(run_dir: Path) -> dict:
    """key -> (image, caption): what a reader of the shards gets."""
    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for key, mem in read_shard_members(tar).items():
            out[key] = (mem.get("png"), mem["txt"])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref") / "run"
    gen(d)
    return d, content(d)


@pytest.fixture()
def copy(reference, tmp_path):
    """A copy of the finished run with its last shard lost (the next launch writes it again)."""
    ref, want = reference
    d = tmp_path / "run"
    shutil.copytree(ref, d, symlinks=True)
    for name in ("000001.tar", "000001.stats.json", "000001.parquet"):
        (d / "shards" / name).unlink(missing_ok=True)
    return d, want


def denied(folder: Path, code: int = errno.EACCES) -> str:
    return re.escape(f"{folder} is not writable by this user ({os.strerror(code).lower()}); fix its permissions")


def resumes(d: Path, want: dict) -> None:
    time.sleep(1.2)  # the refused launch's claim (if any) expires
    assert gen(d).complete
    assert verify.main([str(d)]) == 0
    assert content(d) == want


def test_a_shards_folder_not_writable_is_one_message_naming_it_and_the_run_resumes(copy, monkeypatch):
    """pyarrow refuses the index's temp file in shards/ from the writer thread (re-raised wrapped in a
    RuntimeError); its PermissionError names the file in its text only."""
    import pyarrow.parquet as pq

    d, want = copy
    real = pq.write_table

    def refused(table, where, *a, **k):
        if Path(where).parent == d / "shards":
            raise PermissionError(errno.EACCES, f"Failed to open local file '{where}'. Detail: [errno 13] "
                                                "Permission denied")
        return real(table, where, *a, **k)

    monkeypatch.setattr(pq, "write_table", refused)
    with pytest.raises(DiskFullError, match=denied(d / "shards")) as e:
        gen(d)
    assert is_user_error(e.value) and "re-run the same command" in str(e.value)
    monkeypatch.undo()
    resumes(d, want)


@pytest.mark.parametrize("folder,code", [("claims", errno.EACCES), ("work", errno.EPERM)])
def test_a_claims_or_work_folder_not_writable_is_one_message_naming_it_and_the_run_resumes(copy, monkeypatch, folder,
                                                                                          code):
    """Creating a claim (claims.py) or a partial tar (layout.open_fresh) is refused: chmod 555 gives EACCES, an
    immutable folder (chattr +i) EPERM."""
    d, want = copy
    real = os.open

    def refused(path, *a, **k):
        if Path(path).parent == d / folder:
            raise PermissionError(code, os.strerror(code), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(DiskFullError, match=denied(d / folder, code)) as e:
        gen(d)
    assert is_user_error(e.value)
    assert (code == errno.EPERM) == ("chattr -i" in str(e.value))  # an immutable flag is named where it may be one
    monkeypatch.undo()
    resumes(d, want)


def test_storage_error_sees_a_refused_permission_through_wrapping(tmp_path):
    where = tmp_path / "shards" / ".000001.parquet~host~1~ab.tmp"
    try:
        try:
            raise PermissionError(errno.EACCES, f"Failed to open local file '{where}'. Detail: [errno 13] "
                                                "Permission denied")  # pyarrow's form: the path in its text only
        except OSError as inner:
            raise RuntimeError(f"shard writer failed: {inner!r}") from inner
    except RuntimeError as wrapped:
        full = storage_error(wrapped)
    assert isinstance(full, DiskFullError) and re.match(denied(tmp_path / "shards"), str(full))
    # the errno in the text only (no errno attribute), EPERM
    full = storage_error(OSError(f"Failed to open local file '{where}'. Detail: [errno 1] Operation not permitted"))
    assert re.match(denied(tmp_path / "shards", errno.EPERM), str(full))
    # with the file name as the error's filename
    full = storage_error(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "claims" / "000002.g1")))
    assert re.match(denied(tmp_path / "claims"), str(full))


def test_a_refused_permission_that_names_no_file_is_not_a_storage_error():
    assert storage_error(PermissionError(errno.EPERM, "Operation not permitted")) is None  # e.g. os.kill


def test_the_message_names_what_is_at_fault(tmp_path, monkeypatch):
    """The file itself where it exists in a writable folder, or a folder above this user cannot enter (simulated:
    root passes every access check)."""
    log = tmp_path / "logs" / "rank0.log"
    log.parent.mkdir()
    log.write_text("x")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == log else real(p, mode, **k))
    assert str(storage_error(PermissionError(errno.EACCES, "Permission denied", str(log)))).startswith(
        f"{log} is not writable by this user")
    monkeypatch.setattr(os, "access", lambda p, mode, **k: not (Path(p) == tmp_path and mode & os.X_OK))
    assert str(storage_error(PermissionError(errno.EACCES, "Permission denied", str(log)))).startswith(
        f"{tmp_path} is not accessible by this user")
