"""List a run's near-duplicate images, from the perceptual hashes of ``signals=[phash]``.

    python -m jobs.dedup RUN_DIR [--max-distance 4] [--json]
"""

from __future__ import annotations

import json
import sys

from shardgen.cli import run_program
from shardgen.dataio.rundir import RunDir
from shardgen.dataio.rundir.layout import is_run_dir
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.tools import count_arg, near_duplicate_groups, read_index_columns
from shardgen.tools.entry import NO_PLAN, run_tool, tool_parser


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.dedup", __doc__)
    ap.add_argument("--max-distance", type=count_arg(0), default=4, help="bits two phashes may differ by (0: identical)")
    ap.add_argument("--json", action="store_true", help="one JSON list of groups (lists of keys) on stdout")
    # reads the committed index only: a run whose plan is gone too (so NO_PLAN only where there is neither a run
    # nor an index)
    return run_tool(ap, argv, dedup, plan=None)


def dedup(args) -> int:
    """Print the near-duplicate groups of the run's committed images; RunDirError (NO_PLAN) when the path holds
    neither a committed index nor a run."""
    run = RunDir.at(args.run_dir)
    if not run.listed_shards(run.shards_dir, ".parquet") | run.listed_shards(run.uploads_dir, ".json"):
        # absent, a file, some other directory: not a run in progress, so say that (a bucket's run: its owner record)
        if not (run.files.exists(run.marker_path) if run.store else is_run_dir(run.root)):
            raise RunDirError(f"{args.run_dir}: {NO_PLAN}")
        print(f"{args.run_dir}: no committed shard index (shards/*.parquet) yet", file=sys.stderr)
        return 2
    cols = read_index_columns(run, ["key", "prompt", "phash"], where="phash")
    if not cols["key"]:
        print(f"{args.run_dir}: no phash in the index; generate with signals=[phash]", file=sys.stderr)
        return 2
    keys, prompts, hashes = cols["key"], cols["prompt"], cols["phash"]
    groups = near_duplicate_groups(keys, hashes, args.max_distance)
    if args.json:
        print(json.dumps(groups))
        return 0
    prompt_of = dict(zip(keys, prompts))
    print(f"{len(groups)} near-duplicate group(s) among {len(keys)} images (phash distance <= {args.max_distance})")
    for g in groups:
        more = " ..." if len(g) > 10 else ""
        print(f"  {len(g)}: " + ", ".join(f"{k} ({(prompt_of[k] or '')[:40]!r})" for k in g[:10]) + more)
    return 0


if __name__ == "__main__":
    run_program(main, "jobs.dedup")
