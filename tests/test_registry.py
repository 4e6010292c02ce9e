"""The strategy door: a strategy is one class in one module, registered once; nothing else names it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from parallel import registry
from parallel.dims import ParallelConfigError, ParallelDims
from parallel.registry import Strategy

ROOT = Path(__file__).resolve().parents[1]
# the registry and the modules that define strategies name them; auto.py is the chooser
OWNERS = {"parallel/registry.py", "parallel/dp.py", "parallel/tp.py", "parallel/cp.py", "parallel/device_map.py",
          "parallel/fsdp.py", "parallel/auto.py"}


def test_no_strategy_name_is_compared_outside_its_module():
    names = "|".join(map(re.escape, registry.names()))
    literal = re.compile(rf"""(["'])({names})\1""")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("shardgen", "parallel", "jobs") for path in sorted((ROOT / folder).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in OWNERS
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert found == []


def test_every_strategy_has_its_yaml_and_the_registry_imports_no_torch():
    assert set(registry.names()) <= {p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml")}
    code = "import sys, parallel.registry, parallel.dims; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.fixture
def toy():
    """A strategy with a mesh dimension of its own, registered for the test only."""
    saved = dict(registry._REGISTRY)

    @registry.register
    class Toy(Strategy):
        name = "toy"
        splits_transformer = True

        def replica_dims(self, dims):
            return (("toy", dims.degree),)

        def check_degrees(self, dims):
            if dims.degree < 2:
                registry.fail("strategy=toy needs strategy.degree >= 2")

        def weights_bytes(self, transformer, others, dtype_bytes, dims):
            return (transformer // dims.degree + others) * dtype_bytes

    yield Toy
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_a_registered_strategy_is_chosen_checked_and_sized_through_its_class(toy):
    from parallel.memory import weights_per_process

    assert "toy" in registry.choices()
    d = ParallelDims(world_size=8, strategy="toy", degree=4, cfg=2)
    assert (d.dp, d.replica_size, d.replica_dims(), d.describe()) == (1, 8, (("cfg", 2), ("toy", 4)),
                                                                       "cfg_degree=2 strategy.degree=4")
    assert weights_per_process({"transformer": 400, "vae": 10}, 2, d) == 220
    with pytest.raises(ParallelConfigError, match="needs strategy.degree >= 2"):
        ParallelDims(world_size=2, strategy="toy")
    with pytest.raises(registry.ParallelConfigError, match=r"strategy=nope is not available; choose one of \["):
        ParallelDims(world_size=1, strategy="nope")


def test_a_name_is_registered_once():
    class Other(Strategy):
        name = registry.DEFAULT

    with pytest.raises(ValueError, match="registered twice"):
        registry.register(Other)


def test_capabilities_replace_name_checks():
    dims = {n: ParallelDims(world_size=4, strategy=n, **kw) for n, kw in (
        ("dp", {}), ("tp", dict(tp=2)), ("cp_ulysses", dict(ulysses=2)), ("device_map", {}))}
    assert [n for n, d in dims.items() if d.kind.one_gpu_per_replica] == ["dp"]
    assert [n for n, d in dims.items() if d.kind.splits_transformer] == ["tp"]
    assert [n for n, d in dims.items() if d.kind.context_parallel] == ["cp_ulysses"]
    assert [n for n, d in dims.items() if d.kind.spans_gpus_in_one_process] == ["device_map"]
    assert [n for n, d in dims.items() if d.tp_enabled or d.cp_enabled] == ["tp", "cp_ulysses"]
