"""Add curation signals to a finished (or running) run, from its committed tars into each shard's index.

    python -m jobs.signals RUN_DIR [signals=[phash,clip]] [--clip-model PATH] [--clip-device cpu|cuda]

The tars are not touched; each index is replaced atomically; a rerun continues after a kill. Then
``python -m jobs.dedup RUN_DIR`` and ``python -m jobs.report RUN_DIR`` use them.
"""

from __future__ import annotations

import argparse
import sys

from shardgen.dataio.resume import plan_for_tool
from shardgen.dataio.rundir import run_dir_arg
from shardgen.dataio.tools import add_signals, signal_functions, tool_errors
from shardgen.errors import UserError


@tool_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.signals", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    ap.add_argument("which", nargs="?", default=None, metavar="signals=[phash,clip]",
                    help="the signals to add, as jobs.generate spells them (default phash)")
    ap.add_argument("--signals", default="phash", help="the same, comma-separated")
    ap.add_argument("--clip-model", default=None, help="a transformers CLIPModel directory (for clip)")
    ap.add_argument("--clip-device", default="cpu")
    args = ap.parse_args(argv)
    spec = args.which if args.which is not None else args.signals
    names = [n.strip() for n in spec.removeprefix("signals=").strip("[]").split(",") if n.strip()]
    plan = plan_for_tool(args.run_dir)
    if isinstance(plan, str):
        print(plan, file=sys.stderr)
        return 2
    try:
        functions = signal_functions(names, args.clip_model, args.clip_device)
        shards = images = 0
        for shard, n in add_signals(plan, functions):
            shards, images = shards + 1, images + n
            print(f"shard {shard:06d}: {', '.join(functions)} for {n} images")
    except UserError as e:
        print(f"{args.run_dir}: {e}", file=sys.stderr)
        return 2
    done = len(plan.run.done_shards())
    print(f"{args.run_dir}: {', '.join(functions)} added to {images} images in {shards} shard(s); "
          f"{done - shards} of {done} committed shards had them already")
    return 0


if __name__ == "__main__":
    sys.exit(main())
