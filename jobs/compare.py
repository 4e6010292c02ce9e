"""Compare a run with a reference run of the same prompts, seeds and sizes (e.g. fp8=true against the lossless
default): PSNR and SSIM of every sample both made, their median and worst. Written into the run: RUN_DIR/compare.json,
the summary jobs.report shows (totals, median, mean, worst and low quantiles, the worst samples), and
RUN_DIR/compare_samples.jsonl, every sample's figures (a run kept in a bucket: beside its files there, and in its
folder on this machine). With --min-psnr / --min-ssim, exit 1 when the worst sample is
below the bound (a quality gate for scripts).

    python -m jobs.compare RUN_DIR REFERENCE_DIR [--json] [--min-psnr DB] [--min-ssim S]

On dummy weights the figures measure numerical error, not image quality: run it on your own weights.
"""

from __future__ import annotations

import json
import sys

from shardgen.cli import run_program
from shardgen.dataio.resume import plan_for_tool
from shardgen.dataio.rundir import run_dir_arg
from shardgen.tools import safe_write
from shardgen.tools.runfiles import share_output
from shardgen.tools.entry import run_tool, tool_parser


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.compare", __doc__)
    ap.add_argument("reference", type=run_dir_arg, help="the reference run directory (the lossless run)")
    ap.add_argument("--json", action="store_true", help="print compare.json's summary instead of one line")
    ap.add_argument("--min-psnr", type=float, default=None, help="exit 1 when a sample's PSNR (dB) is below this")
    ap.add_argument("--min-ssim", type=float, default=None, help="exit 1 when a sample's SSIM is below this")
    return run_tool(ap, argv, compare)


def compare(args, plan) -> int:
    """Compare ``plan``'s run with ``args.reference``; write RUN_DIR/compare_samples.jsonl and compare.json; 0, or 1
    below a bound."""
    from shardgen.quality.compare import compare_runs

    reference = plan_for_tool(args.reference)
    result = compare_runs(plan.run, reference.run)
    summary = result.to_json(plan.run.compare_samples_path.name)
    run = plan.run
    safe_write(run.compare_samples_path, result.sample_lines(), run)
    safe_write(run.compare_path, (json.dumps(summary, indent=1) + "\n").encode(), run)
    wrote = [f"wrote {share_output(run, path)}" for path in (run.compare_path, run.compare_samples_path)]
    print(json.dumps(summary) if args.json else "\n".join([result.line(), *wrote]))  # a bucket run's: there too
    return 1 if below(result.summary(), args.min_psnr, args.min_ssim, sys.stderr) else 0


def below(summary: dict, min_psnr: float | None, min_ssim: float | None, err) -> bool:
    """Whether the worst sample is under a bound (said on ``err``); no sample compared is below any bound."""
    bad = []
    if min_psnr is not None and (summary["psnr_db"]["worst"] is None or summary["psnr_db"]["worst"] < min_psnr):
        bad.append(f"PSNR {summary['psnr_db']['worst']} dB < {min_psnr}")
    if min_ssim is not None and (summary["ssim"]["worst"] is None or summary["ssim"]["worst"] < min_ssim):
        bad.append(f"SSIM {summary['ssim']['worst']} < {min_ssim}")
    if bad:
        print(f"below the bound: worst {'; '.join(bad)}", file=err)
    return bool(bad)


if __name__ == "__main__":
    run_program(main, "jobs.compare")
