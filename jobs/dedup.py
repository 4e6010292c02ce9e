"""List a run's near-duplicate images, from the perceptual hashes of ``signals=[phash]``.

    python -m jobs.dedup RUN_DIR [--max-distance 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from shardgen.dataio.rundir import RunDir, run_dir_arg
from shardgen.dataio.tools import count_arg, near_duplicate_groups, read_index_columns, tool_errors


@tool_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.dedup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=run_dir_arg, help="the run directory (PATH or run_dir=PATH)")
    ap.add_argument("--max-distance", type=count_arg(0), default=4, help="bits two phashes may differ by (0: identical)")
    ap.add_argument("--json", action="store_true", help="one JSON list of groups (lists of keys) on stdout")
    args = ap.parse_args(argv)
    run = RunDir.at(args.run_dir)
    if not run.listed_shards(run.shards_dir, ".parquet") | run.listed_shards(run.uploads_dir, ".json"):
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
    sys.exit(main())
