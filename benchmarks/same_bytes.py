"""Same samples before and after a change: run each strategy and family case with two checkouts and compare.

    python benchmarks/same_bytes.py --before 0f53362            # this checkout against that commit
    python benchmarks/same_bytes.py --before main --cases dp,tp2

Each case is ``python -m jobs.generate`` on the tiny models (CPU, gloo ranks where the case has two) in a fresh run
directory per checkout; the other checkout is a temporary ``git worktree`` of ``--before``. Images must be equal byte
for byte; videos (lossless, ``video_crf=0``) must decode to equal frames, since x264 may encode the same frames into
other bytes. Prints one line per case and exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ("height=64", "width=64", "steps=2", "prompts.limit=8", "samples_per_shard=4", "batch_size=4",
         "progress=false")
TWO = ("launcher=local", "launcher.nprocs=2")
CASES = {
    "dp": IMAGE,
    "tp2": (*IMAGE, "strategy=tp", "tp_degree=2", *TWO),
    "ulysses2": (*IMAGE, "strategy=cp_ulysses", "ulysses_degree=2", *TWO),
    "cfg2": (*IMAGE, "model.true_cfg_scale=4", "model.negative_prompt=blurry", "cfg_degree=2", *TWO),
    "fsdp2": (*IMAGE, "strategy=fsdp", *TWO),
    "video": ("model=tiny_video", "height=32", "width=32", "num_frames=5", "steps=2", "batch_size=2",
              "prompts.limit=6", "samples_per_shard=4", "video_crf=0", "progress=false"),
}


def generate(tree: Path, run_dir: Path, args: tuple[str, ...]) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, "-m", "jobs.generate", f"run_dir={run_dir}", *args], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{p.stderr[-2000:]}")


def samples(run_dir: Path) -> dict[str, object]:
    """key -> the image's bytes, or a video's decoded frames as bytes."""
    sys.path.insert(0, str(ROOT))
    from shardgen.dataio.shards.video import decode_video
    from shardgen.tools.verify import read_shard_members

    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for key, members in read_shard_members(tar).items():
            if "mp4" in members:
                out[key] = decode_video(members["mp4"])[0].tobytes()
            else:
                out[key] = next(v for k, v in members.items() if k in ("png", "jpg", "webp"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a commit or branch to compare this checkout with")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            differ = 0
            for name in cases:
                made = {}
                for label, tree in (("before", before), ("after", ROOT)):
                    run_dir = Path(tmp) / f"{name}-{label}"
                    generate(tree, run_dir, CASES[name])
                    made[label] = samples(run_dir)
                same = made["before"] == made["after"] and made["after"]
                differ += not same
                print(f"{name:9s} {len(made['after'])} samples: {'same' if same else 'DIFFERENT'}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
