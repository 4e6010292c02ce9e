"""Build or load the diffusers pipeline a run asks for: the tiny embedded model, a pretrained
pipeline (hub id or local directory, safetensors only), or the real architecture with dummy weights.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import torch
from shardgen.errors import ConfigError
from shardgen.models.compat import guard_ftfy
from shardgen.models.errors import ModelLoadError, hub_message, local_source_problem  # ModelLoadError: where callers found it
from shardgen.models.versions import model_version  # noqa: F401 (where callers found it)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config string, with an error listing the valid names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r} is not supported; use one of {sorted(DTYPES)}") from None


def resolve_source(model_cfg: Any) -> str:
    """The directory or hub id ``from_pretrained`` reads; builds an embedded tiny model (``ModelFamily.tiny_models``)
    on first use."""
    from shardgen.families import tiny_model

    tiny = tiny_model(model_cfg.source)
    return str(tiny.path(model_cfg.cache_dir)) if tiny is not None else str(model_cfg.source)


def component_params(model_cfg: Any) -> dict[str, int] | None:
    """Parameters per component (transformer, text encoders, VAE), without reading any weight: the dummy
    architecture's, or those a local diffusers directory's safetensors headers declare; None when ``model.source`` is
    no local diffusers directory (a hub id: nothing to count without downloading it)."""
    if model_cfg.weights == "dummy":
        from shardgen.models.dummy import dummy_params

        return dummy_params(model_cfg.name, pipeline=model_cfg.pipeline)
    root = Path(os.path.expanduser(resolve_source(model_cfg)))
    if not (root / "model_index.json").is_file():
        return None
    return {d.name: n for d in sorted(root.iterdir()) if d.is_dir() and (n := _safetensors_params(d))}


def _safetensors_params(folder: Path) -> int:
    """Parameters in a folder's safetensors files, from their headers (no tensor is read)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def is_tiny(model_cfg: Any) -> bool:
    """Whether ``model.source`` names an embedded tiny model."""
    from shardgen.families import tiny_model

    return tiny_model(model_cfg.source) is not None


def check_source(model_cfg: Any) -> None:
    """ConfigError when a pretrained ``model.source`` written as a local path names no diffusers model directory,
    or names a hub id that is not in the Hugging Face cache while ``HF_HUB_OFFLINE`` forbids downloading it (other
    hub ids are left to loading, which alone may reach a hub)."""
    if model_cfg.weights == "pretrained" and not is_tiny(model_cfg):
        problem = local_source_problem(model_cfg.source) or _offline_problem(model_cfg)
        if problem is not None:
            raise ConfigError(problem)


def _offline_problem(model_cfg: Any) -> str | None:
    """Why a hub id cannot load under ``HF_HUB_OFFLINE`` (not in the cache), found without reaching any hub; None
    when online, cached, or a local directory."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    source = str(model_cfg.source)
    if not constants.HF_HUB_OFFLINE or os.path.isdir(os.path.expanduser(source)):
        return None
    if _hub_snapshot(source, model_cfg.revision) is not None:
        return None
    return (f"model.source={source}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE "
            f"forbids downloading it; download it where a hub is reachable (hf download {source}) into that "
            "cache, or point model.source at a local copy of the model directory")


def model_sha256(model_cfg: Any) -> str | None:
    """The content hash of the weights a launch will read (shardgen/models/content.py), for the fingerprint: the tiny
    models' cache entries and local model directories; None for dummy weights and hub ids (no local bytes)."""
    from shardgen.models.content import content_sha256
    from shardgen.cache import default_cache_dir

    if model_cfg.weights == "dummy":
        return None
    source = resolve_source(model_cfg)
    if not os.path.isdir(source):
        source = _hub_snapshot(source, model_cfg.revision)
        if source is None:
            return None
    check_regular_files(Path(source))  # before anything opens one of them
    if is_tiny(model_cfg):
        cache_root = Path(source).parent  # the tiny builds record their hash where they are built
    else:
        cache_root = Path(os.path.expanduser(model_cfg.cache_dir)) if model_cfg.cache_dir else default_cache_dir()
    try:
        return content_sha256(source, cache_root)
    except OSError as e:
        raise ModelLoadError(f"cannot read model.source={source!r} ({e.filename}: {e.strerror or e}); fix its "
                             "permissions or point model.source at a readable copy") from None


def _hub_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The local snapshot directory of a hub model already in the Hugging Face cache (never downloads); None when
    it is not there (``from_pretrained`` then says what is missing)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not cached, not a repo id, no huggingface_hub: nothing local to hash
        return None


def check_safetensors_only(path: str) -> None:
    """Refuse a local model directory that only has pickle checkpoints (they can run arbitrary code)."""
    p = Path(path)
    if not p.is_dir():
        return
    check_regular_files(p)
    files = [f for f in p.rglob("*") if f.is_file()]
    weights = [f for f in files if f.suffix in PICKLE_SUFFIXES or f.suffix == ".safetensors"]
    pickles = [f for f in weights if f.suffix in PICKLE_SUFFIXES]
    if pickles and not any(f.suffix == ".safetensors" for f in weights):
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({', '.join(str(f.relative_to(p)) for f in pickles[:3])}); "
            "shardgen loads safetensors only, since a pickle can run arbitrary code. Convert the weights "
            "(e.g. load them once in a trusted environment and save_pretrained(..., safe_serialization=True)).")


def check_regular_files(directory: Path) -> None:
    """ModelLoadError naming a FIFO, socket or device in a model directory: whatever opened it (from_pretrained, the
    memory check reading the safetensors headers) would block."""
    special = next((f for f in Path(directory).rglob("*") if _special(f)), None)
    if special is not None:
        raise ModelLoadError(f"{special} in the model directory is not a regular file (a FIFO, socket or device); "
                             "replace it by the file it should be, or copy the model directory again")


def _special(path: Path) -> bool:
    try:
        mode = path.stat().st_mode
    except OSError:  # a broken link (a hub cache's unused file): from_pretrained names it if it is needed
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def pipeline_class(name: str):
    """The diffusers pipeline class called ``name``."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ModelLoadError(f"model.pipeline={name!r} is not a diffusers pipeline class in diffusers {diffusers.__version__}")
    return cls


def pipeline_module(name: str) -> str | None:
    """The module that defines the diffusers pipeline class called ``name``, found without importing it (through
    diffusers' lazy packages), or None where diffusers does not say."""
    import importlib
    import importlib.util

    module_name = "diffusers"
    try:
        # diffusers -> diffusers.pipelines -> diffusers.pipelines.flux -> diffusers.pipelines.flux.pipeline_flux
        while (spec := importlib.util.find_spec(module_name)) and spec.submodule_search_locations is not None:
            sub = getattr(importlib.import_module(module_name), "_class_to_module", {}).get(name)
            if sub is None:
                return None
            module_name = f"{module_name}.{sub}"
    except ImportError:
        return None
    return module_name if spec else None


def own_components(model_cfg: Any, source: str) -> dict[str, Any]:
    """The components the pipeline's family loads with its own classes (``ModelFamily.own_components``), by name,
    for ``from_pretrained``, which then takes them instead of building the classes ``model_index.json`` names."""
    from shardgen.families import family_for

    return {name: own_class().from_pretrained(source, subfolder=name, revision=model_cfg.revision)
            for name, own_class in family_for(model_cfg.pipeline).own_components.items()}


def load_pipeline(model_cfg: Any, dtype: torch.dtype, device: torch.device | str | None,
                  **from_pretrained_kwargs) -> Any:
    """Load the pipeline in ``dtype``; move it to ``device`` unless that is None (strategies place it).

    Extra kwargs go to ``from_pretrained`` (e.g. ``device_map`` for the device_map strategy).
    """
    cls = pipeline_class(model_cfg.pipeline)
    guard_ftfy(cls)
    if model_cfg.weights == "dummy":
        from shardgen.models.dummy import build_dummy_pipeline

        return build_dummy_pipeline(model_cfg.name, device or "cpu", dtype, pipeline=model_cfg.pipeline)
    if model_cfg.weights != "pretrained":
        raise ModelLoadError(f"model.weights={model_cfg.weights!r}: use pretrained or dummy")
    source = resolve_source(model_cfg)
    check_safetensors_only(source)
    try:
        own = own_components(model_cfg, source)
        pipe = cls.from_pretrained(source, dtype=dtype, revision=model_cfg.revision, use_safetensors=True,
                                   **own, **from_pretrained_kwargs)
    except (OSError, EnvironmentError, ValueError) as e:
        problem = None if is_tiny(model_cfg) else local_source_problem(source)
        if problem:  # a local path that went away since the launch checked it
            raise ModelLoadError(problem) from e
        hint = "" if os.path.isdir(source) else (
            " No model hub may be reachable from here: download the model where one is and point "
            "model.source at the local directory.")
        if os.path.isdir(source):
            hint = " A file of the model may be damaged (a copy cut short): copy the model directory again."
        if is_tiny(model_cfg):
            hint = f" The cached build is damaged: delete {source}: it is built again on the next launch."
        raise ModelLoadError(f"cannot load model.source={source!r} with {model_cfg.pipeline}: {hub_message(e)}."
                             f"{hint}") from e
    pipe.set_progress_bar_config(disable=True)
    if device is not None:
        pipe.to(device)
    return pipe
