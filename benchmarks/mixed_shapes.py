"""One run mixing image sizes (per-row settings) against the same work as one run per size.

    python benchmarks/mixed_shapes.py --model flux_dev --steps 8 --n 12 --out $OUT/mixed

One process, one pipeline (built once, compiled with ``compile=true`` unless ``--set compile=false``):

1. warm-up: a small mixed run (one batch per size) compiles every size's graphs; the graphs compiled are counted
   (one per block class and size: bounded by the sizes, not by the batches);
2. ``mixed``: ``--n`` prompts per size in one jsonl whose rows cycle through the sizes (``width``/``height``
   fields, ``prompts.row_settings=[width,height]``), one run: rows of one size are batched together inside a shard;
3. ``single``: the same prompts as one run per size (``height=``/``width=`` set, no row settings).

Both sides run the same batches of the same prompts at the same settings after the warm-up, so the difference is
what mixing costs: batching by shape, the size switches between batches, planning with per-row settings. Printed
and saved (``summary.json``): wall time and images/hour of each side, the sum of the pipeline calls' time, the graphs
compiled during the timed runs (0 = no recompilation), and the sizes of the images each side wrote.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed_run(cfg, pipe) -> dict:
    """The job on the shared pipeline (``shardgen.bench.ways.run_shardgen``, the bench's own timing): wall seconds,
    seconds inside the pipeline calls, batches, and the graphs compiled during the run."""
    from shardgen.bench.measure import TransformerTimer
    from shardgen.bench.ways import run_shardgen

    device = torch_device()
    r = run_shardgen(pipe, cfg, device, TransformerTimer(pipe.transformer, device))
    return {"wall_s": round(r["wall_s"], 2), "calls_s": round(sum(r["batch_s"]), 2), "batches": r["batches"],
            "ok": r["ok"], "failed": r["failed"],
            "graphs_compiled": r["graphs_compiled"] + r["recompiles_after_first_batch"]}


def torch_device():
    """The GPU (with its index: ``torch.cuda.set_device`` needs one), else the CPU."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sizes_written(run_dir: Path) -> dict:
    """{"HxW": images} over the run's committed shards (decoded: the pixels' own size)."""
    from shardgen.rasters import open_raster
    from shardgen.tools import read_shard_members

    out: dict = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for mem in read_shard_members(tar).values():
            img = next((v for k, v in mem.items() if k in ("png", "jpg", "webp")), None)
            if img is not None:
                w, h = open_raster(img, str(tar)).size
                out[f"{h}x{w}"] = out.get(f"{h}x{w}", 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--n", type=int, default=12, help="prompts per size (default 12)")
    ap.add_argument("--sizes", default="1024x1024,1216x832,832x1216", help="HEIGHTxWIDTH,... (default: three)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--weights", default=None, help="model.weights, e.g. dummy (random weights, no download); "
                    "default: the model's own (tiny: built locally)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra job overrides (both sides)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    from shardgen.bench.main import bench_prompts, compose
    from shardgen.models.loader import load_pipeline, torch_dtype

    out = Path(a.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    prompts = bench_prompts(a.n * len(sizes))
    common = [f"model={a.model}", *([f"model.weights={a.weights}"] if a.weights else []), f"steps={a.steps}", f"batch_size={a.batch}",
              f"samples_per_shard={a.batch * len(sizes)}", "progress=false", "compile=true", "compile_tuning=false",
              *a.overrides]

    def mixed_file(path: Path, rows: list[str]) -> Path:
        path.write_text("".join(json.dumps({"prompt": p, "height": sizes[i % len(sizes)][0],
                                            "width": sizes[i % len(sizes)][1]}) + "\n" for i, p in enumerate(rows)))
        return path

    def mixed_cfg(name: str, rows: list[str]):
        return compose(common + ["prompts=jsonl", f"prompts.path={mixed_file(out / f'{name}.jsonl', rows)}",
                                 "prompts.row_settings=[width,height]", f"run_dir={out / ('run-' + name)}"])

    cfg = mixed_cfg("mixed", prompts)
    device = torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    pipe = load_pipeline(cfg.model, torch_dtype(cfg.dtype), device)
    res: dict = {"model": a.model, "steps": a.steps, "n_per_size": a.n, "sizes": a.sizes, "argv": sys.argv,
                 "build_s": round(time.perf_counter() - t0, 1),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    res["warmup"] = timed_run(mixed_cfg("warmup", prompts[: a.batch * len(sizes)]), pipe)
    print("warm-up (compiles every size):", res["warmup"], flush=True)
    res["mixed"] = timed_run(cfg, pipe)
    res["mixed"]["sizes"] = sizes_written(out / "run-mixed")
    print("mixed:", res["mixed"], flush=True)
    single = {"wall_s": 0.0, "calls_s": 0.0, "batches": 0, "ok": 0, "failed": 0, "graphs_compiled": 0, "sizes": {}}
    for i, (h, w) in enumerate(sizes):
        rows = prompts[i :: len(sizes)]
        txt = out / f"single-{h}x{w}.txt"
        txt.write_text("".join(p + "\n" for p in rows))
        r = timed_run(compose(common + ["prompts=txt", f"prompts.path={txt}", f"height={h}", f"width={w}",
                                        f"run_dir={out / f'run-single-{h}x{w}'}"]), pipe)
        print(f"single {h}x{w}:", r, flush=True)
        for k in ("wall_s", "calls_s", "batches", "ok", "failed", "graphs_compiled"):
            single[k] += r[k]
        single["sizes"].update(sizes_written(out / f"run-single-{h}x{w}"))
    res["single"] = single
    n = len(prompts)
    for side in ("mixed", "single"):
        res[side]["images_per_hour"] = round(3600 * n / res[side]["wall_s"], 1)
    res["mixed_vs_single_wall"] = round(single["wall_s"] / res["mixed"]["wall_s"], 3)
    res["mixed_vs_single_calls"] = round(single["calls_s"] / res["mixed"]["calls_s"], 3)
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "argv"}, indent=1))


if __name__ == "__main__":
    main()
