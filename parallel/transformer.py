"""The model's transformer, as the strategies see it: its class and config read without any weight
(validation and ``auto`` decide from them), the tokens one prompt puts through it, and loading its
pretrained weights split over ranks (tp) or GPUs (device_map).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parallel.dims import ParallelConfigError

if TYPE_CHECKING:
    import torch

    from shardgen.config.schema import GenerateConfig, ModelConfig

# text tokens the transformer sees per prompt: a config key (padded to it), or None when it varies per batch
TEXT_TOKENS = {"FluxPipeline": "max_sequence_length", "Flux2Pipeline": "max_sequence_length",
               "QwenImagePipeline": None}
UNSPLIT_TEXT = ("WanPipeline",)  # Wan's _cp_plan splits the video tokens only (its text feeds cross-attention)
LATENT_PATCH = 16  # pixels per image token: VAE downscale 8 x 2x2 latent patches (FLUX.1/2, Qwen-Image)
HALF_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class TransformerInfo:
    """The transformer class name and config of a model, read without loading any weight."""

    cls_name: str
    config: dict = field(default_factory=dict)
    source: str = ""

    @property
    def heads(self) -> int | None:
        return self.config.get("num_attention_heads")

    @property
    def hidden(self) -> int | None:
        h, d = self.heads, self.config.get("attention_head_dim")
        return h * d if h and d else None

    def model_class(self):
        import diffusers

        return getattr(diffusers, self.cls_name, None)

    def plan(self, kind: str):
        """The class's ``_tp_plan`` or ``_cp_plan`` (None when it has none)."""
        cls = self.model_class()
        return getattr(cls, f"_{kind}_plan", None) if cls is not None else None


def _hub_file(repo: str, filename: str, revision: str | None) -> Path | None:
    """A file of a hub model from the local Hugging Face cache only (no network: no hub is assumed reachable)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo, filename, revision=revision)
    except Exception:
        return None
    return Path(hit) if isinstance(hit, str) else None


def transformer_info(model_cfg: ModelConfig) -> TransformerInfo:
    """The transformer's class and config: the embedded tiny one, the dummy architecture, or config.json."""
    if model_cfg.weights == "dummy":
        from shardgen.models.dummy import dummy_architecture
        from shardgen.models.loader import dummy_arch

        spec = dummy_architecture(dummy_arch(model_cfg) or model_cfg.pipeline)["transformer"]
        return TransformerInfo(spec.cls, dict(spec.config), f"the dummy {model_cfg.pipeline} architecture")
    if model_cfg.source == "tiny":
        from shardgen.models.tiny import TRANSFORMER_CONFIG

        return TransformerInfo("FluxTransformer2DModel", dict(TRANSFORMER_CONFIG), "shardgen.models.tiny.TRANSFORMER_CONFIG")
    if model_cfg.source == "tiny_video":
        from shardgen.models import tiny_video

        return TransformerInfo("WanTransformer3DModel", dict(tiny_video.TRANSFORMER_CONFIG),
                               "shardgen.models.tiny_video.TRANSFORMER_CONFIG")
    path = Path(os.path.expanduser(model_cfg.source)) / "transformer" / "config.json"
    if not path.is_file():
        path = _hub_file(model_cfg.source, "transformer/config.json", model_cfg.revision)
    if path is None:
        raise ParallelConfigError(
            f"cannot read the transformer config of model.source={model_cfg.source!r} (not a local diffusers directory "
            "and not in the Hugging Face cache) to check the parallel degrees against it; download the model and point "
            "model.source at its directory")
    config = json.loads(path.read_text())
    return TransformerInfo(config.get("_class_name", "?"), config, str(path))


def image_tokens(height: int, width: int) -> int:
    """Image tokens of one ``height`` x ``width`` image (FLUX.1/2, Qwen-Image: 16 pixels a side per token)."""
    return (height // LATENT_PATCH) * (width // LATENT_PATCH)


def latent_frames(cfg: GenerateConfig) -> int:
    """Frames the transformer sees: Wan's VAE compresses num_frames = 4k+1 into k+1 (1 for image models)."""
    n = cfg.get("num_frames")
    return 1 if n is None else (n - 1) // 4 + 1


def sequence_tokens(cfg: GenerateConfig) -> tuple[int, int | None]:
    """(image or video tokens, text tokens) one prompt puts through the transformer; text None when it varies."""
    image = image_tokens(cfg.height, cfg.width) * latent_frames(cfg)
    if cfg.model.pipeline in UNSPLIT_TEXT:
        return image, 0  # nothing to divide
    key = TEXT_TOKENS.get(cfg.model.pipeline)
    return image, (cfg.model[key] if key else None)


def load_transformer(model_cfg: ModelConfig, dtype: torch.dtype, purpose: str, **from_pretrained: Any):
    """The pretrained transformer of ``model_cfg``, read off its safetensors files; ``from_pretrained`` says how
    it is split (``parallel_config=`` for tp, ``device_map=``/``max_memory=`` for device_map)."""
    import diffusers

    from shardgen.models.loader import ModelLoadError, check_safetensors_only, resolve_source

    cls = getattr(diffusers, transformer_info(model_cfg).cls_name)
    source = resolve_source(model_cfg)
    check_safetensors_only(source)
    try:
        return cls.from_pretrained(source, subfolder="transformer", torch_dtype=dtype, revision=model_cfg.revision,
                                   use_safetensors=True, **from_pretrained)
    except (OSError, EnvironmentError) as e:
        hint = "" if os.path.isdir(source) else (
            " No model hub may be reachable: point model.source at a local directory.")
        raise ModelLoadError(f"cannot load the transformer of model.source={source!r}{purpose}: {e}.{hint}") from e
