"""The benchmark's steps (``python -m jobs.bench`` parses the arguments): build one pipeline, run the seed
loop and the bf16 noise floor, count the transformer's FLOPs, run shardgen's job (after a warm-up run, or
from cold with ``--no-warmup``), then each opt-in or diagnostic run, and print the summary."""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from parallel import registry
from shardgen.bench import measure as M
from shardgen.config.paths import CONF
from shardgen.bench.report import DIAGNOSTICS, Report, fmt_flop, say, summary
from shardgen.bench.ways import baseline_kwargs, fbc_counter, noise_floor, run_baseline, run_shardgen
from shardgen.dataio.shards import is_video

ROOT = Path(__file__).resolve().parents[2]
ACCELS = {  # name -> config overrides (the threshold of fbc comes from --fbc-threshold)
    "fbc": lambda a: [f"first_block_cache={a.fbc_threshold}"],
    "fp8": lambda a: ["fp8=true"],
    "fp8+fbc": lambda a: ["fp8=true", f"first_block_cache={a.fbc_threshold}"],
    # exact diagnostics: where shardgen's difference to the baseline (or its speed) comes from: the same batches
    # uncompiled, compiled one prompt per batch, true CFG as two transformer calls
    "eager": lambda a: ["compile=false"],
    "batch1": lambda a: ["batch_size=1"],
    "nocfgbatch": lambda a: ["cfg_batching=false"],
    "cfgbatch": lambda a: ["cfg_batching=true"],
}
RECOMPILING = ("fp8", "batch1", "cfgbatch")  # their first batch pays a compilation: left out of the timing
# prompt lengths in words, cycled: PartiPrompts' range (1-70 words) and long LLM-written captions (120-200
# words): a caption mix as users bring it (Qwen-Image's text then spans its 128- and 256-token buckets)
WORDS = (1, 70, 8, 160, 30, 3, 120, 50, 15, 200, 22, 5)


def bench_prompts(n: int) -> list[str]:
    """``n`` prompts from examples/prompts.txt, cut or extended to 1-200 words (models that trim the text to
    the batch's longest prompt then see a new length in every batch, as with real captions)."""
    base = [l for l in (ROOT / "examples" / "prompts.txt").read_text(encoding="utf-8").splitlines() if l.strip()]
    words = " ".join(base).split()
    out = []
    for i in range(n):
        first = base[i % len(base)].split()
        k = WORDS[i % len(WORDS)]
        out.append(" ".join((first + words[i:])[:k]))
    return out


def parse_size(size) -> tuple[int, int]:
    """(height, width) from ``--size``: ``1024`` (square) or ``480x832`` (height x width)."""
    h, _, w = str(size).lower().partition("x")
    try:
        return int(h), int(w or h)
    except ValueError:
        raise SystemExit(f"--size {size}: give one number (a square) or HEIGHTxWIDTH, e.g. 480x832") from None


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from shardgen.config.store import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="generate", overrides=overrides)


def first_failure(run_dir: Path) -> str | None:
    from shardgen.dataio.shards import read_shard_members

    for tar in sorted((run_dir / "shards").glob("*.tar")):
        for mem in read_shard_members(tar).values():
            meta = json.loads(mem["json"])
            if meta.get("status") == "failed":
                return meta.get("error")
    return None


def offloaded_pipeline(model_cfg, dtype: torch.dtype, device: torch.device):
    """The pipeline in the machine's RAM under diffusers' ``enable_model_cpu_offload`` (each component moved to
    ``device`` for its own call, then back): how diffusers runs a pipeline larger than the GPU. Dummy weights are
    built on the GPU, the text encoders first, each moved off it once built, then the rest moved off too."""
    from shardgen.models.dummy import build_dummy_pipeline
    from shardgen.models.loader import load_pipeline

    if device.type != "cuda":
        raise SystemExit(f"--baseline-offload moves each component to a CUDA GPU for its call; the device here is "
                         f"{device.type}: leave --baseline-offload out")
    if model_cfg.weights == "dummy":
        pipe = build_dummy_pipeline(model_cfg.name, device, dtype, pipeline=model_cfg.pipeline, encoders_on_cpu=True)
        pipe.to("cpu")
    else:
        pipe = load_pipeline(model_cfg, dtype, None)
    pipe.enable_model_cpu_offload(device=device)
    return pipe


class Bench:
    """One benchmark run: the shared pipeline, its config, the report, and each step as a method."""

    def __init__(self, args):
        from parallel.world import choose_device
        from shardgen.dataio.prompts import sample_seed
        from shardgen.models.loader import torch_dtype

        self.args, self.rep = args, Report(args.out)
        self.device = choose_device(args.device, 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        spec = args.accel if args.accel is not None else ("fbc,fp8" if self.device.type == "cuda" else "none")
        self.accels = [] if spec == "none" else [a for a in spec.split(",") if a]
        for a in self.accels:
            if a not in ACCELS:
                raise SystemExit(f"--accel {a}: use some of {', '.join(ACCELS)} or none")
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="shardgen-bench-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.prompts = bench_prompts(args.n)
        if args.size is None:  # the model's own size (its config's height and width)
            own = compose([f"model={args.model}", f"model.weights={args.weights}"])
            self.height, self.width = own.height, own.width
        else:
            self.height, self.width = parse_size(args.size)
        prompt_file = self.work / "prompts.txt"
        prompt_file.write_text("".join(p + "\n" for p in self.prompts), encoding="utf-8")
        self.common = [f"model={args.model}", f"model.weights={args.weights}", "prompts=txt",
                       f"prompts.path={prompt_file}", f"height={self.height}", f"width={self.width}",
                       f"batch_size={args.batch}", f"device={self.device.type}", "progress=false",
                       f"sdpa_backend={args.sdpa}", f"compile_mode={args.compile_mode}",
                       *([f"steps={args.steps}"] if args.steps else []),
                       *self._compile_override(args), *args.overrides]
        self.cfg = compose(self.common + [f"run_dir={self.work / 'run'}"])
        from shardgen.speed.accel import AccelOptions

        # --set fp8=true (or an 8-bit attention kernel) makes the measured run lossy: said as such, and an opt-in run
        # that would only repeat it is left out
        self.lossy = AccelOptions.from_cfg(self.cfg).lossy
        self.repeats = [a for a in self.accels if a not in DIAGNOSTICS and self.lossy
                        and AccelOptions.from_cfg(compose(self.common + ACCELS[a](args))).lossy == self.lossy]
        self.accels = [a for a in self.accels if a not in self.repeats]
        self.dtype = torch_dtype(self.cfg.dtype)
        self.unit = "video" if is_video(self.cfg) else "image"  # the figures' keys say images either way
        self.seeds = [sample_seed(self.cfg.seed, i) for i in range(args.n)]
        self.base = None

    def _compile_override(self, args) -> list[str]:
        """compile as asked; unasked: on with CUDA (the bench measures the compiled path's steady state; the
        per-process choice of compile=auto is what benchmarks/real_runs.py measures), else the config's."""
        if args.compile is not None:
            return [f"compile={str(args.compile).lower()}"]
        return ["compile=true"] if self.device.type == "cuda" else []

    def env(self) -> dict:
        from shardgen.speed.accel import AccelOptions

        a, cfg, dev = self.args, self.cfg, self.device
        env = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "python": platform.python_version(), "model": a.model, "weights": a.weights,
               "dtype": cfg.dtype, "size": f"{self.height}x{self.width}", "steps": cfg.steps, "guidance": cfg.guidance,
               "num_frames": cfg.num_frames if is_video(cfg) else None,
               "true_cfg_scale": cfg.model.true_cfg_scale, "n": a.n, "batch": a.batch,
               "compile": AccelOptions.from_cfg(cfg, registry.get(cfg.strategy.name).one_gpu_per_replica).compile,
               "compile_mode": a.compile_mode, "sdpa_backend": a.sdpa,
               "warmup_run": not a.no_warmup, "lossy": self.lossy, "argv": sys.argv}
        try:
            import diffusers

            env["diffusers"] = diffusers.__version__
        except ImportError:
            pass
        return env

    def build(self):
        from shardgen.models.loader import load_pipeline
        from shardgen.speed import accel

        t0 = time.perf_counter()
        if getattr(self.args, "baseline_offload", False):
            self.pipe = offloaded_pipeline(self.cfg.model, self.dtype, self.device)
        else:
            # the job's own check: a model too large for the device is a message before any weight, not the kernel's
            # out-of-memory kill half-way through building it (the bench's pipeline is one process's, all on one device)
            from parallel.dims import ParallelDims
            from parallel.memory import check_memory

            check_memory(self.cfg, ParallelDims(world_size=1), self.device.type)
            self.pipe = load_pipeline(self.cfg.model, self.dtype, self.device)
        if any("fp8" in name for name in self.accels):  # the ways after an fp8 one switch it off again
            accel.make_reversible(self.pipe.transformer)
        M.sync(self.device)
        self.rep.put("build_s", round(time.perf_counter() - t0, 2))
        say(f"pipeline built in {self.rep.data['build_s']:.1f} s ({type(self.pipe).__name__}); weights on device: "
            + (f"{torch.cuda.memory_allocated(self.device) / M.GiB:.1f} GiB" if self.device.type == "cuda" else "cpu"))
        self.timer = M.TransformerTimer(self.pipe.transformer, self.device)

    def baseline(self):
        a = self.args
        nb = min(a.baseline_n or a.n, a.n)
        base = run_baseline(self.pipe, self.cfg, self.prompts[:nb], self.seeds[:nb], self.work / "baseline",
                            self.timer, self.device)
        self.rep.put("baseline", base)
        say(f"baseline: {base['n']} {self.unit}s in {base['wall_s']:.1f} s = {base['images_per_hour']:.0f} {self.unit}s/hour")
        if a.noise_floor and self.device.type == "cuda":
            k = min(a.noise_floor, nb)
            base["noise_floor"] = nf = noise_floor(self.pipe, self.cfg, self.prompts[:k], self.seeds, self.work,
                                                   self.timer, self.device)
            say(f"bf16 noise floor: the baseline loop with SDPA {nf['kernel']} instead of torch's choice, PSNR vs "
                f"the baseline: first {M.fmt_db(nf['first'])} dB, mean {M.fmt_db(nf['mean'])} over {nf['n']}")
        self.base = base

    def flops(self) -> dict:
        """FLOPs per image-step, from one real transformer call (batch 1) and, for FLUX.1, from the config."""
        flops = {}
        if self.timer.captured is None:  # no baseline: capture a call now
            self.timer.capture_next = True
            self.pipe(**dict(baseline_kwargs(self.pipe, self.cfg, self.prompts[0], self.seeds[0]), num_inference_steps=2))
        try:
            flops["counted"] = M.count_flops(self.pipe.transformer, self.timer.captured)
        except Exception as e:
            flops["counted_error"] = f"{type(e).__name__}: {e}"[:300]
        tcfg = self.pipe.transformer.config
        if type(self.pipe.transformer).__name__ == "FluxTransformer2DModel":
            factor = getattr(self.pipe, "vae_scale_factor", 8) * 2
            flops["analytic_flux"] = M.flux_flops(tcfg, (self.height // factor) * (self.width // factor),
                                                  self.cfg.model.max_sequence_length)
        per_step = flops.get("counted") or flops.get("analytic_flux")
        if flops.get("analytic_flux") and per_step < 0.95 * flops["analytic_flux"]:
            per_step = flops["analytic_flux"]  # the counter missed something (an attention kernel without a formula)
        # true CFG (Qwen-Image) and Wan's CFG: two transformer calls per step (batched into one by cfg_batching,
        # same work); counted on the baseline loop where it ran, else from the config
        if self.base and self.base.get("transformer_calls"):
            flops["calls_per_step"] = round(self.base["transformer_calls"] / (self.base["n"] * self.cfg.steps))
        else:
            flops["calls_per_step"] = 2 if self.cfg.model.true_cfg_scale > 1 else 1
        flops["per_image_step"] = per_step * flops["calls_per_step"] if per_step else None
        self.timer.captured = None
        self.rep.put("flops", flops)
        say(f"transformer FLOPs per image-step: {fmt_flop(flops['per_image_step'] or 0)} (torch flop counter, "
            f"{flops['calls_per_step']} call(s) per step)"
            + (f"; {fmt_flop(flops['analytic_flux'])} from the FLUX config" if "analytic_flux" in flops else ""))
        return flops

    def mfu(self, r: dict) -> tuple[float | None, float | None]:
        per_step = self.rep.data["flops"].get("per_image_step")
        if not per_step or not r.get("n"):
            return None, None
        total = per_step * r["n"] * self.cfg.steps
        tflops = self.rep.data["matmul_peak"]["tflops"] * 1e12
        denoised = per_step * r.get("denoise_images", r["n"]) * self.cfg.steps
        den = denoised / r["transformer_s"] / tflops if r.get("transformer_s") else None
        return den, total / (r["s_per_image"] * r["n"]) / tflops

    def shardgen(self) -> tuple[dict | None, dict]:
        """The warm-up run (one batch: compilation, kernel choice) unless --no-warmup, then the measured run
        (with --no-warmup it pays the compilation in its first batch, left out of the steady figure)."""
        a, warm = self.args, None
        if not a.no_warmup:
            warm = self._warmup()
        sg = run_shardgen(self.pipe, self.cfg, self.device, self.timer, skip_first=1 if a.no_warmup else 0,
                          profile_batch=(a.profile_batch + (1 if a.no_warmup else 0)) if self.device.type == "cuda" else None)
        sg["mfu_denoise"], sg["mfu_e2e"] = self.mfu(sg)
        first = (warm or sg)["first_batch_s"]
        if sg.get("steady_s_per_image") and first is not None:
            sg["compile_s_estimate"] = round(first - sg["steady_s_per_image"] * a.batch, 1)
        from shardgen.speed.accel import chosen_sdpa

        sg["sdpa_choice"] = chosen_sdpa()
        self.exact = M.shard_images(self.work / "run")
        if self.base:
            self.ref = M.read_outputs(self.work / "baseline", self.base["n"])
            sg["psnr_vs_baseline"] = M.psnr_stats(self.exact, self.ref)
        self.rep.put("shardgen", sg)
        say(f"shardgen: {sg['n']} {self.unit}s in {sg['wall_s']:.1f} s = {sg['images_per_hour']:.0f} {self.unit}s/hour steady; "
            f"{sg['recompiles_after_first_batch']} graphs compiled after the first batch")
        return warm, sg

    def _warmup(self) -> dict:
        limit = f"prompts.limit={min(self.args.batch, self.args.n)}"
        t0 = time.perf_counter()
        warm = run_shardgen(self.pipe, compose(self.common + [f"run_dir={self.work / 'warmup'}", limit]),
                            self.device, self.timer)
        if warm["failed"]:  # e.g. the chosen attention kernel does not compile here: say why, retry with torch's choice
            why = first_failure(self.work / "warmup")
            say(f"shardgen warm-up: {warm['failed']} samples FAILED ({why}); retrying with sdpa_backend=default")
            self.rep.put("warmup_failure", why)
            self.common.append("sdpa_backend=default")
            self.cfg = compose(self.common + [f"run_dir={self.work / 'run'}"])
            warm = run_shardgen(self.pipe, compose(self.common + [f"run_dir={self.work / 'warmup2'}", limit]),
                                self.device, self.timer)
        warm["wall_s"] = time.perf_counter() - t0
        self.rep.put("shardgen_warmup", warm)
        say(f"shardgen warm-up (one batch of {warm['n']}): {warm['wall_s']:.1f} s")
        return warm

    def accel_runs(self, sg: dict) -> dict:
        """Each opt-in or diagnostic run, against the exact run's steady batches and images."""
        a, results = self.args, {}
        acc_n = a.accel_n or min(a.n, 3 * a.batch)
        exact_steady = sg.get("steady_s_per_image") or sg["s_per_image"]
        for name in self.accels:
            kind = "diagnostic" if name in DIAGNOSTICS else "opt-in"
            try:
                acfg = compose(self.common + ACCELS[name](a) + [f"run_dir={self.work / ('run-' + name)}",
                                                                f"prompts.limit={acc_n}"])
                r = run_shardgen(self.pipe, acfg, self.device, self.timer, before=fbc_counter if "fbc" in name else None,
                                 skip_first=1 if any(k in name for k in RECOMPILING) else 0)
                imgs = M.shard_images(self.work / f"run-{name}")
                r.update(speedup_vs_exact=exact_steady / r["steady_s_per_image"],
                         psnr_vs_exact=M.psnr_stats(imgs, self.exact))
                main = "the lossy main" if self.lossy else "the exact"
                line = (f"{name}: {r['steady_s_per_image']:.2f} s/image steady ({r['speedup_vs_exact']:.2f}x {main} "
                        f"run), PSNR vs it {M.fmt_db(r['psnr_vs_exact']['mean'])} dB mean")
                if self.base and (vb := M.psnr_stats(imgs, self.ref))["n"]:
                    r["psnr_vs_baseline"] = vb["mean"]
                    line += f", vs baseline {M.fmt_db(vb['mean'])} dB mean over {vb['n']}"
                say(f"{kind} {line}")
            except Exception as e:  # report and go on: the main figures stand without it
                import traceback

                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {e}"[:1000]}
                say(f"{kind} {name}: FAILED ({r['error'][:200]})")
            results[name] = r
            self.rep.put("accel", results)
        return results


def run(args) -> dict:
    """The whole benchmark for parsed ``args``; returns what bench.json holds."""
    from shardgen.run.runner import quiet_libraries

    quiet_libraries()
    b = Bench(args)
    env = b.env()
    b.rep.put("env", env)
    frames = f", {b.cfg.num_frames} frames" if is_video(b.cfg) else ""
    say(f"== jobs.bench: {args.model} ({args.weights} weights, {b.cfg.dtype}), {b.height}x{b.width}{frames}, {b.cfg.steps} "
        f"steps, {args.n} prompts, batch {args.batch}, compile={env['compile']}, on {env['device']} ==")
    if b.lossy:
        say("the measured run is LOSSY (" + ", ".join(f"{k}={v}" for k, v in b.lossy.items()) + "): its MFU counts its "
            f"FLOPs against the {b.cfg.dtype} matmul rate, and the opt-in runs compare against it, not an exact run"
            + (f"; left out, as it repeats it: {', '.join(b.repeats)}" if b.repeats else ""))
    peak = M.matmul_peak(b.device, b.dtype)
    b.rep.put("matmul_peak", peak)
    say(f"{peak['dtype']} matmul rate (measured, best of {list(peak['per_size'])}): {peak['tflops']:.1f} TFLOP/s")
    b.build()
    if not args.skip_baseline:
        b.baseline()
    if getattr(args, "baseline_only", False):  # benchmarks/real_runs.py: the seed loop's rate, nothing else
        b.timer.remove()
        return b.rep.data
    flops = b.flops()
    if b.base:
        b.base["mfu_denoise"], b.base["mfu_e2e"] = b.mfu(b.base)
        b.rep.put("baseline", b.base)
    warm, sg = b.shardgen()
    acc = b.accel_runs(sg)
    b.timer.remove()
    b.rep.put("summary", summary(args, env, peak, flops, b.base, warm, sg, acc, unit=b.unit))
    if not args.keep and not args.workdir:
        shutil.rmtree(b.work, ignore_errors=True)
    return b.rep.data
