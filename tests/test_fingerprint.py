"""The run fingerprint, alone: what a resume may and may not change."""

from __future__ import annotations

import pytest

from shardgen.dataio.resume.fingerprint import (FingerprintMismatch, check_or_write_fingerprint, compute_fingerprint,
                                                diff_fingerprints)
from shardgen.dataio.rundir.layout import RunDir
from tests.conftest import compose_cfg


def fp(*overrides: str) -> dict:
    return compute_fingerprint(compose_cfg(*overrides), "sha-of-prompts")


def test_only_pixel_determining_settings_count():
    base = fp()
    for free in ("batch_size=2", "launcher=local", "strategy=tp", "tp_degree=2", "writer_threads=4", "lease_s=60",
                 "progress=false", "run_dir=elsewhere"):
        assert fp(free) == base, free
    for bound, key in (("seed=1", "seed"), ("steps=3", "steps"), ("height=32", "height"),
                       ("image_format=jpg", "image_format"), ("samples_per_shard=7", "samples_per_shard"),
                       ("model.max_sequence_length=64", "model.max_sequence_length"), ("fp8=true", "fp8")):
        assert [d.split(":")[0] for d in diff_fingerprints(base, fp(bound))] == [key], bound
    assert compute_fingerprint(compose_cfg(), "other-sha")["prompts.sha256"] == "other-sha"


def test_a_resume_with_other_settings_is_refused_naming_the_field(tmp_path):
    run = RunDir(tmp_path / "run")
    assert check_or_write_fingerprint(run, fp()) is False
    assert check_or_write_fingerprint(run, fp("batch_size=1")) is True
    with pytest.raises(FingerprintMismatch, match="steps: run has 4, this launch has 3"):
        check_or_write_fingerprint(run, fp("steps=3"))
    assert check_or_write_fingerprint(run, fp("steps=3"), allow_change=True) is True
