"""Shared fixtures: composing configs like the command line does, and a tiny-model cache per session."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

# before torch loads its OpenMP runtime (it reads this once): idle OpenMP threads sleep instead of spinning. The suite
# runs two xdist workers, SLURM jobs and multi-rank tests on 2 cores at once; spinning threads of one process took the
# cores the others needed (measured: a test beside a busy process took 84 s with spinning threads, 44 s without).
# Child processes (ranks, jobs) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from hydra import compose, initialize_config_dir

from shardgen.config.store import register_configs
from shardgen.launch.local import RANK_IMPORTS
from tests.s3_server import bucket, s3  # noqa: F401 (fixtures: a real S3-compatible server, a fresh bucket)

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
register_configs()


def compose_cfg(*overrides: str):
    """The config ``python -m jobs.generate <overrides>`` would run with."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="generate", overrides=list(overrides))


@pytest.fixture(autouse=True)
def diffusers_attention_backend():
    """diffusers' ``set_attention_backend`` (strategy.attention_backend) also makes its backend the process's active
    one, which every model without a backend of its own then uses: a test that sets one would change the arithmetic
    of the tests after it in the same worker (the fused blocks' bit-identity tests among them). Restored after each
    test."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(before)


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory):
    """Build the tiny model once per test session, in a private cache (also seen by subprocesses)."""
    cache = tmp_path_factory.mktemp("shardgen-cache")
    old = os.environ.get("SHARDGEN_CACHE")
    os.environ["SHARDGEN_CACHE"] = str(cache)
    from shardgen.families.flux.tiny import tiny_model_path

    tiny_model_path(cache)
    yield cache
    if old is None:
        os.environ.pop("SHARDGEN_CACHE", None)
    else:
        os.environ["SHARDGEN_CACHE"] = old
    shutil.rmtree(cache, ignore_errors=True)


# tests that drive the SLURM cluster: one after another on one xdist worker (they share the cluster's two nodes and
# its queue, and mostly wait on it), started first: they are the suite's longest chain, and their waits overlap the
# CPU-bound tests on the other worker (`-n 2` in pyproject.toml's addopts; `-n 0` runs everything in one process)
CLUSTER_TEST_FILES = ("test_slurm.py", "test_multinode.py")
# the GPU tests share one device: one worker runs them in turn (two workers side by side each saw the other's
# models in GPU memory and failed the memory check; measured on an H200)
GPU_TEST_FILES = ("test_gpu.py",)
# the README's examples: one worker, so the quick start's run they all copy is made once
README_TEST_FILES = ("test_readme_examples.py",)
# the Ray tests share one local two-node cluster (a module fixture) that ends with `ray stop --force`, which stops
# every Ray process on the machine: spread over two workers, each would start a cluster of its own and the first to
# finish would stop the other's mid-test; one worker runs them in turn
RAY_TEST_FILES = ("test_ray.py",)


def _test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _on_the_cluster(nodeid: str) -> bool:
    return _test_file(nodeid) in CLUSTER_TEST_FILES


def pytest_collection_modifyitems(config, items):
    """The cluster tests first (a stable sort: everything else keeps its order)."""
    items.sort(key=lambda item: not _on_the_cluster(item.nodeid))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown (and unused) where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with five kinds of scope: all the cluster tests (one worker, in order), all the GPU
    tests (one worker, in order), all the README example tests (one worker), all the Ray tests (one worker, in
    order), and each other test alone (any worker). xdist's own ``--dist loadgroup`` would do it with a marker, but
    with pytest 9 it no longer groups (it renames ``item._nodeid``, which pytest 9 does not read: measured, the
    grouped tests ran on both workers)."""
    from xdist.scheduler import LoadScopeScheduling

    class ClusterScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if _on_the_cluster(nodeid):
                return "cluster"
            if _test_file(nodeid) in README_TEST_FILES:
                return "readme"
            if _test_file(nodeid) in RAY_TEST_FILES:
                return "ray"
            return "gpu" if _test_file(nodeid) in GPU_TEST_FILES else nodeid

    return ClusterScopeScheduling(config, log)


# what a rank started by start_ranks imports anyway: what a launcher=local rank imports (the product's forkserver
# list) and the tiny models' pipelines (about 15 s of CPU per process on a CI core). A launcher=local run in a pytest
# worker forks its ranks from this same forkserver (one per process), whichever of the two starts it
RANK_PRELOAD = [*RANK_IMPORTS, "diffusers.pipelines.flux.pipeline_flux",
                "diffusers.pipelines.flux.pipeline_flux_img2img", "diffusers.pipelines.flux.pipeline_flux_kontext",
                "diffusers.pipelines.wan.pipeline_wan"]


def _start_from_forkserver(start_processes, fn, args=(), nprocs=1, join=True, daemon=False, start_method=None):
    import multiprocessing

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    return start_processes(fn, args=args, nprocs=nprocs, join=join, daemon=daemon, start_method="forkserver")


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and wait for them (torch.multiprocessing.start_processes:
    a rank's exception is raised here as ProcessRaisedException).

    The processes are forked from a forkserver that imported RANK_PRELOAD once for this pytest worker, instead of
    each importing it again as spawned ones do: the suite starts a dozen such ranks. The forkserver is a fresh
    interpreter that never ran a torch op (no OpenMP threads to break in a fork), so each rank is still a clean
    process of its own, with its own gloo world. It keeps the environment it started with: ``fn`` sets what a rank
    needs (RANK, MASTER_PORT, ...) itself."""
    import torch.multiprocessing as mp

    _start_from_forkserver(mp.start_processes, fn, args, nprocs)


def rank_environment(rank: int, port: int, world_size: int = 2) -> None:
    """In a process start_ranks started: the environment a launcher gives rank ``rank`` of ``world_size`` on this
    machine (the gloo world's rendezvous on ``port``)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def join_gloo_world(rank: int, port: int, world_size: int = 2):
    """``rank_environment``, one CPU thread, the libraries quiet, then the gloo world (parallel.world.World)."""
    import torch

    from parallel import world as W
    from shardgen.run.runner import quiet_libraries

    rank_environment(rank, port, world_size)
    torch.set_num_threads(1)
    quiet_libraries()
    return W.init_world("cpu")


def start_process(fn, args: tuple):
    """A started ``multiprocessing.Process`` running ``fn(*args)``, forked from start_ranks' forkserver: a job a test
    kills (SIGKILL) mid-run without paying a new interpreter's imports. Its environment is the forkserver's."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    p = multiprocessing.get_context("forkserver").Process(target=fn, args=args)
    p.start()
    return p


def _run_module(module: str, args: list[str], env: dict, cwd: str, log: str, err: str, hooks: list[str],
                new_session: bool) -> None:
    """In a process start_module started: ``python -m MODULE ARGS`` as a new interpreter would run it, with ``env``
    as its whole environment, its stdout appended to ``log`` and its stderr to ``err``, each folder of ``hooks``
    put first on its path and its ``sitecustomize.py`` run first (as ``site`` runs it in a new interpreter), and
    the atexit handlers run at the end (multiprocessing leaves through os._exit, which skips them)."""
    import atexit
    import runpy
    import sys

    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, log), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    for hook in reversed(hooks):
        sys.path.insert(0, hook)
        runpy.run_path(str(Path(hook) / "sitecustomize.py"), run_name="sitecustomize")
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()


class Forked:
    """A command start_module started, as ``subprocess.Popen`` shows one: ``pid``, ``poll``, ``wait``, ``kill``,
    ``send_signal``, ``returncode`` (minus the signal's number when a signal ended it), and ``output`` and
    ``errors``, what it printed."""

    def __init__(self, process, log: Path, err: Path, args: list[str], new_session: bool = False):
        self.process, self.log, self.err, self.args, self.new_session = process, log, err, args, new_session

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    @property
    def output(self) -> str:
        """What it printed (stdout and stderr, where they go to one log; else stdout)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def errors(self) -> str:
        """What it printed on stderr."""
        return self.err.read_text(errors="replace") if self.err.exists() else ""


def start_module(module: str, args: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT,
                 hooks: list[Path] = (), new_session: bool = False, stderr: Path | None = None) -> Forked:
    """``python -m MODULE ARGS`` (stdout and stderr into ``log``; ``stderr``: stderr there) forked from start_ranks'
    forkserver instead of a new interpreter: the same command line, environment (``env``, by default this
    process's) and exit status, less the new interpreter's imports (about 10 s of CPU on a CI core). ``hooks``:
    folders whose ``sitecustomize.py`` runs first, as on a new interpreter's PYTHONPATH. ``new_session``: as Popen's
    ``start_new_session``, a process group of its own that ``os.killpg(pid, ...)`` ends whole. For the tests that
    start a job again and again, or kill it: what only a new interpreter shows (the import graph, the wheel,
    torchrun) keeps subprocess."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    env = dict(os.environ if env is None else env)
    err = Path(stderr or log)
    for path in {Path(log), err}:
        path.touch()  # there at once, as a log the caller opened for Popen: a test reads it while the job starts
    p = multiprocessing.get_context("forkserver").Process(target=_run_module, args=(
        module, list(args), env, str(cwd), str(log), str(err), [str(h) for h in hooks], new_session))
    p.start()
    _FORKED.append(Forked(p, Path(log), err, [module, *args], new_session))
    return _FORKED[-1]


_FORKED: list[Forked] = []  # started by this test: ended after it


@pytest.fixture(autouse=True)
def _forked_commands_end_with_their_test():
    """Every command start_module started and a test left running (it failed, or let it be) is killed (its process
    group, where it has one) after the test: multiprocessing waits for its children when the worker exits, so one
    left running would hang the worker, where a subprocess would only be orphaned."""
    import signal

    yield
    while _FORKED:
        p = _FORKED.pop()
        if p.poll() is None:
            if p.new_session:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.kill()
        p.process.join(30)


def write_lines(path: Path, lines: list[str]) -> Path:
    """A txt prompt file."""
    path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    return path
