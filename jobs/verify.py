"""Audit a run directory; exit 1 on any defect (``--repair``: make damaged shards sound or absent). A run still
in progress is checked as far as it is committed: its other shards are listed as in progress, not as defects.

    python -m jobs.verify RUN_DIR [--no-decode] [--repair]
"""

from __future__ import annotations


from shardgen.cli import run_program
from shardgen.tools import count_arg, repair_run, verify_run
from shardgen.tools.entry import run_tool, tool_parser


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.verify", __doc__)
    ap.add_argument("--no-decode", action="store_true", help="skip decoding every image (faster)")
    ap.add_argument("--repair", action="store_true",
                    help="rewrite stats from sound tars; remove shards whose samples are wrong (generate makes them again)")
    ap.add_argument("--max-lines", type=count_arg(0), default=20, help="defects to print")
    return run_tool(ap, argv, verify)


def verify(args, plan) -> int:
    """Audit ``plan``'s run (and repair it with --repair); 0 sound, 1 defects."""
    rep = verify_run(plan, decode=not args.no_decode)
    status = ", ".join(f"{v} {k}" for k, v in sorted(rep.status.items()))
    print(f"{args.run_dir}: {rep.shards_checked}/{plan.num_shards} shards, {rep.samples}/{plan.num_rows} samples ({status})")
    for line in rep.defects[: args.max_lines]:
        print("  DEFECT", line)
    if len(rep.defects) > args.max_lines:
        print(f"  ... and {len(rep.defects) - args.max_lines} more")
    for line in rep.unfinished[: args.max_lines]:
        print("  UNFINISHED", line)
    if len(rep.unfinished) > args.max_lines:
        print(f"  ... and {len(rep.unfinished) - args.max_lines} more")
    if rep.earlier_settings:
        print(f"  NOTE     {sum(rep.earlier_settings.values())} samples were made with settings the run had before "
              f"allow_fingerprint_change ({', '.join(f'{n} with {s}' for s, n in rep.earlier_settings.items())}; "
              "fingerprint_changes.jsonl): kept, --repair leaves them. To make them again with the current "
              "settings, delete their shards' .tar and .stats.json and re-run the generate command")
    if rep.ok:
        print("OK: every prompt index exactly once, every tar readable and unchanged, every sample as planned, "
              "counts match")
        return 0
    if rep.sound:
        print(f"OK so far: the run is unfinished ({len(rep.unfinished)} of {plan.num_shards} shards not committed: "
              f"{rep.in_progress} in progress, {len(rep.unfinished) - rep.in_progress} not started); the committed "
              "shards are sound. The generate command continues it")
        if args.repair:
            for line in repair_run(plan, rep):  # an interrupted commit's tar: finished now
                print("  REPAIRED", line)
        return 0
    print(f"FAILED: {len(rep.defects)} defects")
    if args.repair:
        repaired = repair_run(plan, rep)
        for line in repaired:
            print("  REPAIRED", line)
        if repaired:
            print(f"Now re-run the generate command (e.g. python -m jobs.generate run_dir={args.run_dir} ...) "
                  "with the run's settings to complete it.")
        else:  # nothing in shards/ to repair: the defects are elsewhere (the prompt file, the fingerprint)
            print("Nothing in shards/ to repair; fix what the lines above name.")
    elif rep.bad_shards or rep.stray:
        print(f"To repair: python -m jobs.verify {args.run_dir} --repair, then re-run the generate command")
    return 1


if __name__ == "__main__":
    run_program(main, "jobs.verify")
