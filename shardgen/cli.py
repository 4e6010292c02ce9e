"""``shardgen COMMAND [ARGS...]``: one console entry point beside ``python -m jobs.COMMAND``, running the same
program with the same arguments (``shardgen status runs/default`` is ``python -m jobs.status runs/default``)."""

from __future__ import annotations

import difflib
import runpy
import sys

COMMANDS = {
    "generate": ("jobs.generate", "generate a run's samples (Hydra overrides: key=value group=option)"),
    "status": ("jobs.status", "progress, rate, ETA, claims, last error (--json, --prometheus)"),
    "verify": ("jobs.verify", "every prompt index exactly once, every tar readable (--repair)"),
    "preview": ("jobs.preview", "a contact sheet PNG of samples with their prompts"),
    "report": ("jobs.report", "one self-contained HTML report of a run"),
    "signals": ("jobs.signals", "add curation signals to a run's committed shards"),
    "dedup": ("jobs.dedup", "near-duplicate groups (needs the phash signal)"),
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


if __name__ == "__main__":
    sys.exit(main())
