"""``shardgen COMMAND [ARGS...]``: one console entry point beside ``python -m jobs.COMMAND``, running the same
program with the same arguments (``shardgen status runs/default`` is ``python -m jobs.status runs/default``)."""

from __future__ import annotations

import atexit
import difflib
import os
import runpy
import sys
import threading
from pathlib import Path
from typing import Callable, NoReturn

COMMANDS = {
    "generate": ("jobs.generate", "generate a run's samples (Hydra overrides: key=value group=option)"),
    "status": ("jobs.status", "progress, rate, ETA, claims, last error (--json, --prometheus)"),
    "verify": ("jobs.verify", "every prompt index exactly once, every tar readable (--repair)"),
    "preview": ("jobs.preview", "a contact sheet PNG of samples with their prompts"),
    "report": ("jobs.report", "one self-contained HTML report of a run"),
    "signals": ("jobs.signals", "add curation signals to a run's committed shards"),
    "dedup": ("jobs.dedup", "near-duplicate groups (needs the phash signal)"),
    "compare": ("jobs.compare", "PSNR/SSIM of every sample against a reference run of the same plan"),
    "bench": ("jobs.bench", "throughput on one device against the plain diffusers loop"),
}


def usage() -> str:
    return "usage: shardgen COMMAND [ARGS...]   (the same as python -m jobs.COMMAND [ARGS...])\n\n" + "\n".join(
        f"  {name:9s} {doc}" for name, (_, doc) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]``'s program with the rest of ``argv``; its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, *rest = argv
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        print(f"shardgen: no command {name!r}{f' (did you mean {close[0]}?)' if close else ''}; the commands are "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    old_argv, sys.argv = sys.argv, [f"shardgen {name}", *rest]
    try:
        runpy.run_module(COMMANDS[name][0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
    return 0


def run_program(program: Callable[[], int | None], module: str) -> NoReturn:
    """``program()`` as this process's program (``python -m MODULE`` or ``shardgen COMMAND``): the process ends
    with its exit status once the atexit handlers have run and the standard streams are flushed, without the
    interpreter's teardown (1-3 s of collecting torch's, diffusers' and transformers' modules after the last
    line). In a process started as something else (``main`` called by a test), this is ``sys.exit(program())``."""
    if not started_as(module):
        sys.exit(program())
    try:
        code = program()
    except SystemExit as e:
        code = e.code
    except BrokenPipeError:  # the reader stopped reading (`| head`): stop quietly, as Unix tools do
        code = _output_gone()
    except OSError as e:
        if e.filename is not None or not _stdout_fails():
            raise
        code = _cannot_write(module, e)
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        code = 1
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # the interpreter's exit waits for such a thread: so does this one
    atexit._run_exitfuncs()  # logging's flush, weakref finalizers, multiprocessing's clean-up
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: closed when the process started
                stream.flush()
        except BrokenPipeError:  # a closed pipe: nothing more can reach it
            _output_gone()
        except OSError as e:  # the last of the output not written (a full disk): said, not lost silently
            if stream is sys.stdout:
                code = _cannot_write(module, e) if code == 0 else code
        except ValueError:  # a closed stream
            pass
    os._exit(code)


def _output_gone() -> int:
    """Standard output's reader is gone: later writes (and the final flush) go nowhere instead of failing; 141, the
    status of a program killed by SIGPIPE."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141


def _stdout_fails() -> bool:
    """Whether writing to standard output fails now (a full disk or device behind it), probed with one newline."""
    try:
        os.write(sys.stdout.fileno(), b"\n")
    except OSError:
        return True
    except (ValueError, AttributeError):  # no standard output at all
        return True
    return False


def _cannot_write(module: str, e: OSError) -> int:
    """One line on standard error for output that could not be written; status 1."""
    _output_gone()
    try:
        print(f"{module}: cannot write to standard output ({e.strerror or e}); send the output where there is room "
              "(nothing else failed)", file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return 1


def started_as(module: str) -> bool:
    """Whether the interpreter was started to run ``module`` (``python [OPTIONS] -m MODULE`` or ``shardgen
    COMMAND`` for it)."""
    argv = getattr(sys, "orig_argv", [])
    if "-m" in argv:
        return argv[argv.index("-m") + 1:argv.index("-m") + 2] == [module]
    command = next((name for name, (mod, _) in COMMANDS.items() if mod == module), None)
    return len(argv) > 2 and Path(argv[1]).name == "shardgen" and argv[2] == command


if __name__ == "__main__":
    run_program(main, "shardgen.cli")
