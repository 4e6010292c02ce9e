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
from shardgen.families import ModelFamily, family_for

if TYPE_CHECKING:
    import torch

    from shardgen.config.schema import GenerateConfig, ModelConfig

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

        spec = dummy_architecture(model_cfg.name, pipeline=model_cfg.pipeline)["transformer"]
        return TransformerInfo(spec.cls, dict(spec.config), f"the dummy {model_cfg.pipeline} architecture")
    from shardgen.families import tiny_model

    tiny = tiny_model(model_cfg.source)
    if tiny is not None:
        return TransformerInfo(tiny.transformer_class, dict(tiny.transformer_config()),
                               f"the embedded {model_cfg.source} model's transformer config")
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


def model_family(cfg: GenerateConfig) -> ModelFamily:
    """The family of the run's pipeline (shardgen/families/): its token, patch and frame rules."""
    return family_for(cfg.model.pipeline)


def latent_frames(cfg: GenerateConfig) -> int:
    """Frames the transformer sees (Wan: num_frames = 4k+1 gives k+1; 1 for image models)."""
    return model_family(cfg).latent_frames(cfg.get("num_frames"))


def sequence_tokens(cfg: GenerateConfig) -> tuple[int, int | None]:
    """(image or video tokens, text tokens) one prompt puts through the transformer; text None when it varies,
    0 when context parallelism does not split it (it only feeds cross-attention)."""
    family = model_family(cfg)
    image = family.image_tokens(cfg.height, cfg.width) * latent_frames(cfg)
    key = family.text_tokens
    return image, (family.text_prefix_tokens + cfg.model[key] if key else (0 if key == "" else None))


def input_image_tokens(cfg: GenerateConfig, height: int | None = None, width: int | None = None) -> int:
    """Latent tokens a row's input image adds to the transformer's sequence for a sample of ``height`` x ``width``
    (default: the run's): those of the image at the size it is fitted to, for an edit model whose input joins the
    sample's tokens (``ModelFamily.image_in_sequence``) in a run whose rows name images; else 0."""
    family = model_family(cfg)
    if not family.image_in_sequence or "image" not in (cfg.prompts.get("row_settings") or ()):
        return 0
    from shardgen.models.condition import input_size

    width, height = input_size(width or cfg.width, height or cfg.height, family.input_image_area)
    return family.image_tokens(height, width)


def split_image_tokens(cfg: GenerateConfig, tokens: int, height: int | None = None, width: int | None = None
                       ) -> list[int]:
    """The image-side token counts context parallelism splits for samples of ``tokens`` image tokens at ``height``
    x ``width`` (default: the run's): the sample's, and with an edit model's input image the joint sequence (that
    alone when the family requires an input image)."""
    extra = input_image_tokens(cfg, height, width)
    if not extra:
        return [tokens]
    return [tokens + extra] if model_family(cfg).input_image == "required" else [tokens, tokens + extra]


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
