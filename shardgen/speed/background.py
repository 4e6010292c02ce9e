"""Compiling on a background thread while the first batches run eagerly (``compile: auto``).

Compiling the repeated blocks costs 40-55 s on an H200 from a fresh cache and 10-17 s from a warm one,
paid by the first compiled batch: a short job (a few dozen prompts, a requeued job near its end) loses
more than compiling saves, and even a long one waits before its first image. Here nobody waits:

1. ``compile_blocks(..., background=True)`` gives each repeated block a ``DeferredForward``: the block's
   own (eager) forward, plus the ``torch.compile`` wrapper it will use later, not yet called.
2. The first batch runs eagerly; each block class leaves the arguments of its first call of each distinct
   signature (shapes, strides, dtypes: what dynamo's guards check; a block whose first call gets other
   strides than the next ones would compile another graph on the main thread), as the compiled blocks will
   pass them (a forward's ``compiled_args``: FLUX.1's compiled single blocks hand on contiguous halves where
   the eager ones hand on views).
3. ``BackgroundCompile.start`` calls each class's compiled wrapper once, on those arguments, on a thread
   of its own: dynamo traces, inductor generates code (its compile workers are processes), the graph
   runs once. Meanwhile the main thread keeps generating eagerly: the GPU stays busy. When the decision
   is taken before the first batch (``start_when_captured``), the thread starts at the second denoising
   step, when the first step has left every signature.
   Python's switch interval is lowered while the thread runs: every torch op of the main thread releases
   the GIL and must take it back, and at the default 5 ms each op could wait that long behind the
   tracer (H200, Qwen-Image: eager batches 22-40% slower during the compilation at 5 ms).
4. Between two batches (never inside one) ``switch`` turns every block to its compiled wrapper. dynamo
   keeps compiled code on the forward's code object, shared by every wrapper made with the same options
   (``torch.compile``'s backend objects compare equal), and its eval-frame callback is per thread, so
   the main thread's first compiled call finds the graph the background thread made: no compilation
   on the main thread.

What differs from compiling on the main thread: a batch's pixels may come from the eager or the compiled
blocks depending on when the compilation ended (they differ by bf16 rounding noise, as compiled and eager
always do); the attention kernel the graph uses is the one the main thread had chosen when it left its
arguments (SDPA's choice is global state, read when the graph is traced).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable

import torch

log = logging.getLogger("shardgen.compile")

STATE_ATTR = "_shardgen_background"
SWITCH_INTERVAL_S = 1e-4  # while compiling: the main thread's ops wait at most this long for the GIL


def _sdpa_now() -> Any:
    """The SDPA kernels enabled now, in priority order (None where this torch cannot say)."""
    try:
        from torch.nn.attention import _cur_sdpa_kernel_backends  # torch's own reader of its sdpa_kernel state
    except ImportError:
        return None
    try:
        return _cur_sdpa_kernel_backends(with_priority=True)
    except TypeError:  # a torch without priorities
        return _cur_sdpa_kernel_backends()


def _sdpa_as(backends: Any):
    """A context restoring the SDPA kernels ``_sdpa_now`` read (a no-op where it read none)."""
    import contextlib

    if not backends:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    try:
        return sdpa_kernel(list(backends), set_priority=True)
    except TypeError:
        return sdpa_kernel(list(backends))


class BackgroundCompile:
    """One transformer's deferred compilation: the captured arguments, the thread, the switch."""

    def __init__(self) -> None:
        self.forwards: list[DeferredForward] = []
        self.captured: dict[tuple, tuple[DeferredForward, tuple, dict, Any]] = {}  # (class, signature) -> call
        self.first: DeferredForward | None = None  # the first block called: its next call starts the next step
        self.capturing = True
        self.step_seen = False      # a whole transformer call ran through the blocks (the first was called again)
        self.wanted = False         # start as soon as every block class has left its arguments
        self.ready = False          # the blocks call their compiled wrappers (set by ``switch``, between batches)
        self.done = threading.Event()  # the background thread ended (compiled, or failed: see ``error``)
        self.error: str | None = None
        self.seconds: float | None = None  # the background thread's wall time, compiled
        self._thread: threading.Thread | None = None

    # --- the main thread's side ------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> bool:
        """Compile on a background thread from the captured arguments; False (nothing started) when the
        blocks have not run yet (no arguments) or it already started."""
        self.capturing = False
        if self.started or not self.captured:
            return False
        self._thread = threading.Thread(target=self._run, name="shardgen-compile", daemon=True)
        self._thread.start()
        return True

    def start_when_captured(self) -> bool:
        """Start now if a whole denoising step has left its arguments, else when the next step begins;
        True when it started now."""
        self.wanted = True
        return self.step_seen and self.start()


    def switch(self) -> bool:
        """Turn the blocks to their compiled wrappers if the background compilation succeeded; True when
        this call switched. Call between batches only: a batch then runs eager or compiled, never mixed."""
        if self.ready or not self.done.is_set() or self.error is not None:
            return False
        self.ready = True
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background thread (the end of the job: a thread must not outlive the process's work
        inside inductor); True when it has ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def abandon(self) -> None:
        """Stop capturing and let the captured activations go (compilation not wanted after all)."""
        self.capturing = False
        if not self.started:
            self.captured.clear()

    # --- the background thread -------------------------------------------------------------------------

    def _run(self) -> None:
        t0 = time.perf_counter()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
        try:
            for forward, args, kwargs, sdpa in list(self.captured.values()):
                device = _device_of(args, kwargs)
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)  # the current device is per thread
                # grad mode is per thread too: the pipeline runs under no_grad, and the guards check it
                with torch.no_grad(), _sdpa_as(sdpa):
                    forward.compiled(*args, **kwargs)
                if device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
            self.seconds = time.perf_counter() - t0
        except Exception as e:  # a compiler failure: the blocks stay eager, the job goes on
            self.error = f"{type(e).__name__}: {e}"
            log.warning("background compilation failed after %.0f s (%s); the blocks stay eager",
                        time.perf_counter() - t0, self.error[:500])
        finally:
            sys.setswitchinterval(interval)
            self.captured.clear()  # the activations held for tracing
            self.done.set()


class DeferredForward:
    """A repeated block's forward while its compiled graph is prepared on another thread: eager until
    ``state.ready``, then the compiled wrapper. The first call of each block class leaves its arguments
    (tensors by reference: the graph is traced on their shapes, dtypes and devices) for the thread."""

    def __init__(self, block: torch.nn.Module, eager: Callable, compiled: Callable, state: BackgroundCompile):
        self.block_type = type(block)
        self.eager = eager
        # what the compiled blocks pass each other, where it differs from the eager ones' (strides): the thread
        # must trace on those, or it compiles a graph the compiled chain never calls
        self.compiled_args = getattr(getattr(eager, "__func__", eager), "compiled_args", None)
        self.compiled = compiled
        self.state = state
        state.forwards.append(self)

    def __call__(self, *args, **kwargs):
        st = self.state
        if st.ready:
            return self.compiled(*args, **kwargs)
        if st.capturing:
            if st.first is None:
                st.first = self
            elif st.first is self:  # the next denoising step begins: the first one left every signature
                st.step_seen = True
                if st.wanted:
                    st.start()
            traced = self.compiled_args(args, kwargs) if self.compiled_args else (args, kwargs)
            key = (self.block_type, signature(traced))
            if st.capturing and key not in st.captured:
                st.captured[key] = (self, *traced, _sdpa_now())
        return self.eager(*args, **kwargs)


def signature(value: Any) -> Any:
    """What dynamo's guards see of an argument: tensors by shape, stride, dtype and device; containers
    element by element; plain values by value; anything else by type."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return tuple(signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, signature(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def state_of(transformer: Any, create: bool = False) -> BackgroundCompile | None:
    """The transformer's background compilation (None when its blocks are not compiled in the background);
    ``create``: make it now (before the blocks are prepared, so a decision can be attached to it)."""
    d = getattr(transformer, "__dict__", None)
    if d is None:
        return None
    if create and STATE_ATTR not in d:
        d[STATE_ATTR] = BackgroundCompile()
    return d.get(STATE_ATTR)
