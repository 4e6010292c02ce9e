"""Add curation signals to a finished (or running) run, from its committed tars into each shard's index.

    python -m jobs.signals RUN_DIR [signals=[phash,clip]] [--clip-model PATH] [--clip-device cpu|cuda]

The tars are not touched; each index is replaced atomically; a rerun continues after a kill. Then
``python -m jobs.dedup RUN_DIR`` and ``python -m jobs.report RUN_DIR`` use them.
"""

from __future__ import annotations


from shardgen.cli import run_program
from shardgen.tools import add_signals, signal_functions
from shardgen.tools.entry import run_tool, tool_parser


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.signals", __doc__)
    ap.add_argument("which", nargs="?", default=None, metavar="signals=[phash,clip]",
                    help="the signals to add, as jobs.generate spells them (default phash)")
    ap.add_argument("--signals", default="phash", help="the same, comma-separated")
    ap.add_argument("--clip-model", default=None, help="a transformers CLIPModel directory (for clip)")
    ap.add_argument("--clip-device", default="cpu")
    return run_tool(ap, argv, signals)


def signals(args, plan) -> int:
    """Add the asked signals to every committed shard's index that lacks them."""
    spec = args.which if args.which is not None else args.signals
    names = [n.strip() for n in spec.removeprefix("signals=").strip("[]").split(",") if n.strip()]
    functions = signal_functions(names, args.clip_model, args.clip_device)
    shards = images = 0
    for shard, n in add_signals(plan, functions):
        shards, images = shards + 1, images + n
        print(f"shard {shard:06d}: {', '.join(functions)} for {n} images")
    done = len(plan.run.done_shards())
    print(f"{args.run_dir}: {', '.join(functions)} added to {images} images in {shards} shard(s); "
          f"{done - shards} of {done} committed shards had them already")
    return 0


if __name__ == "__main__":
    run_program(main, "jobs.signals")
