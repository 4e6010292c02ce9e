"""What a LoRA costs a run: the base model, one adapter fused for the run, and rows switching adapter sets.

    python benchmarks/lora_speed.py --model flux_dev --steps 8 --n 16 --rank 64 --out $OUT/lora

One process per way, in this order, on one prompt file of captions of 1 to 200 words (dummy weights, the model's
own size and CFG settings; two random rank-``--rank`` adapters on the attention projections, made by
``shardgen.models.dummy.save_random_lora``):

1. ``base``: ``python -m jobs.generate ...`` eager (``compile: auto`` held eager by ``SHARDGEN_COMPILE_AUTO=eager``,
   which times every batch);
2. ``lora``: the same with ``model.loras=[a]`` (fused into the weights before the first batch);
3. ``rows``: eager, rows cycling through the adapter sets none / a / b / a+b
   (``prompts.row_settings=[loras]``): each switch restores the base weights and fuses the next set;
4. ``rows-compiled``: the rows of ``rows`` with ``compile=true``: the graphs compiled after the first batch must
   not grow (switching sets compiles nothing): ``recompiles`` counts dynamo's recompile messages (TORCH_LOGS).

Each way's figure is the median s/sample of its full batches (the job's own ``compile=...`` summary line) and its
whole process time; ``summary.json`` under ``--out`` holds them, each way's log beside it. ``--skip`` leaves ways out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_runs import parse_job, timed  # noqa: E402  (the whole-run benchmark's process timing and log parsing)

SETS = ([], ["a.safetensors"], ["b.safetensors"], ["a.safetensors", "b.safetensors:0.5"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux_dev")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n", type=int, default=16, help="prompts per way (default 16)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--size", default=None, help="HEIGHTxWIDTH (default: the model's own)")
    ap.add_argument("--skip", default="", help="comma-separated ways to leave out: base,lora,rows,rows-compiled")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra job overrides (every way)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from shardgen.bench.main import bench_prompts
    from shardgen.models.dummy import save_random_lora

    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("a", "b")):
        save_random_lora(a.model, out / f"{name}.safetensors", rank=a.rank, seed=i)
    prompts = bench_prompts(a.n)
    (out / "prompts.txt").write_text("".join(p + "\n" for p in prompts), encoding="utf-8")
    with open(out / "rows.jsonl", "w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps(dict(prompt=p, loras=SETS[i % len(SETS)])) + "\n")
    size = []
    if a.size:
        h, _, w = a.size.partition("x")
        size = [f"height={h}", f"width={w or h}"]
    job = [sys.executable, "-m", "jobs.generate", f"model={a.model}", "model.weights=dummy", f"steps={a.steps}",
           "progress=false", *size, *a.overrides]
    text = ["prompts=txt", f"prompts.path={out / 'prompts.txt'}"]
    rows = ["prompts=jsonl", f"prompts.path={out / 'rows.jsonl'}", "prompts.row_settings=[loras]"]
    ways = {"base": text,
            "lora": [*text, f"model.loras=[{{path: '{out / 'a.safetensors'}', scale: 0.8}}]"],
            "rows": rows,
            "rows-compiled": [*rows, "compile=true"]}
    skip = set(filter(None, a.skip.split(",")))
    env = dict(os.environ, PYTHONUNBUFFERED="1", SHARDGEN_CACHE=str(out / "cache"))
    res: dict = {"model": a.model, "steps": a.steps, "n": a.n, "rank": a.rank, "argv": sys.argv}
    for way, extra in ways.items():
        if way in skip:
            continue
        held = {"TORCH_LOGS": "recompiles"} if way == "rows-compiled" else {"SHARDGEN_COMPILE_AUTO": "eager"}
        way_env = dict(env, **held)
        wall, rc, log = timed(job + [f"run_dir={out / ('run-' + way)}", *extra], out / f"{way}.log", way_env)
        res[way] = dict(parse_job(log), rc=rc, wall_s=wall, recompiles=log.count("Recompiling function"))
        (out / "summary.json").write_text(json.dumps(res, indent=1))
    base = (res.get("base") or {}).get("eager_s_per_sample")
    for way in ("lora", "rows"):
        r = res.get(way) or {}
        if base and r.get("eager_s_per_sample"):
            r["x_base"] = r["eager_s_per_sample"] / base
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "argv"}, indent=1))


if __name__ == "__main__":
    main()
