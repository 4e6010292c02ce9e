"""Compare a run with a reference run of the same prompts, seeds and sizes (e.g. fp8=true against the lossless
default): PSNR and SSIM of every sample both made, their median and worst. Written into the run: RUN_DIR/compare.json,
the summary jobs.report shows (totals, median, mean, worst and low quantiles, the worst samples), and
RUN_DIR/compare_samples.jsonl, every sample's figures (a run kept in a bucket: beside its files there, and in its
folder on this machine). With --min-psnr / --min-ssim / --max-lpips, exit 1 when the worst sample is
past the bound (a quality gate for scripts).

Two perceptual figures are added when their weights are given as local files (nothing is downloaded): LPIPS (v0.1,
AlexNet) with --lpips-backbone (torchvision's alexnet-owt-7be5be79.pth) and --lpips-layers (the lpips package's
weights/v0.1/alex.pth), and with --clip (a transformers CLIPModel directory) each sample's CLIP score against its
prompt in both runs.

    python -m jobs.compare RUN_DIR REFERENCE_DIR [--json] [--min-psnr DB] [--min-ssim S]
        [--lpips-backbone PATH --lpips-layers PATH [--max-lpips X]] [--clip DIR]

On dummy weights the figures measure numerical error, not image quality: run it on your own weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardgen.cli import run_program
from shardgen.dataio.resume import plan_for_tool
from shardgen.dataio.rundir import run_dir_arg
from shardgen.errors import UserError
from shardgen.tools import safe_write
from shardgen.tools.runfiles import share_output
from shardgen.tools.entry import run_tool, tool_parser


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.compare", __doc__)
    ap.add_argument("reference", type=run_dir_arg, help="the reference run directory (the lossless run)")
    ap.add_argument("--json", action="store_true", help="print compare.json's summary instead of one line")
    ap.add_argument("--min-psnr", type=float, default=None, help="exit 1 when a sample's PSNR (dB) is below this")
    ap.add_argument("--min-ssim", type=float, default=None, help="exit 1 when a sample's SSIM is below this")
    ap.add_argument("--lpips-backbone", metavar="PATH", default=None,
                    help="torchvision's AlexNet weights (alexnet-owt-7be5be79.pth): with --lpips-layers, the LPIPS "
                         "of every sample")
    ap.add_argument("--lpips-layers", metavar="PATH", default=None,
                    help="the lpips package's LPIPS layers, weights/v0.1/alex.pth")
    ap.add_argument("--max-lpips", type=float, default=None, help="exit 1 when a sample's LPIPS is above this")
    ap.add_argument("--clip", metavar="DIR", default=None,
                    help="a transformers CLIPModel directory: the CLIP score of every sample against its prompt, "
                         "in both runs")
    return run_tool(ap, argv, compare, check=check_options)


def check_options(args) -> None:
    """Refuse options that cannot work together, before any file is read."""
    lpips = {"--lpips-backbone": args.lpips_backbone, "--lpips-layers": args.lpips_layers}
    given = [option for option, path in lpips.items() if path]
    if len(given) == 1:
        missing = next(option for option in lpips if option not in given)
        raise UserError(f"{given[0]} without {missing}: LPIPS needs both files (torchvision's AlexNet weights and "
                        "the lpips package's weights/v0.1/alex.pth)")
    if args.max_lpips is not None and not given:
        raise UserError("--max-lpips needs LPIPS: give --lpips-backbone PATH and --lpips-layers PATH")
    if args.clip is not None and not Path(args.clip).is_dir():
        what = "not a directory" if Path(args.clip).exists() else "no such directory"
        raise UserError(f"--clip {args.clip}: {what}; give a transformers CLIPModel directory")


def compare(args, plan) -> int:
    """Compare ``plan``'s run with ``args.reference``; write RUN_DIR/compare_samples.jsonl and compare.json; 0, or 1
    past a bound."""
    from shardgen.quality.compare import compare_runs

    reference = plan_for_tool(args.reference)
    if same_run(plan.run, reference.run):
        raise UserError(f"{plan.run.name} is compared with itself: every figure would be exact. Give the run made "
                        "with the lossy setting first and the lossless run of the same prompts second")
    lpips, clip = load_models(args)
    result = compare_runs(plan.run, reference.run, lpips, clip)
    summary = result.to_json(plan.run.compare_samples_path.name)
    run = plan.run
    safe_write(run.compare_samples_path, result.sample_lines(), run)
    safe_write(run.compare_path, (json.dumps(summary, indent=1) + "\n").encode(), run)
    wrote = [f"wrote {share_output(run, path)}" for path in (run.compare_path, run.compare_samples_path)]
    print(json.dumps(summary) if args.json else "\n".join([result.line(), *wrote]))  # a bucket run's: there too
    return 1 if below(result.summary(), args.min_psnr, args.min_ssim, sys.stderr, args.max_lpips) else 0


def same_run(run, reference) -> bool:
    """Whether two ``RunDir``s are one run: the same bucket URL, or the same directory (through links too)."""
    if run.store or reference.store:
        return run.store == reference.store
    return run.root.resolve() == reference.root.resolve()


def load_models(args):
    """(LPIPS, CLIP scorer) as asked, each None when not; loaded before any sample is read, so that a weight file
    that cannot be used is named at once."""
    import torch

    from shardgen.dataio.shards.signals import ClipScorer
    from shardgen.quality.lpips import load_lpips

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lpips = load_lpips(args.lpips_backbone, args.lpips_layers, device) if args.lpips_backbone else None
    clip = None
    if args.clip:
        clip = ClipScorer(args.clip, device, setting="--clip ")
        clip.load()
    return lpips, clip


def below(summary: dict, min_psnr: float | None, min_ssim: float | None, err, max_lpips: float | None = None) -> bool:
    """Whether the worst sample is past a bound (said on ``err``); no sample compared is past any bound."""
    def shown(x, fmt: str) -> str:  # the worst figure as the summary line shows it; none when nothing was compared
        return "none (no sample compared)" if x is None else format(x, fmt)

    bad = []
    psnr, ssim, lpips = (summary.get(k, {}).get("worst") for k in ("psnr_db", "ssim", "lpips"))
    if min_psnr is not None and (psnr is None or psnr < min_psnr):
        bad.append(f"PSNR {shown(psnr, '.2f')} dB < {min_psnr:g}")
    if min_ssim is not None and (ssim is None or ssim < min_ssim):
        bad.append(f"SSIM {shown(ssim, '.4f')} < {min_ssim:g}")
    if max_lpips is not None and (lpips is None or lpips > max_lpips):
        bad.append(f"LPIPS {shown(lpips, '.3g')} > {max_lpips:g}")
    if (damaged := summary.get("damaged_shards")) and (min_psnr, min_ssim, max_lpips) != (None, None, None):
        bad.append(f"damaged shards were not compared ({'; '.join(f'{n}: {len(s)}' for n, s in damaged.items())})")
    if bad:
        print(f"below the bound: worst {'; '.join(bad)}", file=err)
    return bool(bad)


if __name__ == "__main__":
    run_program(main, "jobs.compare")
