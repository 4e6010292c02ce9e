"""``cuda_graphs`` (on by default): on CUDA, a transformer that runs eagerly replays each call from a CUDA graph
instead of launching its kernels one by one from Python.

A denoising step of FLUX.1-dev's fused eager blocks launches ~1,500 kernels; the host's launch time leaves the GPU
idle between some of them. ``GraphedForward`` replaces the transformer's ``forward``: the first call of a shape (its
tensors' shapes, strides and dtypes and the other arguments' values) runs eagerly, which also warms up what runs
once (kernel autotuning, cuDNN plans); the second captures the call in a ``torch.cuda.CUDAGraph``; every later call
of that shape copies its tensors into the graph's input buffers and replays it. A replay runs the kernels the eager
call runs, on the same inputs, so its output is the eager call's to the bit.

Only where the call is the same every time for a shape: the family declares it (``ModelFamily.cuda_graphs``), the
blocks run eagerly (compiled blocks are inductor's), no First-Block-Cache (it decides on the host, per step), nothing
wraps the transformer's ``forward`` (accelerate's device placement), no per-row LoRA adapters (fusing a set may move
the adapted weights), one GPU per replica (resolved with the config: ``AccelOptions.from_cfg``). A shape beyond ``MAX_GRAPHS``, an argument that cannot be
part of a shape, or a capture that fails runs eagerly (the failure is logged once). Each graph keeps its own
memory pool: about one call's activations (~1 GiB for FLUX.1-dev at batch 4, 1024x1024).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from shardgen.pick import pick
from shardgen.speed.blocks import plain_forward
from shardgen.speed.handdown import family_of
from shardgen.speed.techniques import Step, Technique, register_technique

log = logging.getLogger("shardgen.accel")

MAX_GRAPHS = 3
"""Shapes captured per transformer (a run's full batches, its short batches, one row size more): each graph holds
a call's activations for good; other shapes run eagerly."""
MAX_SEEN = 64
"""Shapes remembered while waiting for their second call; past that, a new shape runs eagerly for good."""
HOST_VALUES = 64
"""The most values a host tensor argument of a device call may hold to be part of a graph's key (a batch's
per-sample lengths); a larger one runs eagerly."""


@dataclass(frozen=True)
class CudaGraphOptions:
    """The options this technique reads."""

    cuda_graphs: bool = True
    compile: bool = False
    first_block_cache: float = 0.0


def shape_key(args: tuple, kwargs: dict) -> tuple[Any, list[torch.Tensor]]:
    """``(key, tensors)``: what a graph of this call depends on (the arguments' structure, each tensor's shape,
    stride, dtype and device, every other argument's value) and the call's tensors in order. A host tensor beside
    device ones (per-sample lengths a kernel launch reads on the host) is keyed by its values too: a graph bakes
    them in. ``key`` is None when an argument cannot be part of it (an object other than a tensor, number, string
    or None, or a list, tuple or dict of them; a host tensor of more than HOST_VALUES values)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    on_device = any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu" for leaf in leaves)
    sig, tensors = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            sig.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device))
            if on_device and leaf.device.type == "cpu":
                if leaf.numel() > HOST_VALUES:
                    return None, []
                sig.append(tuple(leaf.flatten().tolist()))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            sig.append((type(leaf), leaf))
        else:
            return None, []
    return (spec, tuple(sig)), tensors


class CudaGraph:
    """One call captured by ``torch.cuda.CUDAGraph``: ``capture`` records ``fn()`` and returns its outputs (tensors
    the graph rewrites at each ``replay``)."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        # thread_local: the writer thread's CUDA calls (copies, event waits) do not break the capture
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _Captured:
    graph: Any
    inputs: list[torch.Tensor]
    outputs: Any


class GraphedForward:
    """A module's ``forward`` that replays a CUDA graph per call shape (see the module doc). ``make_graph``: the
    graph class (``CudaGraph``; a test passes one that runs on the CPU)."""

    def __init__(self, forward: Callable, make_graph: Callable[[], Any] | None = None, max_graphs: int = MAX_GRAPHS):
        self.forward = forward
        self.make_graph = make_graph or CudaGraph
        self.max_graphs = max_graphs
        self.graphs: dict[Any, _Captured] = {}
        self.seen: set = set()
        self.failed: str | None = None
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def __call__(self, *args, **kwargs):
        if self.failed is not None or torch.is_grad_enabled():
            return self._eager(args, kwargs)
        key, tensors = shape_key(args, kwargs)
        if key is None:
            return self._eager(args, kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen or len(self.graphs) >= self.max_graphs:
                if len(self.seen) < MAX_SEEN:
                    self.seen.add(key)
                return self._eager(args, kwargs)  # a shape's first call: also the capture's warm-up
            entry = self._capture(key, args, kwargs, tensors)
            if entry is None:
                return self._eager(args, kwargs)
        else:
            for static, new in zip(entry.inputs, tensors):
                static.copy_(new)
        entry.graph.replay()
        self.counts["replayed"] += 1
        # the graph rewrites its outputs at the next replay: the caller keeps copies (a latent's worth per call)
        return pytree.tree_map_only(torch.Tensor, torch.clone, entry.outputs)

    def _eager(self, args, kwargs):
        self.counts["eager"] += 1
        return self.forward(*args, **kwargs)

    def _capture(self, key, args, kwargs, tensors) -> _Captured | None:
        """The graph of this call, captured with copies of its tensors as the graph's inputs; None (and every later
        call eager) when the capture fails."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        inputs = [t.clone() for t in tensors]  # outside the graph's pool: they live as long as the graph
        it = iter(inputs)
        s_args, s_kwargs = pytree.tree_unflatten(
            [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
        graph = self.make_graph()
        try:
            outputs = graph.capture(lambda: self.forward(*s_args, **s_kwargs))
        except Exception as e:  # an operation a graph cannot hold (a host sync), or out of memory
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            self.graphs.clear()
            log.warning("cuda_graphs: capturing the transformer's call failed (%s); it runs eagerly from here "
                        "(cuda_graphs=false skips the attempt)", self.failed)
            return None
        entry = self.graphs[key] = _Captured(graph, inputs, outputs)
        self.counts["captured"] += 1
        log.info("cuda_graphs: captured the transformer's call for a new shape (%d of at most %d graphs)",
                 len(self.graphs), self.max_graphs)
        return entry


def graphed(transformer: Any) -> GraphedForward | None:
    """The transformer's ``GraphedForward``, when it has one."""
    f = getattr(transformer, "__dict__", {}).get("forward")
    return f if isinstance(f, GraphedForward) else None


def not_applicable(step: Step) -> str | None:
    """Why the transformer's calls are not graphed here (None: they are)."""
    opts = pick(CudaGraphOptions, step.opts)
    if not opts.cuda_graphs:
        return "cuda_graphs=false (or more than one GPU per replica)"
    if step.device is None or torch.device(step.device).type != "cuda":
        return "not on CUDA"
    if opts.compile:
        return "the blocks are compiled"
    if opts.first_block_cache > 0:
        return "First-Block-Cache decides on the host at every step"
    family = family_of(step.pipe)
    if family is None or not family.cuda_graphs:
        return f"{type(step.pipe).__name__}'s family does not declare its transformer call graphable"
    if getattr(step.pipe, "_shardgen_adapter_sets", None) is not None:
        return "rows switch LoRA adapter sets (fusing one may move the adapted weights)"
    if not plain_forward(step.transformer):
        return "a hook wraps the transformer's forward"
    return None


def release(step: Step) -> dict:
    """The transformer's own ``forward`` back (its graphs and their memory dropped)."""
    g = graphed(step.transformer)
    if g is None:
        return {}
    step.transformer.__dict__.pop("forward")
    return {"cuda_graphs_released": dict(g.counts)}


def apply(step: Step) -> dict:
    """Graph the transformer's calls where ``not_applicable`` finds nothing against it."""
    why = not_applicable(step)
    if why is not None:
        if pick(CudaGraphOptions, step.opts).cuda_graphs and step.device is not None \
                and torch.device(step.device).type == "cuda":
            log.info("cuda_graphs: not used (%s)", why)
        return {}
    step.transformer.forward = GraphedForward(step.transformer.forward)
    return {"cuda_graphs": True}


register_technique(Technique("cuda_graphs", 60, apply, release=release))
