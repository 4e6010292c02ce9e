"""The run fingerprint, alone: what a resume may and may not change."""

from __future__ import annotations

import os

import pytest

from shardgen.dataio.resume.fingerprint import (FingerprintMismatch, check_or_write_fingerprint, compute_fingerprint,
                                                diff_fingerprints, fingerprint_changes, read_fingerprint)
from shardgen.dataio.rundir.fileio import atomic_write_json
from shardgen.dataio.rundir.layout import RunDir
from tests.conftest import compose_cfg


def fp(*overrides: str) -> dict:
    return compute_fingerprint(compose_cfg(*overrides), "sha-of-prompts")


def test_only_pixel_determining_settings_count():
    base = fp()
    for free in ("batch_size=2", "sdpa_backend=cudnn", "launcher=local", "strategy=tp", "tp_degree=2", "writer_threads=4", "lease_s=60",
                 "progress=false", "run_dir=elsewhere"):
        assert fp(free) == base, free
    for bound, key in (("seed=1", "seed"), ("steps=3", "steps"), ("height=32", "height"),
                       ("image_format=jpg", "image_format"), ("samples_per_shard=7", "samples_per_shard"),
                       ("model.max_sequence_length=64", "model.max_sequence_length"), ("fp8=true", "fp8"),
                       ("sdpa_backend=sage", "sdpa_backend")):
        assert [d.split(":")[0] for d in diff_fingerprints(base, fp(bound))] == [key], bound
    assert compute_fingerprint(compose_cfg(), "other-sha")["prompts.sha256"] == "other-sha"


def test_the_prompt_format_recorded_is_the_one_the_file_is_read_as(tmp_path):
    assert fp("prompts.path=captions.jsonl")["prompts.format"] == "jsonl"  # the default reads by extension
    assert fp("prompts.path=captions.jsonl", "prompts.format=txt")["prompts.format"] == "txt"
    assert fp()["prompts.format"] == "txt"  # examples/prompts.txt: as runs of the default recorded it
    run = RunDir(tmp_path / "run")  # a run recorded with "auto" unresolved resumes
    check_or_write_fingerprint(run, dict(fp("prompts.path=captions.jsonl"), **{"prompts.format": "auto"}))
    run.create()
    run.shard_file(0).write_bytes(b"")
    assert check_or_write_fingerprint(run, fp("prompts.path=captions.jsonl")) is True


def test_a_resume_with_other_settings_is_refused_naming_the_field(tmp_path):
    run = RunDir(tmp_path / "run")
    assert check_or_write_fingerprint(run, fp()) is False
    run.create()
    run.shard_file(0).write_bytes(b"")  # a run with a sample
    assert check_or_write_fingerprint(run, fp("batch_size=1")) is True
    with pytest.raises(FingerprintMismatch, match="steps: run has 4, this launch has 3"):
        check_or_write_fingerprint(run, fp("steps=3"))
    assert check_or_write_fingerprint(run, fp("steps=3"), allow_change=True) is True


def test_the_refusal_steers_to_a_new_run_dir_and_says_what_allowing_the_change_does(tmp_path):
    run = RunDir(tmp_path / "run")
    check_or_write_fingerprint(run, fp())
    run.create()
    run.shard_file(0).write_bytes(b"")
    with pytest.raises(FingerprintMismatch) as e:
        check_or_write_fingerprint(run, fp("steps=3"))
    advice = str(e.value).split("\n")[-1]
    assert advice.startswith(f"To generate with these settings, choose a new run_dir (e.g. run_dir={run.root}-2)")
    assert "the samples already made stay as they are: jobs.verify notes them, and its --repair keeps them" in advice


def test_a_run_without_a_sample_takes_new_settings_and_records_them(tmp_path):
    run = RunDir(tmp_path / "run")
    check_or_write_fingerprint(run, fp("model=flux_dev"))
    run.create()
    new = fp("model=flux_dev", "model.source=/models/flux")
    assert check_or_write_fingerprint(run, new) is True
    assert read_fingerprint(run) == new
    assert fingerprint_changes(run)[0]["changes"] == {"model.source": ["black-forest-labs/FLUX.1-dev", "/models/flux"]}
    run.claims_dir.joinpath("000000.claim").write_text("{}")  # a sample under way: settings are fixed again
    with pytest.raises(FingerprintMismatch, match="model.source"):
        check_or_write_fingerprint(run, fp("model=flux_dev"))


def test_a_failed_model_load_leaves_a_run_dir_that_the_fixed_command_completes(tmp_path, monkeypatch):
    """The hub is unreachable: the first launch fails loading; the same command with model.source pointing at a
    local directory then runs in the same run_dir (and a prompts.limit change plans it again)."""
    import os

    from diffusers import FluxPipeline

    from jobs.generate import run
    from shardgen.models.loader import ModelLoadError
    from shardgen.families.flux.tiny import tiny_model_path

    real = FluxPipeline.from_pretrained

    def offline(source, **kw):
        if not os.path.isdir(source):
            raise OSError(f"{source} is not cached and the hub is unreachable")
        return real(source, **kw)

    monkeypatch.setattr(FluxPipeline, "from_pretrained", offline)
    args = ("model=flux_dev", f"run_dir={tmp_path / 'm3'}", "height=32", "width=32", "steps=1", "dtype=float32",
            "progress=false")
    with pytest.raises(ModelLoadError, match="point model.source at the local directory"):
        run(compose_cfg(*args, "prompts.limit=4"))
    fixed = (*args, "prompts.limit=6", f"model.source={tiny_model_path()}")
    assert run(compose_cfg(*fixed, "dry_run=true")).refused is None  # as the launch: not refused
    result = run(compose_cfg(*fixed))
    assert result.complete and result.ok == 6
    assert read_fingerprint(RunDir(tmp_path / "m3"))["model.source"] == str(tiny_model_path())


def test_a_launch_whose_run_was_started_over_while_it_loaded_is_refused(tmp_path, monkeypatch):
    from jobs.generate import run
    import shardgen.run.runner as runner

    args = (f"run_dir={tmp_path / 'r'}", "height=32", "width=32", "steps=1", "progress=false", "prompts.limit=2")
    real = runner.apply_strategy

    def load_while_another_launch_takes_over(cfg, world, dims):
        check_or_write_fingerprint(RunDir(tmp_path / "r"), fp("steps=2"))
        return real(cfg, world, dims)

    monkeypatch.setattr(runner, "apply_strategy", load_while_another_launch_takes_over)
    with pytest.raises(FingerprintMismatch, match="changed while this launch loaded its model"):
        run(compose_cfg(*args))
    assert not list((tmp_path / "r" / "shards").iterdir())


def test_appended_prompts_are_no_change_of_settings_for_a_launch_loading_its_model(tmp_path):
    from shardgen.dataio.resume.fingerprint import check_settings_unchanged, run_settings

    run = RunDir(tmp_path / "run")
    check_or_write_fingerprint(run, fp())
    run.plan_dir.mkdir()
    run.plan_json_path.write_text("{}")
    before = run_settings(run)
    atomic_write_json(run.fingerprint_path, fp() | {"prompts.sha256": "sha-of-more-prompts"})  # as an extension does
    check_settings_unchanged(run, before)  # the plan this launch holds still holds
    atomic_write_json(run.fingerprint_path, fp("steps=2") | {"prompts.sha256": "sha-of-more-prompts"})
    with pytest.raises(FingerprintMismatch, match="changed while this launch loaded its model"):
        check_settings_unchanged(run, before)


def test_following_the_advice_of_a_missing_prompt_field_ends_in_images(tmp_path):
    """A jsonl whose prompts are under "sentence" (no common caption name, so not taken by itself): the error names
    prompts.field=sentence; a launch with prompts.on_bad_row=skip rejects every row and makes no sample, so the same
    run_dir then takes prompts.field=sentence and makes the images."""
    from jobs.generate import run
    from shardgen.dataio.prompts.read import PromptFileError

    (tmp_path / "cap.jsonl").write_text('{"sentence": "a cat", "n": 1}\n{"sentence": "a dog", "n": 2}\n')
    args = (f"prompts.path={tmp_path / 'cap.jsonl'}", f"run_dir={tmp_path / 'r'}", "height=32", "width=32",
            "steps=1", "progress=false")
    with pytest.raises(PromptFileError, match=r"set prompts.field=<it>, e.g. prompts.field=sentence"):
        run(compose_cfg(*args))
    skipped = run(compose_cfg(*args, "prompts.on_bad_row=skip"))
    assert (skipped.ok, skipped.rejected) == (0, 2)
    fixed = run(compose_cfg(*args, "prompts.field=sentence"))
    assert (fixed.ok, fixed.rejected, fixed.complete) == (2, 0, True)
    changes = fingerprint_changes(RunDir(tmp_path / "r"))[-1]["changes"]
    assert changes["prompts.field"] == ["prompt", "sentence"]


def test_a_run_with_a_sample_or_an_upload_keeps_its_settings(tmp_path):
    """Rejected rows alone leave a run open to new settings; one made sample, or a shard uploaded and deleted
    locally (keep_local=false), fixes them."""
    run = RunDir(tmp_path / "run")
    check_or_write_fingerprint(run, fp("steps=4"))
    run.create()
    atomic_write_json(run.shard_stats(0), {"ok": 0, "failed": 0, "rejected": 4})
    assert check_or_write_fingerprint(run, fp("steps=5")) is True
    assert not run.shard_stats(0).exists()  # its rows are read again under the new settings
    atomic_write_json(run.shard_stats(0), {"ok": 1, "failed": 0, "rejected": 3})
    with pytest.raises(FingerprintMismatch, match="steps"):
        check_or_write_fingerprint(run, fp("steps=6"))
    run.shard_stats(0).unlink()
    run.uploads_dir.mkdir()
    run.shard_uploaded(0).write_text("{}")
    with pytest.raises(FingerprintMismatch, match="steps"):
        check_or_write_fingerprint(run, fp("steps=6"))


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs /proc to tell one process from another")
def test_a_marker_of_an_earlier_process_that_had_this_very_pid_does_not_hold_the_run(tmp_path):
    """A job run again in a fresh container numbers its processes from 1 again: its process may have the pid the
    killed launch had. The marker holds the launch's process identity, so it is known gone; this process's own
    marker, and a marker that is not a plain file (a FIFO: read without waiting), hold the run as before."""
    from shardgen.dataio.resume.fingerprint import holds_no_samples, run_settings, start_generating, stop_generating
    from shardgen.dataio.rundir.liveness import host_name, process_identity
    from shardgen.run.runner import prepare_run

    prepare_run(compose_cfg(f"run_dir={tmp_path / 'r'}", "height=32", "width=32", "prompts.limit=2", "steps=1"))
    r = RunDir(tmp_path / "r")
    r.work_dir.mkdir(parents=True, exist_ok=True)
    marker = r.work_dir / f"launch.{host_name()}.{os.getpid()}"
    boot, namespace, start = process_identity(os.getpid()).split(":")
    marker.write_text(f"{boot}:{namespace}:{int(start) - 1}")
    assert holds_no_samples(r)
    marker.unlink()
    mine = start_generating(r, run_settings(r))
    assert mine == marker and marker.read_text() == process_identity(os.getpid())
    assert not holds_no_samples(r)
    stop_generating(mine)
    os.mkfifo(r.work_dir / f"launch.{host_name()}.{os.getppid()}")
    assert not holds_no_samples(r)  # judged by its name alone: the parent process lives


def test_a_launch_killed_before_its_first_sample_leaves_the_run_open_to_new_settings(tmp_path):
    """A launch SIGKILLed while generating leaves its work/launch.<host>.<pid> marker: once its pid is gone the run
    (no sample made) takes another launch's settings, as if the marker were not there; a live launch's marker, or
    one of another host, still holds the run."""
    import subprocess
    import sys

    from jobs.generate import run
    from shardgen.dataio.resume.fingerprint import holds_no_samples
    from shardgen.dataio.rundir.liveness import host_name
    from shardgen.run.runner import prepare_run

    args = (f"run_dir={tmp_path / 'r'}", "height=32", "width=32", "progress=false", "prompts.limit=2")
    prepare_run(compose_cfg(*args, "steps=1"))  # the killed launch's plan and fingerprint
    r = RunDir(tmp_path / "r")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    r.work_dir.mkdir(parents=True, exist_ok=True)
    dead = r.work_dir / f"launch.{host_name()}.{int(gone.stdout)}"
    dead.touch()
    assert holds_no_samples(r)
    for held_by in (f"launch.{host_name()}.{os.getppid()}", f"launch.other-host.{int(gone.stdout)}"):
        (r.work_dir / held_by).touch()
        assert not holds_no_samples(r), held_by
        (r.work_dir / held_by).unlink()
    result = run(compose_cfg(*args, "steps=2"))
    assert result.complete and result.ok == 2
    assert read_fingerprint(r)["steps"] == 2
    assert not dead.exists()  # the launch that generated removed the gone launch's marker: work/ keeps nothing


@pytest.mark.parametrize("what", ["fifo", "link", "directory"])
def test_whatever_sits_at_this_launch_s_marker_name_neither_hangs_it_nor_ends_it_in_a_traceback(tmp_path, what):
    """A FIFO there (opened for writing it would block until someone reads), a link (never written through) are
    replaced by the marker; a directory is a one-line error naming it."""
    import threading

    from shardgen.dataio.resume.fingerprint import run_settings, start_generating, stop_generating
    from shardgen.dataio.rundir.liveness import host_name, process_identity
    from shardgen.dataio.rundir.storage import RunDirError

    r = RunDir(tmp_path / "r")
    r.create()
    r.work_dir.mkdir(exist_ok=True)
    marker = r.work_dir / f"launch.{host_name()}.{os.getpid()}"
    target = tmp_path / "elsewhere"
    {"fifo": lambda: os.mkfifo(marker), "link": lambda: marker.symlink_to(target),
     "directory": lambda: marker.mkdir()}[what]()
    out = []
    t = threading.Thread(target=lambda: out.append(_outcome(start_generating, r, run_settings(r))), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # let the thread go
        os.close(os.open(marker, os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail("start_generating waits on the FIFO at its marker's name")
    if what == "directory":
        assert isinstance(out[0], RunDirError) and str(marker) in str(out[0]) and "\n" not in str(out[0])
        return
    assert out[0] == marker and marker.is_file() and not marker.is_symlink() and not target.exists()
    assert marker.read_text() == process_identity(os.getpid())
    stop_generating(out[0])


def test_a_marker_naming_a_pid_no_process_can_have_is_a_dead_launch_not_a_traceback(tmp_path):
    from shardgen.dataio.resume.fingerprint import holds_no_samples, remove_dead_launch_markers
    from shardgen.dataio.rundir.liveness import host_name

    r = RunDir(tmp_path / "r")
    r.create()
    r.work_dir.mkdir(exist_ok=True)
    (r.work_dir / f"launch.{host_name()}.99999999999").write_bytes(b"")
    assert holds_no_samples(r)
    remove_dead_launch_markers(r)
    assert list(r.work_dir.iterdir()) == []


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # the test looks at what came out
        return e
