"""On a CUDA GPU: the real FLUX.1-dev architecture (dummy weights) through the whole job, per strategy
that fits one GPU. Skipped, saying why, without CUDA."""

from __future__ import annotations

import pytest
import torch

from dataio.plan import load_plan
from dataio.rundir import RunDir
from dataio.verify import verify_run
from jobs.generate import run
from tests.conftest import compose_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SMALL = ("model=flux_dev", "model.weights=dummy", "height=256", "width=256", "steps=2", "prompts.limit=4",
         "batch_size=2", "progress=false")


@pytest.mark.parametrize("strategy", [("strategy=dp",), ("strategy=device_map", "strategy.gpus_per_replica=1"),
                                      ("strategy=auto",)])
def test_flux_dev_dummy_runs_on_one_gpu(tmp_path, strategy):
    r = run(compose_cfg(f"run_dir={tmp_path / 'run'}", *SMALL, *strategy))
    assert (r.ok, r.failed, r.complete) == (4, 0, True)
    rep = verify_run(load_plan(RunDir(tmp_path / "run")))
    assert rep.ok, rep.defects
