"""``cuda_graphs``: a transformer's eager calls replayed from one graph per call shape (shardgen/speed/cuda_graphs.py).

On the CPU the graph is ``RunAgain``, which stands in for ``torch.cuda.CUDAGraph`` the way a replay behaves: it
computes from the captured input buffers and rewrites the captured outputs in place, so a wrapper that forgot to
copy a call's inputs in, or handed out the graph's own outputs, returns wrong values here too. The real graphs are
walked by tests/test_gpu.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils import _pytree as pytree

from shardgen.speed import cuda_graphs
from shardgen.speed.cuda_graphs import GraphedForward, shape_key
from shardgen.speed.techniques import AccelOptions, Step
from tests.conftest import compose_cfg
from tests.test_generate import shard_images


class RunAgain:
    """A CPU stand-in for a CUDA graph: ``replay`` reruns the captured call and writes into its first outputs."""

    made: list["RunAgain"] = []

    def __init__(self):
        self.replays = 0
        RunAgain.made.append(self)

    def capture(self, fn):
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self):
        self.replays += 1
        for old, new in zip(pytree.tree_leaves(self.outputs), pytree.tree_leaves(self.fn())):
            old.copy_(new)


class Refuses:
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # as diffusers' pipelines call their transformer
        yield


def toy_forward(x, scale=None, *, shift, return_dict=False):
    out = x * 2 + shift if scale is None else x * scale + shift
    return (out,) if not return_dict else {"sample": out}


def test_every_call_returns_the_eager_value_and_the_second_call_of_a_shape_captures_it():
    g = GraphedForward(toy_forward, RunAgain)
    xs = [torch.randn(2, 3) for _ in range(4)]
    outs = [g(x, shift=torch.full((3,), float(i)))[0] for i, x in enumerate(xs)]
    for i, (x, out) in enumerate(zip(xs, outs)):  # each call's own inputs, and earlier results not overwritten
        assert torch.equal(out, x * 2 + i)
    assert g.counts == {"eager": 1, "captured": 1, "replayed": 3}


def test_a_new_shape_or_argument_value_gets_its_own_graph_up_to_the_limit():
    g = GraphedForward(toy_forward, RunAgain, max_graphs=2)
    calls = [(torch.ones(2, 3), None), (torch.ones(4, 3), None), (torch.ones(2, 3), 3.0)]
    for _ in range(3):
        for x, scale in calls:
            out = g(x, scale, shift=torch.zeros(3))[0]
            assert torch.equal(out, x * (2 if scale is None else scale))
    assert len(g.graphs) == 2  # the third key stays eager
    assert g.counts == {"eager": 3 + 2, "captured": 2, "replayed": 4}


def test_a_structured_output_comes_back_as_a_copy():
    g = GraphedForward(toy_forward, RunAgain)
    first = [g(torch.ones(2), shift=torch.zeros(2), return_dict=True) for _ in range(2)][1]
    g(torch.full((2,), 5.0), shift=torch.zeros(2), return_dict=True)
    assert isinstance(first, dict) and torch.equal(first["sample"], torch.full((2,), 2.0))


def test_a_capture_that_fails_is_logged_once_and_every_call_runs_eagerly(caplog):
    g = GraphedForward(toy_forward, Refuses)
    with caplog.at_level(logging.WARNING, logger="shardgen.accel"):
        outs = [g(torch.full((2,), float(i)), shift=torch.zeros(2))[0] for i in range(4)]
    assert [o.tolist() for o in outs] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]
    assert g.counts["eager"] == 4 and not g.graphs
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["cuda_graphs: capturing the transformer's call failed (RuntimeError: operation not permitted "
                      "when stream is capturing); it runs eagerly from here (cuda_graphs=false skips the attempt)"]


def test_an_argument_that_is_no_shape_runs_eagerly():
    assert shape_key((torch.ones(1),), {"generator": torch.Generator()}) == (None, [])
    g = GraphedForward(lambda x, obj: (x + 1,), RunAgain)
    for _ in range(3):
        assert torch.equal(g(torch.zeros(1), object())[0], torch.ones(1))
    assert g.counts == {"eager": 3, "captured": 0, "replayed": 0}


def test_calls_with_gradients_run_eagerly():
    g = GraphedForward(toy_forward, RunAgain)
    with torch.enable_grad():
        for _ in range(3):
            g(torch.ones(2), shift=torch.zeros(2))
    assert g.counts["eager"] == 3


def _step(pipe, device="cuda", **opts):
    return Step(pipe, pipe.transformer, torch.device(device), AccelOptions(), AccelOptions(**opts))


def _flux_like():
    from diffusers import FluxPipeline

    class Pipe(FluxPipeline):
        def __init__(self):  # no components: only its class and transformer matter here
            self.transformer = torch.nn.Linear(2, 2)

    return Pipe()


def test_where_the_transformer_calls_are_graphed_and_why_not():
    pipe = _flux_like()
    assert cuda_graphs.not_applicable(_step(pipe)) is None
    why = {name: cuda_graphs.not_applicable(step) for name, step in {
        "off": _step(pipe, cuda_graphs=False), "cpu": _step(pipe, "cpu"), "compiled": _step(pipe, compile=True),
        "fbc": _step(pipe, first_block_cache=0.1),
        "family": Step(SimpleNamespace(transformer=pipe.transformer), pipe.transformer, torch.device("cuda"),
                       AccelOptions(), AccelOptions())}.items()}
    assert why == {"off": "cuda_graphs=false (or more than one GPU per replica)", "cpu": "not on CUDA",
                   "compiled": "the blocks are compiled",
                   "fbc": "First-Block-Cache decides on the host at every step",
                   "family": "SimpleNamespace's family does not declare its transformer call graphable"}
    pipe._shardgen_adapter_sets = object()
    assert cuda_graphs.not_applicable(_step(pipe)).startswith("rows switch LoRA adapter sets")
    del pipe._shardgen_adapter_sets
    handle = pipe.transformer.register_forward_hook(lambda *a: None)  # a hook on __call__ leaves forward plain
    assert cuda_graphs.not_applicable(_step(pipe)) is None
    handle.remove()
    pipe.transformer.forward = lambda x: x  # what accelerate's hooks do
    assert cuda_graphs.not_applicable(_step(pipe)) == "a hook wraps the transformer's forward"


def test_apply_wraps_the_forward_and_release_gives_it_back():
    pipe = _flux_like()
    assert cuda_graphs.apply(_step(pipe)) == {"cuda_graphs": True}
    assert isinstance(pipe.transformer.forward, GraphedForward)
    assert cuda_graphs.release(_step(pipe)) == {"cuda_graphs_released": {"eager": 0, "captured": 0, "replayed": 0}}
    assert "forward" not in pipe.transformer.__dict__ and cuda_graphs.release(_step(pipe)) == {}


def test_more_than_one_gpu_per_replica_turns_it_off():
    cfg = compose_cfg("cuda_graphs=true")
    assert AccelOptions.from_cfg(cfg, True).cuda_graphs and not AccelOptions.from_cfg(cfg, False).cuda_graphs
    assert not AccelOptions.from_cfg(compose_cfg("cuda_graphs=false"), True).cuda_graphs


SMALL = ("height=32", "width=32", "steps=3", "prompts.limit=5", "samples_per_shard=5", "batch_size=2",
         "progress=false")


def test_a_job_with_graphed_calls_writes_the_bytes_of_one_without(tmp_path, monkeypatch):
    """The tiny FLUX.1 job through the real pipeline: the wrapper sees diffusers' own call arguments; batches of 2,
    2 and 1 (a short last batch: a shape of its own)."""
    from jobs.generate import run

    run(compose_cfg(f"run_dir={tmp_path / 'plain'}", "cuda_graphs=false", *SMALL))
    monkeypatch.setattr(cuda_graphs, "CudaGraph", RunAgain)
    monkeypatch.setattr(cuda_graphs, "not_applicable", lambda step: None if step.opts.cuda_graphs else "off")
    RunAgain.made = []
    run(compose_cfg(f"run_dir={tmp_path / 'graphed'}", *SMALL))
    plain, graphed = shard_images(tmp_path / "plain"), shard_images(tmp_path / "graphed")
    assert len(plain) == 5 and graphed == plain
    # batch 1: eager, capture + replay, replay; batch 2: 3 replays; the short batch: eager, capture + replay, replay
    assert [g.replays for g in RunAgain.made] == [5, 2]


def test_a_host_tensor_beside_device_ones_is_keyed_by_its_values():
    """Per-sample lengths held on the host are baked into a graph's kernel launches: a call with other lengths is
    another graph, not a replay of the first one's."""
    device = torch.empty(2, 4, device="meta")  # any device other than the host's
    one, _ = shape_key((device,), {"lengths": torch.tensor([3, 4])})
    other, _ = shape_key((device,), {"lengths": torch.tensor([4, 4])})
    assert one is not None and other is not None and one != other
    assert shape_key((device,), {"lengths": torch.tensor([3, 4])})[0] == one
    assert shape_key((device,), {"lengths": torch.arange(65)}) == (None, [])  # too many to key: eager
    # on the host alone (the CPU tests' graphs) a tensor is keyed by its shape
    assert shape_key((torch.ones(2),), {})[0] == shape_key((torch.zeros(2),), {})[0]
