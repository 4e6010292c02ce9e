"""Launchers: where the ranks of a job come from (this process, torchrun, local spawn, SLURM)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from shardgen.dataio.rundir.liveness import pid_alive, process_identity
from shardgen.errors import UserError, is_user_error
from shardgen.launch.ranks import child_config, setup_rank_logging

# A rank's user error reaches the parent inside a traceback string (torch.multiprocessing): its whole message
# travels as one JSON string after this mark, so the parent can print it whole (it may span several lines).
USER_ERROR_MARK = "shardgen-user-error:"

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig


def free_port() -> int:
    """A free TCP port on this host for the rendezvous of locally spawned ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a rank imports before its first batch, besides its model's pipeline module: the forkserver the ranks are
# forked from imports it once per launch, instead of each spawned rank importing it again (8-15 s of CPU a rank).
RANK_IMPORTS = ("torch", "torch.distributed", "diffusers", "transformers", "hydra", "shardgen.launch.local",
                "shardgen.run.runner", "shardgen.models.loader", "parallel.strategies", "parallel.world")


class ParentStdio:
    """This process's stdout and stderr as they are at launch, sent to a rank forked from the forkserver (which
    keeps the descriptors it was started with, e.g. a terminal a caller has redirected since)."""

    def __reduce__(self):
        from multiprocessing import reduction

        # a stream Python found closed at start (a job started with >&-) is None: its descriptor may since have
        # been reused by a file or pipe, which the rank must not write to
        return _ParentStdioFds, tuple(None if stream is None else reduction.DupFd(fd)
                                      for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)))


class _ParentStdioFds:
    def __init__(self, out, err) -> None:
        self.out, self.err = out, err

    def install(self) -> None:
        """Point this process's stdout and stderr at the parent's (at the null device where it had none)."""
        for wrapped, fd in ((self.out, 1), (self.err, 2)):
            received = wrapped.detach() if wrapped is not None else os.open(os.devnull, os.O_WRONLY)
            os.dup2(received, fd)
            os.close(received)


def adopt_parent(parent: tuple) -> None:
    """In a rank start_ranks forked from the forkserver (``parent``: the two arguments it appended), take the
    launching process's environment and standard streams as they were at launch, not at the forkserver's start."""
    if parent:
        environ, stdio = parent
        os.environ.clear()
        os.environ.update(environ)
        stdio.install()


LAUNCHER_POLL_S = 1.0
"""How often a spawned rank checks that the process that launched it is still there (``watch_launcher``)."""


def watch_launcher(pid: int, poll_s: float = LAUNCHER_POLL_S) -> threading.Thread:
    """In a spawned rank: a daemon thread that ends this rank with SIGTERM once the process that launched it is gone.
    A launcher killed with SIGKILL cannot pass a signal on, and its ranks (the forkserver's children on CPU, its own
    on GPUs: either way nothing ends them with it) would otherwise go on writing the run unwatched; so each drops its
    batch in flight and gives up its claims, as after Ctrl-C, and the same command resumes the run."""
    launcher = process_identity(pid)  # the launcher itself, not a later process given its pid

    def watch() -> None:
        while pid_alive(pid, launcher):
            time.sleep(poll_s)
        logging.getLogger("shardgen").warning("the launching process (pid %d) is gone: this rank stops; re-run the "
                                              "same command to continue", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    from shardgen.run.stopping import note_launcher

    note_launcher(pid, launcher)
    thread = threading.Thread(target=watch, name="shardgen-launcher-watch", daemon=True)
    thread.start()
    return thread


def _local_rank_main(local_rank: int, cfg_yaml: str, nprocs: int, port: int, log_level: int, launcher: int,
                     *parent) -> None:
    adopt_parent(parent)
    setup_rank_logging(local_rank, log_level)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from shardgen.run.runner import run_rank
    from shardgen.run.stopping import stop_on_sigterm

    debug = os.environ.get("SHARDGEN_DEBUG", "") not in ("", "0")
    stop_on_sigterm()  # the parent, stopped by SIGTERM, ends its ranks with SIGTERM: each drops its batch in flight
    watch_launcher(launcher)  # the parent killed outright (SIGKILL) ends them too
    try:
        run_rank(OmegaConf.create(cfg_yaml))
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the parent says how to resume, the ranks stay quiet
        if debug:
            raise
        raise SystemExit(130) from None
    except Exception as e:
        if is_user_error(e) and not debug:
            raise RuntimeError(USER_ERROR_MARK + json.dumps(str(e))) from None
        raise


def rank_error_message(text: str) -> str:
    """The error a spawned rank raised, from the traceback text the parent receives: a user error's whole
    message, else the traceback's last line."""
    if m := re.search(re.escape(USER_ERROR_MARK) + r'(".*")\s*$', text, re.M):
        return json.loads(m.group(1))
    return text.strip().splitlines()[-1]


def start_local(cfg: GenerateConfig) -> None:
    """``launcher=local``: start the ranks, unless torchrun (or the like) already started this process as one."""
    if launched_by_torchrun():
        from shardgen.run.runner import run_rank

        return run_rank(cfg)
    return launch_local(cfg)


def launch_local(cfg: GenerateConfig, nprocs: int | None = None, said: bool = False) -> None:
    """Start ``nprocs`` (default ``launcher.nprocs``) ranks on this machine running the same code (the debug mode).
    What can be refused (degrees, the prompt file, a changed fingerprint) is refused here, once, before any rank
    starts, and a complete run starts none. ``said``: log that they are started here (a plain command whose strategy
    takes several ranks)."""
    import torch.multiprocessing as mp

    from parallel.strategies import parallel_dims
    from shardgen.run.runner import nothing_to_do, prepare_run, say_nothing_to_do

    nprocs = nprocs or cfg.launcher.nprocs
    dims = parallel_dims(cfg, nprocs)  # impossible degrees fail here, before any rank is spawned
    plan = prepare_run(cfg, dims.dp, save_config=False)  # rank 0 prepares again (cheap) and records the config
    if nothing_to_do(cfg, plan):
        say_nothing_to_do(plan)
        return
    if said:
        shape = " x ".join(f"{name} {degree}" for name, degree in dims.replica_dims())
        logging.getLogger("shardgen").info(
            "one replica of %s takes %d ranks: starting them on this machine (as launcher=local launcher.nprocs=%d "
            "does; launcher.nprocs=%d would run 2 replicas)", shape, nprocs, nprocs, 2 * nprocs)
    try:
        args = (child_config(cfg), nprocs, free_port(), logging.getLogger("shardgen").getEffectiveLevel(), os.getpid())
        _join_ranks(start_ranks(_local_rank_main, args, nprocs, rank_imports(cfg) if _on_cpu(cfg) else None))
    except mp.ProcessRaisedException as e:
        raise LocalRankError(rank_error_message(str(e))) from None
    except mp.ProcessExitedException as e:
        from shardgen.run.watchdog import STALL_EXIT_CODE

        raise LocalRankError(rank_exit_message(e.exit_code, STALL_EXIT_CODE, cfg.lease_s)) from None


def _on_cpu(cfg: GenerateConfig) -> bool:
    """Whether the ranks run on the CPU. On a GPU machine they are spawned instead of forked: torch refuses CUDA
    in a process forked from one where CUDA was initialized (which an import may do), and such machines have the
    cores to import in every rank at once."""
    import torch

    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


def start_ranks(fn, args: tuple, nprocs: int, imports: list[str] | None):
    """Start ``fn(rank, *args)`` in ``nprocs`` processes (torch.multiprocessing's ProcessContext, not joined).

    With ``imports`` and where the platform has a forkserver, the ranks are forked from it after it has imported
    ``imports`` once, and ``fn`` receives the environment and standard streams of this process as two more
    arguments (the forkserver keeps those it started with); else they are spawned, each importing what it needs."""
    import multiprocessing

    import torch.multiprocessing as mp

    if imports is None or "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn", join=False)
    multiprocessing.set_forkserver_preload(imports)  # no effect on a forkserver already running
    return mp.start_processes(fn, args=(*args, dict(os.environ), ParentStdio()), nprocs=nprocs,
                              start_method="forkserver", join=False)


def rank_imports(cfg: GenerateConfig) -> list[str]:
    """The modules a rank of this job imports before its first batch: RANK_IMPORTS and the model's pipeline."""
    from shardgen.models.loader import pipeline_module

    return [*RANK_IMPORTS, *filter(None, [pipeline_module(cfg.model.pipeline)])]


def _join_ranks(ranks) -> None:
    """Wait for the spawned ranks. Interrupted here (SIGTERM to this process alone, or Ctrl-C), each rank still
    running gets SIGTERM and is waited for: it drops its batch in flight and exits, and the run is left as a
    Ctrl-C in the terminal leaves it (spawned ranks are not daemons: the interpreter would otherwise wait for them
    to finish the whole run before exiting)."""
    try:
        while not ranks.join():
            pass
    except KeyboardInterrupt:
        for p in ranks.processes:
            if p.is_alive():
                p.terminate()
        for p in ranks.processes:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        raise


def rank_exit_message(code: int, stall_code: int, lease_s: float) -> str:
    """Why a spawned rank ended without an error of its own, and what to do: a stall, or the signal that killed
    it (SIGKILL is most often the kernel's out-of-memory killer)."""
    if code == stall_code:
        return (f"a rank exited with code {code} (it stalled: stall_timeout_s; its log above says where); re-run "
                "the same command to continue")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = (" (the kernel's out-of-memory killer sends it: `dmesg` or `journalctl -k` says whether it did; fewer "
               "ranks, smaller batch_size or a smaller size need less memory)") if -code == signal.SIGKILL else ""
        return (f"a rank was killed by {name}{oom}; re-run the same command to continue (its unfinished shards are "
                f"taken over once their claims' lease_s={lease_s:g} s has passed)")
    return f"a rank exited with code {code}; re-run the same command to continue"


class LocalRankError(UserError, RuntimeError):
    """A locally spawned rank failed."""


def launched_by_torchrun() -> bool:
    """True under torchrun (or any launcher that sets the torch.distributed environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
