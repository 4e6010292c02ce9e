"""The model's transformer, as the strategies see it: its class and config read without any weight
(validation and ``auto`` decide from them), the tokens one prompt puts through it, and loading its
pretrained weights split over ranks (tp) or GPUs (device_map).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parallel.dims import ParallelConfigError
from shardgen.families import ModelFamily, family_for

if TYPE_CHECKING:
    import torch

    from shardgen.config.schema import GenerateConfig, ModelConfig

log = logging.getLogger("shardgen.auto")
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

    def meta_module(self):
        """The transformer built from its config with its parameters on the meta device (no memory); None when
        diffusers has no such class or the config does not build."""
        from accelerate import init_empty_weights

        cls = self.model_class()
        if cls is None:
            return None
        try:
            with init_empty_weights(include_buffers=False):
                return cls.from_config(self.config)
        except (TypeError, ValueError) as e:  # a config this diffusers version cannot build
            log.debug("cannot build %s on the meta device: %s", self.cls_name, e)
            return None

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


@dataclass(frozen=True)
class SequenceShape:
    """The tokens one sample puts through the transformer, counted once from the config (``sequence_shape``): what
    context parallelism splits and ``auto`` sizes activations from, with the sizes their messages show."""

    pipeline: str
    """The diffusers pipeline class (messages name it)."""
    family: ModelFamily
    """Its family: the token, patch and frame rules the counts follow."""
    width: int
    height: int
    frames: int | None
    """``num_frames`` as configured (video families; ignored by image families)."""
    image: int
    """Image or video tokens of the sample (latent frames x patches)."""
    text: int | None
    """Text tokens; None when each batch has its own count, 0 when context parallelism does not split them (they
    only feed cross-attention)."""
    input_image: int
    """Tokens a row's input image adds to the sequence (an edit model whose input joins the sample's tokens, in a run
    whose rows name images, ``ModelFamily.image_in_sequence``); 0: none."""
    input_size: tuple[int, int]
    """(width, height) a row's input image is fitted to (shardgen/models/condition.py: ``input_size``)."""
    inputs_join: bool
    """The run's rows name input images whose tokens join the sequence (``input_image`` counts them)."""

    @property
    def true_cfg(self) -> bool:
        """The pipeline runs true classifier-free guidance (it takes ``true_cfg_scale``): with model.true_cfg_scale
        above 1 every step puts the sample through the transformer twice, the two branches cfg_degree=2 splits.
        Read when asked (it imports the pipeline's module), once per pipeline class."""
        return has_true_cfg(self.pipeline)

    @property
    def latent_frames(self) -> int:
        """Frames the transformer sees (Wan: num_frames = 4k+1 gives k+1; 1 for image models)."""
        return self.family.latent_frames(self.frames)

    @property
    def with_input(self) -> int:
        """The image-side tokens of a conditioned sample: what its activations are sized from."""
        return self.image + self.input_image

    @property
    def split(self) -> list[int]:
        """The image-side token counts context parallelism splits: the sample's, and with an edit model's input image
        the joint sequence (that alone when the family requires an input image)."""
        if not self.input_image:
            return [self.image]
        return [self.with_input] if self.family.input_image == "required" else [self.image, self.with_input]

    def at(self, width: int, height: int, frames: int | None) -> SequenceShape:
        """The same run's sequence for a sample of another size (a row's own, ``prompts.row_settings``)."""
        return _counted(self.pipeline, self.family, width, height, frames, self.text, self.inputs_join)


def _counted(pipeline: str, family: ModelFamily, width: int, height: int, frames: int | None, text: int | None,
             inputs_join: bool) -> SequenceShape:
    """The SequenceShape of a sample of ``width`` x ``height`` (x ``frames``)."""
    from shardgen.models.condition import input_size

    fitted = input_size(width, height, family.input_image_area)
    return SequenceShape(pipeline=pipeline, family=family, width=width, height=height, frames=frames,
                         image=family.image_tokens(height, width) * family.latent_frames(frames), text=text,
                         input_image=family.image_tokens(fitted[1], fitted[0]) if inputs_join else 0,
                         input_size=fitted, inputs_join=inputs_join)


def sequence_shape(cfg: GenerateConfig) -> SequenceShape:
    """The run's SequenceShape: its size, its model's text length, and whether its rows' input images join the
    sequence."""
    family = model_family(cfg)
    key = family.text_tokens
    text = family.text_prefix_tokens + cfg.model[key] if key else (0 if key == "" else None)
    joins = family.image_in_sequence and "image" in (cfg.prompts.get("row_settings") or ())
    return _counted(cfg.model.pipeline, family, cfg.width, cfg.height, cfg.get("num_frames"), text, joins)


@functools.lru_cache(maxsize=None)
def has_true_cfg(pipeline_class: str) -> bool:
    """Whether diffusers' ``pipeline_class`` takes ``true_cfg_scale`` (its transformer runs twice per step)."""
    import inspect

    import diffusers

    from shardgen.models.quiet import quiet_libraries

    quiet_libraries()  # importing a pipeline's module makes transformers warn about optional packages

    cls = getattr(diffusers, pipeline_class, None)
    return cls is not None and "true_cfg_scale" in inspect.signature(cls.__call__).parameters


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
