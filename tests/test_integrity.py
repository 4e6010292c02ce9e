"""The run directory cannot be fooled: each way of fooling it, as a user would notice it.

A finished tiny run is made once (module fixture) and copied for each test; every test damages the
copy the way the table says, then re-runs generate / verify / status in process."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobs import preview, status, verify
from jobs.generate import run
from shardgen.dataio.shards import index as shard_index
from shardgen.dataio.prompts.plan import load_plan, sample_key
from shardgen.dataio.prompts.read import PromptFileError, read_prompts
from shardgen.dataio.resume.fingerprint import FingerprintMismatch, check_or_write_fingerprint
from shardgen.dataio.rundir.claims import Claimer, owner_record
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.runfiles import DirFiles
from shardgen.dataio.rundir.storage import DiskFullError, RunDirError
from shardgen.dataio.shards.shardwork import Sample, ShardWork, sample_members
from shardgen.dataio.shards.tarshard import PartialTar, scan_tar
from shardgen.tools.verify import read_shard_members, verify_run
from shardgen.run.replica import ReplicaContext, ReplicaWorker
from tests.conftest import compose_cfg, write_lines

PROMPTS = [f"prompt number {i}" for i in range(8)]
ARGS = ("height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=3", "batch_size=2")


def gen(run_dir: Path, prompts: Path, *extra: str):
    """One launch of jobs.generate, in process."""
    return run(compose_cfg(f"run_dir={run_dir}", f"prompts.path={prompts}", *ARGS, *extra))


def content(run_dir: Path) -> dict:
    """key -> (image, txt, json without timings): what a reader of the shards gets."""
    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for key, mem in read_shard_members(tar).items():
            meta = json.loads(mem["json"])
            meta.pop("gen_s", None)
            out[key] = (mem.get("png"), mem["txt"], meta)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(prompt file, a finished run, its content)."""
    d = tmp_path_factory.mktemp("ref")
    prompts = write_lines(d / "p.txt", PROMPTS)
    gen(d / "run", prompts)
    return prompts, d / "run", content(d / "run")


@pytest.fixture()
def copy(reference, tmp_path):
    """A private copy of the finished run: (prompt file, run dir, reference content)."""
    prompts, ref, want = reference
    shutil.copytree(ref, tmp_path / "run", symlinks=True)
    return prompts, tmp_path / "run", want


def verified_identical(run_dir: Path, want: dict) -> None:
    assert verify.main([str(run_dir)]) == 0
    assert content(run_dir) == want


def make_partial(run_dir: Path, shard: int, n: int, gen: int = 1) -> dict:
    """Turn committed shard ``shard`` back into what a killed holder of claim ``gen`` leaves: its first ``n``
    samples as a partial tar (the writer's very bytes), its checkpoint, and a claim whose heartbeat is old."""
    rd = RunDir(run_dir)
    plan = load_plan(rd)
    keys = [sample_key(i) for i in plan.shard_range(shard)]
    whole = rd.shard_file(shard).read_bytes()
    end = 0 if n == 0 else scan_tar(rd.shard_file(shard), keys[:n], limit=len(whole) - 1024).end
    tar = PartialTar(rd.partial_shard(shard, gen))
    tar._write(whole[:end])
    tar.sync()
    tar.close()
    ckpt = dict(shard=shard, gen=gen, n_done=n, tar_bytes=end, sha256=tar.sha256, counts={"ok": n},
                started=time.time(), updated=time.time())
    rd.checkpoint(shard, gen).write_text(json.dumps(ckpt))
    rows = shard_index.read_index(rd, shard)[:n]  # the index rows the holder had made durable
    shard_index.partial_index_path(rd, shard, gen).write_bytes(
        b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows))
    shard_index.index_path(rd, shard).unlink()
    rd.claim(shard, gen).write_text(json.dumps(dict(host="elsewhere", pid=1, replica=0, job=None, restart=0)))
    os.utime(rd.claim(shard, gen), (time.time() - 3600, time.time() - 3600))
    rd.shard_stats(shard).unlink()
    rd.shard_file(shard).unlink()
    return ckpt


# ------------------------------------------------------------------ the fingerprint cannot be bypassed

def test_a_run_without_its_fingerprint_is_refused_not_restarted(copy):
    prompts, d, want = copy
    (d / "fingerprint.json").unlink()
    with pytest.raises(RunDirError, match="no fingerprint.json.*Restore fingerprint.json, or start a new run_dir"):
        gen(d, prompts, "steps=4", "height=32")
    assert content(d) == want  # nothing was mixed in
    assert any("fingerprint.json: missing" in line for line in verify_run(load_plan(RunDir(d))).defects)


@pytest.mark.parametrize("garbage", [b"", b"{}", b"\x00\xff garbage", b'{"model.name": "tiny"', b"[1, 2]"])
def test_a_damaged_fingerprint_is_refused_naming_the_file(copy, garbage):
    prompts, d, _ = copy
    (d / "fingerprint.json").write_bytes(garbage)
    with pytest.raises(RunDirError, match=r"fingerprint.json.*Restore it"):
        gen(d, prompts)


def test_two_jobs_racing_on_a_fresh_run_dir_one_wins(tmp_path):
    """Both see no fingerprint, both try to create it: exactly one wins, the other is refused."""
    for attempt in range(10):
        run_dir = RunDir(tmp_path / f"r{attempt}")
        go, outcomes = threading.Barrier(2), []

        def job(steps):
            go.wait()
            try:
                outcomes.append(("new" if not check_or_write_fingerprint(run_dir, {"model.name": "tiny", "steps": steps,
                                                                                   "prompts.sha256": "x"}) else "resume"))
            except FingerprintMismatch:
                outcomes.append("refused")

        threads = [threading.Thread(target=job, args=(s,)) for s in (2, 4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        # the second either lost the creation (refused) or came just after it: a run without a sample takes its
        # settings, and the first is refused once its model loaded (tests/test_fingerprint.py)
        assert sorted(outcomes) in (["new", "refused"], ["new", "resume"])


def test_allow_fingerprint_change_with_edited_prompts_is_refused_not_ignored(copy):
    """Appending extends a run (tests/test_extend.py); an edit of a planned row is refused, even with
    allow_fingerprint_change=true, naming the file."""
    prompts, d, want = copy
    prompts.write_text("".join(p + "\n" for p in ["an edited first row", *PROMPTS[1:]]))
    try:
        with pytest.raises(FingerprintMismatch, match=f"prompts.path={prompts}: not this run's prompt file, nor that "
                                                      "file with prompts appended"):
            gen(d, prompts, "allow_fingerprint_change=true")
    finally:
        prompts.write_text("".join(p + "\n" for p in PROMPTS))
    verified_identical(d, want)


def test_allow_fingerprint_change_is_recorded_and_verify_then_reports_the_mix_which_repair_keeps(copy, capsys):
    prompts, d, _ = copy
    (d / "shards" / "000002.stats.json").unlink()
    (d / "shards" / "000002.tar").unlink()
    gen(d, prompts, "steps=2", "allow_fingerprint_change=true")
    record = json.loads((d / "fingerprint_changes.jsonl").read_text().splitlines()[-1])
    assert record["changes"] == {"steps": [1, 2]} and record["host"] == socket.gethostname()
    assert json.loads((d / "fingerprint.json").read_text())["steps"] == 2
    plan = load_plan(RunDir(d))
    rep = verify_run(plan)
    older = plan.num_rows - len(plan.shard_range(2))
    assert rep.ok and rep.earlier_settings == {"steps=1": older}  # asked for: not defects to repair away
    tars = sorted(p.name for p in (d / "shards").glob("*.tar"))
    assert verify.main([str(d), "--repair"]) == 0
    assert f"NOTE     {older} samples were made with settings the run had before allow_fingerprint_change " \
           f"({older} with steps=1;" in capsys.readouterr().out
    assert sorted(p.name for p in (d / "shards").glob("*.tar")) == tars
    (d / "fingerprint_changes.jsonl").unlink()  # without the record, the old samples are defects again
    assert any("steps=1, the run's fingerprint says 2" in line for line in verify_run(plan).defects)


# ------------------------------------------------------------------ no write through a symlink

def test_a_symlinked_partial_is_not_written_through(copy, tmp_path):
    prompts, d, want = copy
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for name in ("000000.stats.json", "000000.tar"):
        (d / "shards" / name).unlink()
    (d / "work" / "000000.g1.tar").symlink_to(victim)
    gen(d, prompts)
    assert victim.read_bytes() == b"precious"
    assert not (d / "shards" / "000000.tar").is_symlink()
    verified_identical(d, want)


def test_a_symlinked_committed_shard_is_removed_and_generated_again(copy, tmp_path):
    prompts, d, want = copy
    outside = tmp_path / "outside.tar"
    shutil.move(d / "shards" / "000001.tar", outside)
    (d / "shards" / "000001.tar").symlink_to(outside)
    before = outside.read_bytes()
    gen(d, prompts)
    assert not (d / "shards" / "000001.tar").is_symlink() and outside.read_bytes() == before
    verified_identical(d, want)


def test_preview_replaces_a_symlink_instead_of_writing_through_it(copy, tmp_path):
    _, d, _ = copy
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"precious")
    (d / "preview.png").symlink_to(victim)
    assert preview.main([str(d)]) == 0
    assert victim.read_bytes() == b"precious" and not (d / "preview.png").is_symlink()


def test_a_symlinked_plan_file_is_refused_naming_it(copy, tmp_path):
    prompts, d, _ = copy
    shutil.move(d / "plan" / "starts.npy", tmp_path / "x.npy")
    (d / "plan" / "starts.npy").symlink_to(tmp_path / "x.npy")
    with pytest.raises(RunDirError, match=r"plan/starts.npy is a symlink"):
        gen(d, prompts)


@pytest.mark.parametrize("folder", ["metrics", "logs", "uploads", "stray"])
def test_a_run_folder_that_is_a_symlink_is_refused_and_nothing_is_written_where_it_points(copy, tmp_path, folder):
    prompts, d, _ = copy
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "rank000.prom").write_bytes(b"precious")
    if (d / folder).exists():
        shutil.rmtree(d / folder)
    (d / folder).symlink_to(outside)
    with pytest.raises(RunDirError, match=rf"^{d / folder} is a symlink; shardgen writes only into real directories"):
        gen(d, prompts)
    assert sorted(p.name for p in outside.iterdir()) == ["rank000.prom"]
    assert (outside / "rank000.prom").read_bytes() == b"precious"


# ------------------------------------------------------------------ resume verifies before it trusts

def test_a_valid_partial_is_continued(copy, caplog):
    prompts, d, want = copy
    make_partial(d, 1, 2)
    with caplog.at_level(logging.INFO):
        r = gen(d, prompts)
    assert r.generated_here == 1  # only the one missing sample
    verified_identical(d, want)


@pytest.mark.parametrize("edit", ["smaller", "unaligned", "larger", "n_done", "empty_object", "garbage", "truncate",
                                  "flip_byte", "other_version"])
def test_an_edited_partial_or_checkpoint_is_restarted_never_trusted(copy, edit):
    prompts, d, want = copy
    ckpt = make_partial(d, 1, 2)
    rd = RunDir(d)
    ck, part = rd.checkpoint(1, 1), rd.partial_shard(1, 1)
    if edit in ("smaller", "unaligned", "larger", "n_done"):
        field, delta = {"smaller": ("tar_bytes", -512), "unaligned": ("tar_bytes", 7), "larger": ("tar_bytes", 1024),
                        "n_done": ("n_done", 1)}[edit]
        ck.write_text(json.dumps(dict(ckpt, **{field: ckpt[field] + delta})))
    elif edit == "empty_object":
        ck.write_text("{}")
    elif edit == "garbage":
        ck.write_bytes(b"\x00garbage")
    elif edit == "other_version":
        ck.write_text(json.dumps({k: v for k, v in ckpt.items() if k != "sha256"}))
    elif edit == "truncate":
        os.truncate(part, ckpt["tar_bytes"] - 100)
    else:
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))
    r = gen(d, prompts)
    assert r.complete
    verified_identical(d, want)


def test_a_truncated_committed_tar_is_not_complete(copy, capsys):
    prompts, d, want = copy
    os.truncate(d / "shards" / "000001.tar", 7000)
    assert verify.main([str(d)]) == 1
    assert "--repair" in capsys.readouterr().out  # says how to repair
    r = gen(d, prompts)
    assert r.generated_here == 3  # shard 1 again, not "already complete; nothing to do"
    verified_identical(d, want)


def test_a_tar_truncated_after_a_launch_found_it_sound_is_still_caught(copy):
    """A launch records the committed shards it found sound (shards_checked.npy) and skips them later, only while
    their files' sizes and mtimes are unchanged: a tar truncated since is checked and generated again."""
    prompts, d, want = copy
    assert gen(d, prompts).generated_here == 0  # a launch on the complete run records every shard as sound
    assert (d / "shards_checked.npy").is_file()
    os.truncate(d / "shards" / "000001.tar", 7000)
    assert gen(d, prompts).generated_here == 3
    verified_identical(d, want)


def test_a_committed_tar_damaged_in_place_is_caught_and_repaired(copy, capsys):
    prompts, d, want = copy
    tar = d / "shards" / "000000.tar"
    data = bytearray(tar.read_bytes())
    data[2000] ^= 0x01  # inside an image: same size, the tar still reads
    tar.write_bytes(bytes(data))
    assert verify.main([str(d)]) == 1
    out = capsys.readouterr().out
    assert "000000.tar does not match the sha256 in its stats" in out
    assert verify.main([str(d), "--repair"]) == 1 and "REPAIRED shard 000000" in capsys.readouterr().out
    gen(d, prompts)
    verified_identical(d, want)


@pytest.mark.parametrize("stats", [b"", b"{}", b"garbage", b'{"count": 3'])
def test_damaged_stats_are_rewritten_from_a_whole_tar(copy, stats, capsys):
    prompts, d, want = copy
    (d / "shards" / "000002.stats.json").write_bytes(stats)
    assert status.main([str(d)]) == 0 and "damaged" in capsys.readouterr().out  # no traceback
    assert verify.main([str(d)]) == 1 and "000002.stats.json" in capsys.readouterr().out
    inode = (d / "shards" / "000002.tar").stat().st_ino
    assert gen(d, prompts).generated_here == 0
    assert (d / "shards" / "000002.tar").stat().st_ino == inode  # finished, not regenerated
    verified_identical(d, want)


def test_a_kill_between_the_tar_rename_and_its_stats_loses_nothing(copy):
    prompts, d, want = copy
    (d / "shards" / "000001.stats.json").unlink()
    inode = (d / "shards" / "000001.tar").stat().st_ino
    assert gen(d, prompts).generated_here == 0
    assert (d / "shards" / "000001.tar").stat().st_ino == inode
    assert json.loads((d / "shards" / "000001.stats.json").read_text())["count"] == 3
    verified_identical(d, want)


@pytest.mark.parametrize("damage", ["starts_deleted", "plan_json_deleted", "plan_json_garbage"])
def test_a_damaged_plan_is_planned_again_identically(copy, damage):
    prompts, d, want = copy
    if damage == "starts_deleted":
        (d / "plan" / "starts.npy").unlink()
    elif damage == "plan_json_deleted":
        (d / "plan" / "plan.json").unlink()
    else:
        (d / "plan" / "plan.json").write_text("{not json")
    assert gen(d, prompts).generated_here == 0
    verified_identical(d, want)


def test_a_garbled_plan_shard_is_planned_again_or_refused_naming_the_file_and_the_fix(copy):
    from shardgen.dataio.resume.repair import checked_rows

    prompts, d, want = copy
    (d / "shards" / "000001.stats.json").unlink()
    (d / "shards" / "000001.tar").unlink()
    good = (d / "plan" / "starts.npy").read_bytes()
    plan = load_plan(RunDir(d))
    (d / "plan" / "starts.npy").write_bytes(good[:-8] + bytes(8))  # the last shard's start garbled
    with pytest.raises(RunDirError, match=r"plan/starts.npy was changed.*delete .*plan.json and re-run"):
        checked_rows(plan, 1)  # changed while a job uses it: refused
    assert gen(d, prompts).generated_here == 3  # at launch: planned again, identically
    assert (d / "plan" / "starts.npy").read_bytes() == good
    verified_identical(d, want)


def test_leftovers_of_killed_jobs_are_cleaned_up(copy):
    prompts, d, _ = copy
    planning = d / ".plan-otherhost-123-abcdefgh"  # a planner killed on another host an hour ago
    planning.mkdir()
    (planning / "000000.jsonl").write_text("x" * 1000)
    old = time.time() - 3600
    os.utime(planning, (old, old))
    dead_tmp = d / "shards" / f".000000.stats.json~{socket.gethostname()}~999999~x1.tmp"
    dead_tmp.write_text("{")
    live_tmp = d / "work" / f".000001.g1.ckpt.json~{socket.gethostname()}~{os.getpid()}~x2.tmp"
    live_tmp.write_text("{")  # a live writer's (ours): kept
    # a latent checkpoint being written when its job was killed (a video run's latent_checkpoint_every; found by
    # tests/test_video.py's SIGKILL test when the kill landed inside the write)
    (d / "latents").mkdir(exist_ok=True)
    dead_latent = d / "latents" / f".0000000000+2.pt~{socket.gethostname()}~999999~x3.tmp"
    dead_latent.write_bytes(b"\x80")
    gen(d, prompts)
    assert not planning.exists() and not dead_tmp.exists() and not dead_latent.exists() and live_tmp.exists()


def test_work_files_of_a_committed_shard_left_by_a_kill_after_its_commit_are_removed(copy):
    """A job killed after a shard's done marker and before the cleanup of its work files leaves them for good (no
    later claim of a done shard would); the next launch removes them. A shard that a live holder is rewriting
    (retry_failed) keeps its own."""
    from shardgen.dataio.resume.repair import repair_run_dir

    prompts, d, want = copy
    rd = RunDir(d)
    left = [rd.checkpoint(0, 2), rd.partial_shard(0, 2), shard_index.partial_index_path(rd, 0, 2)]
    for path in left:
        path.write_bytes(b"{}")
    claimer = Claimer(rd, owner_record(0), lease_s=60, heartbeat_s=3600)
    try:
        gen = claimer.try_claim(1, None)  # this live process rewrites shard 1
        rewriting = rd.checkpoint(1, gen)
        rewriting.write_bytes(b"{}")
        notes = repair_run_dir(load_plan(rd), lease_s=60)
        assert not any(p.exists() for p in left) and rewriting.exists()
        assert sum("shard 000000 is committed" in n for n in notes) == 3
    finally:
        claimer.close()
    rewriting.unlink()
    verified_identical(d, want)


# ------------------------------------------------------------------ claims: clock skew and take-over

def test_a_holder_whose_claim_was_taken_over_leaves_cleanly(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.create()
    a = Claimer(rd, dict(owner_record(0), host="host-a"), lease_s=60, heartbeat_s=3600)
    b = Claimer(rd, dict(owner_record(1), host="host-b"), lease_s=60, heartbeat_s=3600)
    try:
        assert a.try_claim(3, None) == 1
        work_a = ShardWork.open(rd, 3, 1, range(0, 1), still_mine=lambda: a.still_mine(3))
        work_a.write([Sample(key=sample_key(0), index=0, prompt="p", meta=dict(index=0), status="rejected",
                             failure="x")], [None], "png")
        past = time.time() - 3600  # a's clock (or the file server's) is behind: its heartbeat looks old
        os.utime(rd.claim(3, 1), (past, past))
        assert b.try_claim(3, 1) == 2
        ShardWork.open(rd, 3, 2, range(0, 1), still_mine=lambda: b.still_mine(3))  # removes a's partial
        assert work_a.commit() is None  # no FileNotFoundError: a leaves the shard to b
        assert not rd.shard_file(3).exists()
    finally:
        a.close()
        b.close()


def test_a_holder_taken_over_just_after_its_last_claim_check_leaves_cleanly(tmp_path, caplog):
    """The take-over lands between the holder's still_mine() and its commit (seen with 1,000 simulated replicas:
    'shard writer failed: FileNotFoundError ... index.jsonl'): the holder leaves the shard to the new one."""
    rd = RunDir(tmp_path / "run")
    rd.create()
    work_a = ShardWork.open(rd, 3, 1, range(0, 1), still_mine=lambda: True)  # its last check said "mine"
    work_a.write([Sample(key=sample_key(0), index=0, prompt="p", meta=dict(index=0), status="rejected",
                         failure="x")], [None], "png")
    ShardWork.open(rd, 3, 2, range(0, 1))  # the new holder removes a's partial files
    with caplog.at_level("WARNING"):
        assert work_a.commit() is None
    assert "removed by the replica that took it over; leaving it" in caplog.text
    assert not rd.shard_file(3).exists() and not rd.shard_stats(3).exists()


def test_a_shard_committed_by_its_old_holder_during_a_takeover_is_not_overwritten(tmp_path, caplog):
    """The old holder passed its last still_mine() just before the take-over and committed while the new holder was
    between its done-marker check and opening the shard (seen 1-10 times per run with 256-1,000 simulated replicas
    under load): the new holder generates the shard again but its commit leaves the first one whole and removes its
    own partial files; retry_failed's deliberate rewrite of a committed shard still commits."""
    rd = RunDir(tmp_path / "run")
    rd.create()

    def one_sample(work, failure):
        work.write([Sample(key=sample_key(0), index=0, prompt="p", meta=dict(index=0), status="rejected",
                           failure=failure)], [None], "png")

    work_a = ShardWork.open(rd, 3, 1, range(0, 1))
    one_sample(work_a, "from a")
    assert work_a.commit() is not None
    committed = {p: p.read_bytes() for p in (rd.shard_file(3), rd.shard_stats(3), shard_index.index_path(rd, 3))}
    work_b = ShardWork.open(rd, 3, 2, range(0, 1))
    one_sample(work_b, "from b")
    with caplog.at_level("WARNING"):
        assert work_b.commit() is None
    assert "committed by the replica it was taken over from; dropping this copy" in caplog.text
    assert {p: p.read_bytes() for p in committed} == committed
    assert not any(rd.checkpoint(3, 2).parent.glob("*000003*"))  # b's partial tar, index and checkpoint are gone
    retry = ShardWork.open(rd, 3, 3, range(0, 1), replaces=True)
    one_sample(retry, "from the retry")
    assert retry.commit() is not None and b"from the retry" in shard_index.index_path(rd, 3).read_bytes()


def _racing_commits(rd: RunDir, takeover_at: str, jitter: float, monkeypatch) -> tuple[dict | None, dict | None]:
    """Holder a finishes shard 3 (4 samples) and commits. It is alive but was silent past its lease, and replica b
    takes the shard over and commits it too, b's takeover landing ``takeover_at``: "check" (just after a's last
    claim check in its commit, racing a's renames) or "stats" (a has renamed its tar and index and pauses before
    its stats, the done marker, until b is through). (a's commit result, b's.)"""
    a = Claimer(rd, dict(owner_record(0), host="host-a"), lease_s=60, own_thread=False)
    b = Claimer(rd, dict(owner_record(1), host="host-b"), lease_s=60, own_thread=False)
    assert a.try_claim(3, None) == 1
    takeover, b_through, results = threading.Event(), threading.Event(), {}
    replace = DirFiles.replace

    def a_still_mine() -> bool:
        mine = a.still_mine(3)
        if takeover_at == "check":
            takeover.set()
            time.sleep(jitter)  # a's take_commit lands before, during or after b's takeover
        return mine

    def paused_before_stats(files, path, data):
        if path == rd.shard_stats(3) and threading.current_thread().name == "a" and takeover_at == "stats":
            takeover.set()
            assert b_through.wait(10)
        replace(files, path, data)

    def commit_a(work: ShardWork) -> None:
        try:
            results["a"] = work.commit()
        finally:
            takeover.set()  # a gave up before the point: b goes on

    def samples(who: str, start: int) -> tuple[list, list]:
        return ([Sample(key=sample_key(i), index=i, prompt=f"p{i}", meta=dict(index=i)) for i in range(start, 4)],
                [f"image {i} by {who}".encode() for i in range(start, 4)])

    monkeypatch.setattr(DirFiles, "replace", paused_before_stats)  # the stats' write
    work_a = ShardWork.open(rd, 3, 1, range(0, 4), still_mine=a_still_mine, take_commit=lambda: a.take_commit(3))
    work_a.write(*samples("a", 0), "png")
    thread_a = threading.Thread(target=commit_a, args=(work_a,), name="a")
    thread_a.start()
    try:
        assert takeover.wait(10)
        past = time.time() - 3600
        os.utime(rd.claim(3, 1), (past, past))  # a's heartbeat looks dead from b
        gen_b = b.try_claim(3, 1)
        if gen_b is not None:  # else a took the right to commit first: b never gets the shard
            work_b = ShardWork.open(rd, 3, gen_b, range(0, 4), still_mine=lambda: b.still_mine(3),
                                    take_commit=lambda: b.take_commit(3))
            if work_b.n_done < 4:  # a's partial was already renamed away: b generates the shard again
                work_b.write(*samples("b", work_b.n_done), "png")
            results["b"] = work_b.commit()
    finally:
        b_through.set()
        thread_a.join(20)
    monkeypatch.undo()
    return results.get("a"), results.get("b")


def test_a_copy_dropped_because_the_shard_was_committed_meanwhile_leaves_no_claim(tmp_path):
    """The old holder committed and released the shard between this replica's done-marker check and its claim
    (a fresh generation 1 then), so this replica generated it again; its commit drops the copy and must release
    its claims too (generation 1 and the commit's generation 2): nobody else would, and they stayed in claims/."""
    rd = RunDir(tmp_path / "run")
    rd.create()
    b = Claimer(rd, owner_record(1), heartbeat_s=3600)
    worker = ReplicaWorker(plan=SimpleNamespace(run=rd), pipe=None, settings=None, batch_size=1, ctx=ReplicaContext(),
                           claimer=b)
    try:
        assert b.try_claim(3, None) == 1 and b.take_commit(3)
        rd.shard_stats(3).write_text("{}")  # the old holder's commit (its claims already released)
        worker._committed(3, None)
        assert not list(rd.claims_dir.iterdir())
    finally:
        worker.close()


@pytest.mark.parametrize("takeover_at", ["check", "stats"])
def test_two_commits_of_one_shard_racing_leave_exactly_one_generation_whole(tmp_path, monkeypatch, takeover_at):
    """A holder alive but silent past its lease and the replica that took its shard over commit the shard at the
    same time: exactly one commits; the shard's tar, index and stats are that commit's, every sample once, all
    made by one replica; no partial file of either is left in work/."""
    keys = [sample_key(i) for i in range(4)]
    for i in range(12 if takeover_at == "check" else 2):
        rd = RunDir(tmp_path / f"run{i}")
        rd.create()
        got_a, got_b = _racing_commits(rd, takeover_at, (i % 4) * 0.001, monkeypatch)
        assert (got_a is None) != (got_b is None), f"iteration {i}: both or neither committed"
        winner = got_a or got_b
        assert json.loads(rd.shard_stats(3).read_text()) == winner  # the stats written are the winner's
        tar = rd.shard_file(3).read_bytes()
        assert hashlib.sha256(tar).hexdigest() == winner["sha256"] and len(tar) == winner["tar_bytes"]
        members = read_shard_members(rd.shard_file(3))
        assert sorted(members) == keys and [r["key"] for r in shard_index.read_index(rd, 3)] == keys
        makers = {m["png"].split(b" by ")[1] for m in members.values()}
        assert len(makers) == 1, f"iteration {i}: samples of two replicas in one shard: {makers}"
        assert not [p.name for p in rd.work_dir.iterdir()], f"iteration {i}: partial files left"


def test_a_kill_between_taking_the_commit_and_writing_its_stats_is_repaired_at_launch(copy, monkeypatch):
    """The commit's exclusive claim (the next generation) is taken and the tar renamed, then the job dies before
    the stats: the claim expires like any other, and the next launch finishes the shard from its tar."""
    prompts, d, want = copy
    rd = RunDir(d)
    make_partial(d, 1, 3)  # shard 1's 3 samples in a partial of claim g1, whose holder is gone
    holder = Claimer(rd, owner_record(0), lease_s=60, own_thread=False)
    assert holder.try_claim(1, 1) == 2
    work = ShardWork.open(rd, 1, 2, load_plan(rd).shard_range(1), still_mine=lambda: holder.still_mine(1),
                          take_commit=lambda: holder.take_commit(1))
    assert work.n_done == 3

    def killed(files, path, data):
        raise SystemExit("killed")

    monkeypatch.setattr("shardgen.dataio.rundir.runfiles.DirFiles.replace", killed)  # the stats' write
    with pytest.raises(SystemExit):
        work.commit()
    monkeypatch.undo()
    assert rd.claim(1, 3).exists() and rd.shard_file(1).exists() and not rd.shard_stats(1).exists()
    past = time.time() - 3600
    os.utime(rd.claim(1, 3), (past, past))  # the dead job's claims expire
    inode = rd.shard_file(1).stat().st_ino
    assert gen(d, prompts).generated_here == 0
    assert rd.shard_file(1).stat().st_ino == inode  # finished from its tar, not generated again
    verified_identical(d, want)


def test_a_claim_with_a_future_heartbeat_is_taken_over_in_bounded_time_and_reported(tmp_path, caplog):
    rd = RunDir(tmp_path / "run")
    rd.create()
    rd.claim(0, 1).write_text(json.dumps(dict(host="fast-clock-host", pid=1)))
    future = time.time() + 3600
    os.utime(rd.claim(0, 1), (future, future))
    c = Claimer(rd, owner_record(0), lease_s=0.5, heartbeat_s=3600)
    try:
        with caplog.at_level(logging.INFO, logger="shardgen.claims"):
            assert c.try_claim(0, 1) is None  # alive for now
            t0 = time.time()
            while (gen := c.try_claim(0, 1)) is None:
                assert time.time() - t0 < 5
                time.sleep(0.1)
        assert gen == 2
        assert "in the future" in caplog.text and "has not changed for" in caplog.text
    finally:
        c.close()


def test_status_a_dead_local_holder_is_not_running_and_skew_is_shown(copy, capsys):
    _, d, _ = copy
    rd = RunDir(d)
    for s in (0, 1):
        rd.shard_stats(s).unlink()
    rd.claim(0, 1).write_text(json.dumps(dict(host=socket.gethostname(), pid=999999, replica=0)))
    rd.claim(1, 1).write_text(json.dumps(dict(host="other", pid=5, replica=0)))
    future = time.time() + 3600
    os.utime(rd.claim(1, 1), (future, future))
    assert status.main([str(d), "--shards"]) == 0
    out = capsys.readouterr().out
    assert "shard 000000 dead" in out and "in the future (clock skew" in out
    assert "1 running, 1 stalled" in out


def test_status_names_a_committed_shard_whose_tar_is_gone_and_never_says_complete(copy, capsys):
    _, d, _ = copy
    (d / "shards" / "000001.tar").unlink()
    assert status.main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "lost     1 committed shard(s) whose shard file is gone (000001): the next launch" in out
    assert "state    DAMAGED" in out and "COMPLETE" not in out and "no ETA: no live claim" in out
    assert status.main([str(d), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["state"], st["shards"]["lost"], st["lost_shards"]) == ("damaged", 1, [1])
    assert status.main([str(d), "--prometheus"]) == 0
    out = capsys.readouterr().out
    assert 'state="lost"} 1.0' in out and "shardgen_run_complete{" in out and "} 0.0" in out.split("shardgen_run_complete{")[1]


def test_status_rate_of_a_finished_run_is_measured_up_to_its_finish(copy, capsys):
    _, d, _ = copy
    for s in range(3):  # the run took 80 s and finished an hour ago
        p = d / "shards" / f"{s:06d}.stats.json"
        st = json.loads(p.read_text())
        st.update(started=time.time() - 3680, finished=time.time() - 3600)
        p.write_text(json.dumps(st))
    assert status.main([str(d)]) == 0
    assert "rate     0.10 samples/s" in capsys.readouterr().out  # 8 samples / 80 s, not / 3680 s


# ------------------------------------------------------------------ input edge cases

def test_invalid_unicode_deep_nesting_and_nan_rows_are_file_line_errors_or_rejects(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "a\\ud800"}\n{"prompt": "b", "x": ' + "[" * 100000 + "]" * 100000
                 + '}\n{"prompt": "c", "v": NaN}\n{"prompt": "d", "v": Infinity}\n')
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: invalid Unicode"):
        list(read_prompts(str(f)))
    rows = list(read_prompts(str(f), on_bad_row="skip"))
    assert [r.reject is None for r in rows] == [True, False, False, False, False]
    assert "nested too deeply" in rows[2].reject and "NaN is not standard JSON" in rows[3].reject


def test_fields_named_like_shardgens_own_keys_go_under_extra(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "status": "ok", "error": "injected", "steps": 99, "mine": 1}\n')
    row = next(read_prompts(str(f)))
    assert row.extra == {"mine": 1, "extra": {"status": "ok", "error": "injected", "steps": 99}}
    s = Sample(key="k", index=0, prompt="a", meta=dict(row.extra, prompt="a", index=0))
    meta = json.loads(dict(sample_members(s, b"img", "png"))["k.json"])
    assert meta["status"] == "ok" and "error" not in meta and meta["extra"]["error"] == "injected"


# ------------------------------------------------------------------ no traceback for what a user can cause

def test_run_dir_that_is_a_file_is_a_user_error(tmp_path, reference):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match="exists and is not a directory"):
        gen(tmp_path / "f", reference[0])


def test_disk_full_names_the_path_and_the_free_space(tmp_path):
    tar = PartialTar(tmp_path / "x.tar")

    class Full(io.RawIOBase):
        def write(self, b):
            raise OSError(28, "No space left on device")

    tar._f = Full()
    with pytest.raises(DiskFullError, match=r"no space left writing .*x.tar .*GB free there.*re-run the same command"):
        tar.append([("a.txt", b"x" * 100)])


@pytest.mark.slow
# kill PID, docker stop, a scheduler other than SLURM; to a locally spawned job's parent alone. (Ctrl-C, a
# KeyboardInterrupt, takes the same path in jobs.generate: tests/test_generate.py has its message and its claims.)
@pytest.mark.parametrize("launch", [(), ("launcher=local", "launcher.nprocs=2")], ids=["one-process", "local-ranks"])
def test_sigterm_mid_run_says_it_is_resumable_and_leaves_no_rank_writing(tmp_path, launch):
    import signal

    from tests.conftest import start_module

    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i}" for i in range(2000)])
    r = tmp_path / "r"
    args = [f"run_dir={r}", f"prompts.path={prompts}", "height=16", "width=16", "steps=1", "progress=false",
            "samples_per_shard=20", "batch_size=2", *launch]
    p = start_module("jobs.generate", args, tmp_path / "out.log", stderr=tmp_path / "err.log")
    t0 = time.time()
    while not list((r / "shards").glob("*.tar")) if (r / "shards").is_dir() else True:  # stopped while it works
        assert time.time() - t0 < 120 and p.poll() is None
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    err = p.errors
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    assert f"stopped by SIGTERM. {r} is resumable: re-run the same command" in err and f"-m jobs.generate {args[0]}" in err
    assert "Traceback" not in err
    # every rank stopped and gave up its claims (a re-run takes the unfinished shards at once); nothing writes on
    made = sorted(os.listdir(r / "shards"))
    assert not [c for c in (r / "claims").rglob("*") if c.is_file()]
    time.sleep(1)
    assert sorted(os.listdir(r / "shards")) == made and len(made) < 3 * 100


def _processes_with(tag: str) -> list[int]:
    """The processes whose environment holds ``tag`` (a launch, its forkserver and its ranks)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if tag.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the ranks")
def test_a_launcher_killed_outright_takes_its_ranks_with_it_and_they_give_up_their_claims(tmp_path):
    """`kill -9` of a typed `strategy=tp tp_degree=2` launch (its ranks spawned here): the launcher cannot pass a
    signal on, so each rank notices it is gone, drops its batch and gives up its claims; nothing writes on."""
    import signal
    import uuid

    from tests.conftest import start_module

    # the ranks' forkserver and the ranks are new processes of the launch's environment: the tag finds them
    tag = f"SHARDGEN_TEST_TAG_{uuid.uuid4().hex}"
    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i}" for i in range(2000)])
    r = tmp_path / "r"
    p = start_module("jobs.generate", [f"run_dir={r}", f"prompts.path={prompts}", "height=16", "width=16", "steps=1",
                                       "progress=false", "samples_per_shard=20", "batch_size=2", "strategy=tp",
                                       "tp_degree=2"], tmp_path / "out.log", env={**os.environ, tag: "1"},
                     stderr=tmp_path / "err.log")
    t0 = time.time()
    while not list((r / "shards").glob("*.tar")) if (r / "shards").is_dir() else True:  # killed while it works
        assert time.time() - t0 < 120 and p.poll() is None
        time.sleep(0.05)
    assert len(_processes_with(tag)) >= 2, "the ranks were not found by their tag"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    t1 = time.time()
    while _processes_with(tag) and time.time() - t1 < 30:
        time.sleep(0.1)
    left = _processes_with(tag)
    for pid in left:  # not to leave them running past a failure
        os.kill(pid, signal.SIGKILL)
    assert not left  # every rank (and the forkserver) ended, within seconds
    err = p.errors
    assert "the launching process" in err and "is gone: this rank stops" in err
    assert not [c for c in (r / "claims").rglob("*") if c.is_file()]  # a re-run takes the unfinished shards at once
    made = sorted(os.listdir(r / "shards"))
    time.sleep(1)
    assert sorted(os.listdir(r / "shards")) == made


class _Refusing(io.RawIOBase):
    """A file whose writes the storage refuses with ``code``."""

    def __init__(self, code: int):
        self.code = code

    def write(self, b):
        raise OSError(self.code, os.strerror(self.code))


def _lose(d: Path, shard: int) -> None:
    for name in (f"{shard:06d}.tar", f"{shard:06d}.stats.json", f"{shard:06d}.parquet"):
        (d / "shards" / name).unlink(missing_ok=True)


@pytest.mark.parametrize("code,says", [(errno.EFBIG, "ulimit -f")])
def test_a_write_the_storage_refuses_mid_run_is_one_message_and_the_resume_is_identical(copy, monkeypatch, code, says):
    prompts, d, want = copy
    _lose(d, 1)
    _lose(d, 2)
    real = PartialTar._write

    def refused_after_a_batch(self, blob):
        if self.bytes:  # the shard's first batch went in: the storage refuses the next
            self._f, good = _Refusing(code), self._f
            try:
                return real(self, blob)
            finally:
                self._f = good
        return real(self, blob)

    monkeypatch.setattr(PartialTar, "_write", refused_after_a_batch)
    with pytest.raises(DiskFullError, match=says):
        gen(d, prompts, *SHORT_LEASE)
    monkeypatch.undo()
    verified_identical_after(d, prompts, want)


SHORT_LEASE = ("lease_s=1", "heartbeat_s=0.2")  # the refused launch's claims are this process's own: soon expired


def verified_identical_after(d: Path, prompts: Path, want: dict) -> None:
    time.sleep(1.2)
    assert gen(d, prompts, *SHORT_LEASE).complete
    verified_identical(d, want)


def test_a_write_refused_outside_the_tar_writer_is_one_message_too(copy, monkeypatch):
    """An index written by pyarrow in a writer thread (re-raised wrapped) and a read-only run directory at the start."""
    import shardgen.dataio.rundir.fileio as fileio
    import shardgen.dataio.shards.index as index

    prompts, d, want = copy
    _lose(d, 1)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(a[0]))

    monkeypatch.setattr(index, "write_index", full)
    with pytest.raises(DiskFullError, match="no space left writing"):
        gen(d, prompts, *SHORT_LEASE)
    monkeypatch.undo()

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(k.get("dir")))

    monkeypatch.setattr(fileio.tempfile, "mkstemp", read_only)
    with pytest.raises(DiskFullError, match=f"cannot write {d}.*Read-only file system"):
        gen(d, prompts)
    monkeypatch.undo()
    verified_identical_after(d, prompts, want)


def test_a_library_error_that_names_its_errno_only_in_its_text_is_a_storage_error():
    from shardgen.dataio.rundir.storage import storage_error

    try:
        try:
            raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")  # pyarrow's form
        except OSError as e:
            raise RuntimeError("shard writer failed") from e
    except RuntimeError as wrapped:
        assert "Free space (or inodes: df -i)" in str(storage_error(wrapped))


# ------------------------------------------------------------------ files named like shards the plan does not have

def test_a_file_named_like_a_shard_the_plan_lacks_is_a_defect_and_moved_out_of_shards(copy, capsys):
    """A copy left in shards/ (999999.tar, or the next number's index) adds samples to every loader of shards/*:
    verify names it, --repair and the next launch move it to stray/, byte for byte, and the run stays exactly-once."""
    prompts, d, want = copy
    shards = d / "shards"
    last = max(int(p.name[:6]) for p in shards.glob("*.tar"))
    tar_bytes = (shards / "000001.tar").read_bytes()
    (shards / "999999.tar").write_bytes(tar_bytes)
    (shards / f"{last + 1:06d}.parquet").write_bytes((shards / "000001.parquet").read_bytes())
    assert verify.main([str(d)]) == 1
    out = capsys.readouterr().out
    assert f"DEFECT shards/999999.tar: named like a shard of this run, but the plan has {last + 1} shards" in out
    assert f"DEFECT shards/{last + 1:06d}.parquet" in out and "--repair" in out
    assert verify.main([str(d), "--repair"]) == 1  # what it found is still a failure; the run is repaired
    assert sorted(p.name for p in (d / "stray").iterdir()) == [f"{last + 1:06d}.parquet", "999999.tar"]
    assert (d / "stray" / "999999.tar").read_bytes() == tar_bytes
    verified_identical(d, want)
    (shards / "999999.tar").write_bytes(tar_bytes)  # again: the next launch moves it, keeping the first one
    gen(d, prompts)
    assert (d / "stray" / "999999.tar.1").read_bytes() == tar_bytes
    verified_identical(d, want)


def test_verify_says_a_changed_prompt_file_once_and_repair_does_not_send_to_a_refused_rerun(copy, capsys):
    prompts, d, want = copy
    original = prompts.read_bytes()
    try:
        prompts.write_bytes(original.replace(b"number 1", b"n1", 1))  # shorter: its planned bytes are gone
        assert verify.main([str(d), "--repair"]) == 1
        out = capsys.readouterr().out
        assert out.count("the prompt file changed since the run was planned") == 1 and "DEFECT shard" not in out
        assert "Nothing in shards/ to repair" in out and "re-run the generate command" not in out
    finally:
        prompts.write_bytes(original)  # the module's reference run shares the prompt file
    verified_identical(d, want)


def test_a_stray_folder_that_is_a_symlink_is_refused_not_written_through(copy, tmp_path):
    prompts, d, want = copy
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (d / "stray").symlink_to(elsewhere)
    (d / "shards" / "999999.tar").write_bytes((d / "shards" / "000001.tar").read_bytes())
    with pytest.raises(RunDirError, match="stray is a symlink; shardgen writes only into real directories"):
        gen(d, prompts)
    assert not any(elsewhere.iterdir()) and (d / "shards" / "999999.tar").is_file()
