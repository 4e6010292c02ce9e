"""Checks on a composed config that need no device or weight (of files, only the LoRA adapters' headers are read):
they run first, everywhere."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from shardgen.config.launchers import LAUNCHERS
from shardgen.config.sizes import parse_bytes
from shardgen.dataio.prompts import MAX_SEED, MAX_SIDE, ROW_SETTINGS, prompt_formats, unknown_names
from shardgen.dataio.rundir import check_run_dir_text, is_url, near_url_advice
from shardgen.dataio.rundir.remote import ambiguous_folder, plain_folder
from shardgen.dataio.shards import IMAGE_EXTS, Signals, container_names, validate_video_config
from shardgen.models.loader import DTYPES
from shardgen.models.settings import check_model_settings
from shardgen.errors import ConfigError, UserError

MAX_IMAGES_PER_PROMPT = 1000

if TYPE_CHECKING:
    from shardgen.config.schema import GenerateConfig

PARTI_URL = "https://github.com/google-research/parti/blob/main/PartiPrompts.tsv"
# What to set for each value a config group leaves mandatory (``???`` in its YAML).
MANDATORY = {
    "prompts.path": "prompts.path=FILE, the prompt file to read (a relative path is taken from the current directory; "
                    "a URL such as s3://bucket/captions.parquet is read where it is)",
    "signals.clip.model": "signals.clip.model=PATH, a transformers CLIPModel directory with its processor files "
                          "(or leave clip out of signals=[...])",
    "model.source": "model.source=HUB_ID_OR_DIR, the diffusers pipeline to load (safetensors only)",
    "model.name": "model.name=NAME, the model's short name in sample metadata",
}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_mandatory(cfg: GenerateConfig) -> None:
    """ConfigError naming every value the chosen config groups leave unset (``???``), and what to set."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if not missing:
        return
    lines = []
    for key in missing:
        hint = MANDATORY.get(key, f"{key}=VALUE (its docstring: shardgen/config/schema.py)")
        if key == "prompts.path" and cfg.prompts.get("field") == "Prompt":  # prompts=parti
            hint += f"; PartiPrompts.tsv is at {PARTI_URL} (download it, then prompts.path=PartiPrompts.tsv)"
        lines.append(f"{key} is not set: set {hint}")
    raise ConfigError("; ".join(lines))


def validate_config(cfg: GenerateConfig) -> None:
    """Raise ConfigError for the first impossible setting (first: a mandatory value left unset)."""
    check_mandatory(cfg)
    _check_finite(cfg)
    _need(cfg.image_format in IMAGE_EXTS, f"image_format={cfg.image_format!r}: use one of {list(IMAGE_EXTS)}")
    _need(1 <= cfg.image_quality <= 100, f"image_quality={cfg.image_quality}: use 1..100")
    _need(cfg.prompts.max_prompt_chars >= 1,
          f"prompts.max_prompt_chars={cfg.prompts.max_prompt_chars}: use 1 or more")
    negative = cfg.model.get("negative_prompt")
    _need(negative is None or len(negative) <= cfg.prompts.max_prompt_chars,
          f"model.negative_prompt is {len(negative or '')} characters long, over prompts.max_prompt_chars="
          f"{cfg.prompts.max_prompt_chars}: shorten it")
    _need(cfg.batch_size >= 1, f"batch_size={cfg.batch_size}: use 1 or more")
    _need(cfg.samples_per_shard is None or cfg.samples_per_shard >= 1,
          f"samples_per_shard={cfg.samples_per_shard}: use 1 or more, or null (chosen for the run)")
    _need(cfg.plan_replicas is None or cfg.plan_replicas >= 1,
          f"plan_replicas={cfg.plan_replicas}: use 1 or more (the replicas all launches of the run bring), or null "
          "(this launch's)")
    _need(cfg.steps >= 1, f"steps={cfg.steps}: use 1 or more")
    n = cfg.images_per_prompt
    _need(1 <= n <= MAX_IMAGES_PER_PROMPT, f"images_per_prompt={n}: use 1 to {MAX_IMAGES_PER_PROMPT}")
    _need(cfg.samples_per_shard is None or cfg.samples_per_shard % n == 0,
          f"samples_per_shard={cfg.samples_per_shard}: a shard holds whole prompts, images_per_prompt={n} images "
          f"each: use a multiple of {n} (e.g. samples_per_shard={max(n, (cfg.samples_per_shard or 0) // n * n)}), "
          "or leave it unset")
    # the ranges a prompt row's seed and guidance are held to (shardgen/dataio/prompts/read.py, rowsettings.py)
    _need(0 <= cfg.seed <= MAX_SEED, f"seed={cfg.seed} is out of range: write an integer from 0 to 2**63-1")
    _need(cfg.guidance >= 0, f"guidance={cfg.guidance:g} is out of range: write a number from 0 up")
    for key in ("height", "width"):
        v = cfg[key]
        _need(v >= 16 and v % 16 == 0, f"{key}={v}: must be a positive multiple of 16 (the VAE downscales by 8 "
                                        "and the transformer packs 2x2 latent patches)")
        _need(v <= MAX_SIDE, f"{key}={v}: over {MAX_SIDE} pixels a side (the most a row may ask for too); use "
                             f"16..{MAX_SIDE}")
    _need(cfg.dtype in DTYPES, f"dtype={cfg.dtype!r}: use one of {sorted(DTYPES)}")
    _need(cfg.model.weights in ("pretrained", "dummy"), f"model.weights={cfg.model.weights!r}: use pretrained or dummy")
    formats = list(prompt_formats())
    _need(cfg.prompts.format in ["auto", *formats],
          f"prompts.format={cfg.prompts.format!r}: use auto or one of {formats}")
    _need(cfg.prompts.on_bad_row in ("error", "skip"), f"prompts.on_bad_row={cfg.prompts.on_bad_row!r}: use error or skip")
    _need(cfg.prompts.on_truncation in ("warn", "error", "skip"),
          f"prompts.on_truncation={cfg.prompts.on_truncation!r}: use warn, error or skip")
    bad = unknown_names(cfg.prompts.get("row_settings"))
    _need(not bad, f"prompts.row_settings: {', '.join(map(repr, bad))} cannot be set per row: list only "
                   f"{', '.join(ROW_SETTINGS)} (other columns stay metadata anyway)")
    Signals(cfg.get("signals")).check(cfg.width, cfg.height)
    _need(cfg.prompts.limit is None or cfg.prompts.limit >= 1, f"prompts.limit={cfg.prompts.limit}: use 1 or more, or null")
    _need(cfg.launcher.name in LAUNCHERS, f"launcher.name={cfg.launcher.name!r}: use one of {list(LAUNCHERS)}")
    problem = LAUNCHERS[cfg.launcher.name].check(cfg.launcher)
    _need(problem is None, problem or "")
    _need(cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:"),
          f"device={cfg.device!r}: use auto, cpu or cuda")
    _need(cfg.lease_s > 0, f"lease_s={cfg.lease_s}: use a positive number of seconds (a claim's heartbeat older "
                           "than this is taken over)")
    _need(0 < cfg.heartbeat_s < cfg.lease_s, f"heartbeat_s={cfg.heartbeat_s}: use a positive number of seconds below "
                                             f"lease_s={cfg.lease_s} (a live claim would otherwise look dead)")
    _need(not (cfg.cfg_batching and cfg.cfg_degree > 1),
          "cfg_batching=true runs both CFG branches in one call on every rank, cfg_degree=2 splits them over two "
          "ranks: choose one (cfg_batching=false or cfg_degree=1)")
    _need(cfg.writer_threads >= 1, f"writer_threads={cfg.writer_threads}: use 1 or more")
    containers = container_names()
    _need(cfg.shard_container in containers,
          f"shard_container={cfg.shard_container!r}: use one of {containers}")
    _need(cfg.stall_timeout_s is None or cfg.stall_timeout_s > 0,
          f"stall_timeout_s={cfg.stall_timeout_s}: use seconds > 0, or null to never time out a batch")
    _check_calibration(cfg)
    _check_images(cfg)
    _check_max_memory(cfg.strategy.get("max_memory"))
    # where the run and its shards are kept: run_dir, output_uri, and the URLs' credentials
    check_run_dir_text(cfg.run_dir)
    _need(not cfg.output_uri or is_url(cfg.output_uri), f"output_uri={cfg.output_uri!r}: use a URL such as "
          "s3://bucket/run/ (the local copy is run_dir/shards already)")
    _need(not cfg.output_uri or not ambiguous_folder(str(cfg.output_uri)),
          f"output_uri={cfg.output_uri}: an empty, '.' or '..' folder name (as in //) is a key object stores keep "
          "and fsspec normalises away, so the shards would be written and read back under different keys; write "
          f"output_uri={plain_folder(str(cfg.output_uri))}")
    prompts_at = str(cfg.prompts.path or "")
    if (advice := near_url_advice(prompts_at, "prompts.path")) and not os.path.lexists(os.path.expanduser(prompts_at)):
        raise ConfigError(advice)  # prompts.path=s3:/bucket/p.txt: a typo for the URL, not a file missing locally
    for key, url in (("output_uri", cfg.output_uri), ("prompts.path", cfg.prompts.path)):
        _need(not (url and is_url(url) and urlsplit(str(url)).password is not None),
              f"{key}: a URL with a password in it would be written into the run directory and its logs; give "
              "the credentials through the environment or the storage client's config files instead")
    _need(not (cfg.output_uri and is_url(cfg.run_dir)),
          f"run_dir={cfg.run_dir} keeps the run in the bucket, its shards under {str(cfg.run_dir).rstrip('/')}/shards/ "
          f"already: leave output_uri unset (or keep run_dir local to send the shards to output_uri={cfg.output_uri})")
    _need(cfg.keep_local or bool(cfg.output_uri) or is_url(cfg.run_dir), "keep_local=false deletes local shards once uploaded: set output_uri "
          "too (output_uri=s3://bucket/run/), or keep_local=true")
    check_model_settings(cfg)  # the model's own: its source, scheduler and adapters
    validate_video_config(cfg)  # num_frames, fps, codec, crf (video models only)
    from shardgen.speed.accel import AccelError, AccelOptions, validate as validate_accel

    import torch

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        validate_accel(AccelOptions.from_cfg(cfg), device)
    except AccelError as e:
        raise ConfigError(str(e)) from None


def _check_calibration(cfg: GenerateConfig) -> None:
    """The quality gate's keys (shardgen/quality/gate.py)."""
    from shardgen.quality.gate import FALLBACKS

    _need(cfg.calibrate_samples >= 0, f"calibrate_samples={cfg.calibrate_samples}: use 0 (off) or a number of samples")
    _need(cfg.calibrate_min_psnr >= 0, f"calibrate_min_psnr={cfg.calibrate_min_psnr:g}: use dB >= 0 (0 = no bound)")
    _need(0 <= cfg.calibrate_min_ssim <= 1, f"calibrate_min_ssim={cfg.calibrate_min_ssim:g}: use 0..1 (0 = no bound)")
    _need(cfg.calibrate_fallback in FALLBACKS,
          f"calibrate_fallback={cfg.calibrate_fallback!r}: use one of {list(FALLBACKS)}")
    bounded = cfg.calibrate_min_psnr > 0 or cfg.calibrate_min_ssim > 0 or cfg.calibrate_max_lpips > 0
    _need(not bounded or cfg.calibrate_samples > 0, "calibrate_min_psnr/calibrate_min_ssim/calibrate_max_lpips bound "
          "the calibration samples: set calibrate_samples=N (e.g. 4) too")
    _check_gate_lpips(cfg)


def _check_gate_lpips(cfg: GenerateConfig) -> None:
    """The gate's LPIPS keys: a bound needs both weight files, one file needs the other, and the files must load
    (before anything is built: LpipsWeightsError names the key and the file)."""
    from shardgen.pick import pick
    from shardgen.quality.gate import Bounds, load_gate_lpips
    from shardgen.quality.lpips import MIN_SIDE

    _need(cfg.calibrate_max_lpips >= 0, f"calibrate_max_lpips={cfg.calibrate_max_lpips:g}: use a number >= 0 (0 = no "
          "bound)")
    backbone, layers = cfg.calibrate_lpips_backbone, cfg.calibrate_lpips_layers
    _need(bool(backbone) == bool(layers), "LPIPS needs both weight files: set calibrate_lpips_backbone (torchvision's "
          "AlexNet state dict, alexnet-owt-7be5be79.pth) and calibrate_lpips_layers (the lpips package's "
          "weights/v0.1/alex.pth)")
    _need(not cfg.calibrate_max_lpips or backbone, f"calibrate_max_lpips={cfg.calibrate_max_lpips:g} needs the LPIPS "
          "weight files: set calibrate_lpips_backbone and calibrate_lpips_layers (docs/lossy.md)")
    _need(not backbone or min(cfg.height, cfg.width) >= MIN_SIDE, f"LPIPS needs samples of at least {MIN_SIDE}x"
          f"{MIN_SIDE} pixels (AlexNet's first layers), not {cfg.height}x{cfg.width}: leave calibrate_lpips_backbone "
          "and calibrate_lpips_layers unset, or make larger samples")
    if backbone and cfg.calibrate_samples > 0:
        load_gate_lpips(pick(Bounds, cfg), device="cpu")


def _check_images(cfg: GenerateConfig) -> None:
    """Rows name input images only for a model that takes them, and a model that needs one per row gets them."""
    from shardgen.families import family_for

    fam, names = family_for(cfg.model.pipeline), set(cfg.prompts.get("row_settings") or ())
    _need(not ({"image", "strength"} & names) or fam.input_image,
          f"prompts.row_settings names {'image' if 'image' in names else 'strength'}, and model.pipeline="
          f"{cfg.model.pipeline} takes no input image: use an image-to-image, edit or image-to-video model (e.g. "
          "model=tiny_img2img, flux_dev_img2img), or remove image and strength from prompts.row_settings")
    _need("strength" not in names or fam.strength,
          f"prompts.row_settings names strength, and model.pipeline={cfg.model.pipeline} takes none (only "
          "image-to-image pipelines do): remove strength from prompts.row_settings")
    _need(fam.input_image != "required" or "image" in names,
          f"model.pipeline={cfg.model.pipeline} makes each sample from an input image: add image to "
          "prompts.row_settings (prompts.row_settings=[image]) and name each row's image in that field or column")
    if fam.input_image == "required" and cfg.prompts.get("path"):
        from shardgen.dataio.prompts import detect_format

        try:
            fmt = detect_format(str(cfg.prompts.path), cfg.prompts.format)
        except UserError:
            fmt = None  # named when the prompt file is read
        _need(fmt != "txt", f"model.pipeline={cfg.model.pipeline} makes each sample from an input image, and a txt "
              "prompt file has no field to name one: use jsonl, csv/tsv or parquet with an image field or column")
    strength = cfg.model.strength
    _need(not fam.strength or (isinstance(strength, (int, float)) and 0.0 < strength <= 1.0),
          f"model.strength={strength}: use a number above 0 and at most 1 (1 = the input image replaced by noise)")
    _need(not fam.strength or int(cfg.steps * strength) >= 1,  # as a row's own strength is checked while planning
          f"model.strength={strength:g} of steps={cfg.steps} is less than one denoising step, so every sample would "
          f"fail: use model.strength={1 / cfg.steps:g} or more, or more steps")


def _check_finite(cfg: Any) -> None:
    """ConfigError naming the first setting that is inf or nan (a number no model can use, and no JSON file holds:
    the run's fingerprint and every sample's json record them)."""
    from omegaconf import OmegaConf

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")
        elif isinstance(node, float) and not math.isfinite(node):
            example = _finite_example(key)
            raise ConfigError(f"{key}={node}: not a finite number; give a number"
                              + (f" (e.g. {key}={example:g})" if example is not None else ""))

    walk(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False), "")


# A typical value where the schema's default is none or not one to suggest (a key's list indexes written [])
FINITE_EXAMPLES = {"guidance": 3.5, "model.loras[].scale": 0.8, "model.guidance_2": 3.5}


def _finite_example(key: str) -> float | None:
    """A value to suggest for the number setting ``key``: FINITE_EXAMPLES, else its default in the schema
    (shardgen/config/schema.py; within the key's range, e.g. model.strength=0.6), else None."""
    import dataclasses
    import re
    import typing

    from shardgen.config.schema import GenerateConfig

    generic = re.sub(r"\[\d+\]", "[]", key)
    if generic in FINITE_EXAMPLES:
        return FINITE_EXAMPLES[generic]
    cls: Any = GenerateConfig
    parts = generic.split(".")
    for i, part in enumerate(parts):
        name = part.removesuffix("[]")
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if name not in fields:
            return None
        if i == len(parts) - 1:
            default = fields[name].default
            ok = isinstance(default, (int, float)) and not isinstance(default, bool) and math.isfinite(default)
            return float(default) if ok else None
        try:
            cls = typing.get_type_hints(cls)[name]
        except Exception:
            return None
        if part.endswith("[]"):
            cls = next(iter(typing.get_args(cls)), None)
    return None


def _check_max_memory(max_memory: Any) -> None:
    if max_memory is None:
        return
    for size in max_memory.values() if hasattr(max_memory, "values") else [max_memory]:  # per GPU, or one for all
        try:
            parse_bytes(size)
        except ValueError as e:
            raise ConfigError(f"strategy.max_memory: {e} (one for every GPU: strategy.max_memory=70GiB)") from None
