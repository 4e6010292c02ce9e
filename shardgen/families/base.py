"""``ModelFamily``: what shardgen knows about one model family, found by its diffusers pipeline class.

One spec per family (like torchtitan's ``TrainSpec``), registered by pipeline class and looked up by the
most specific ``issubclass`` match (like xDiT's ``@register(FluxPipeline)``): a subclass of a registered
pipeline gets its parent's family unless it registers its own. Every model-specific rule (tokens the
transformer sees, latent geometry, prompt encoding for ``device_map``, dummy architectures, video or image,
speed hooks, embedded tiny models) is asked of the family; adding a model family is one folder beside this module
(``shardgen/families/<family>/``) plus its conf/model YAML.

A family's spec (its folder's ``__init__.py``) names its code by reference, never by a string: its fused blocks,
speed hooks, own component classes and tiny model builders are functions that import the folder's heavier modules
when first called, so reading the registry (config checks, the fingerprint) loads no torch.

This module imports no other shardgen module: every layer may ask it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple


class ComponentSpec(NamedTuple):
    """How to build one pipeline component: ``library`` is "diffusers", "transformers", "tokenizer" (a tiny
    tokenizer of kind ``cls`` trained here), "processor" (a transformers processor ``cls(**config)``; a config's
    ``tokenizer`` names the component passed as its tokenizer, its ``image_processor`` is the dict of an image
    processor: ``cls`` and its kwargs) or "value" (a plain pipeline argument, ``config["value"]``);
    ``config`` is the kwargs of the diffusers class, of the transformers config class ``config_cls``, or of
    the tokenizer builder. ``cls`` is a class name of the library, or (a processor of the family's own) a
    function returning the class."""

    library: str
    cls: str | Callable[[], type]
    config: dict[str, Any]
    config_cls: str | None = None


@dataclass(frozen=True)
class DummyModel:
    """One published model of a family, as ``model.weights=dummy`` builds it (real architecture, random weights)."""

    title: str
    """The published model's name, for messages (e.g. "FLUX.1-dev")."""
    components: dict[str, ComponentSpec]


@dataclass(frozen=True)
class TinyModel:
    """An embedded model built offline from a fixed seed (``model.source=<source>``): a family's real classes, only
    narrow, saved with ``save_pretrained`` and loaded back through ``from_pretrained``."""

    source: str
    """The ``model.source`` that names it (conf/model/tiny*.yaml)."""
    version: str
    """Pins its weights in the run fingerprint (the source alone does not); bumped with the build."""
    transformer_class: str
    """Its transformer's diffusers class, read with ``transformer_config`` before any weight is built."""
    transformer_config: Callable[[], dict[str, Any]]
    """Its transformer's config (the parallel degrees are checked against it)."""
    path: Callable[[Any], Path]
    """``path(cache_dir)``: its directory in the cache (None: ``$SHARDGEN_CACHE``), built there on first use."""


@dataclass(frozen=True)
class ModelFamily:
    """The model-specific rules of one diffusers pipeline class (and its subclasses)."""

    name: str
    """For messages and docs, e.g. "FLUX.1"."""
    pipeline: str
    """The diffusers pipeline class name (``model.pipeline`` in conf/model/*.yaml)."""
    text_tokens: str | None
    """Text tokens the transformer sees per prompt, split by context parallelism: a model config key whose value
    is the (padded) count, "" when none are split (the text only feeds cross-attention), None when the count
    varies per batch."""
    text_prefix_tokens: int = 0
    """Text tokens joined before the ``text_tokens`` key's count (SD3: CLIP's 77 before the T5 tokens)."""
    encode_outputs: tuple[str | None, ...] | None = None
    """``encode_prompt``'s outputs in order, as ``__call__`` names them (None: not passed on); None: the family
    cannot run under strategy=device_map."""
    latent_patch: int = 16
    """Pixels per image token along each side (VAE downscale x transformer patch)."""
    frame_stride: int = 0
    """Video only: frames per latent frame after the first (num_frames = stride*k + 1); 0 for image families."""
    dummies: dict[str, DummyModel] = field(default_factory=dict)
    """``model.weights=dummy`` architectures by model config name (conf/model/<name>.yaml's ``name``)."""
    hidden_default: int = 3072
    """Transformer width assumed by ``auto`` when the config does not give it."""
    speed_hooks: Callable[[Any, Any], dict] | None = None
    """The family's own speed hooks, ``(pipe, AccelOptions) -> what was done``, applied by
    ``shardgen.speed.accel.prepare`` after the generic options (handed down: speed/ imports no family)."""
    encode_hooks: Callable[[Any], dict] | None = None
    """Exact hooks on how the pipeline encodes prompts, ``pipe -> what was done`` (idempotent; the same embeddings to
    the bit, less work: FLUX.2's text encoder run only as deep as the pipeline reads it), installed wherever a
    replica encodes: ``accel.prepare`` on a whole pipeline, device_map's ``StagedPipeline`` on the one it wraps."""
    input_image: str = ""
    """Whether ``__call__`` takes an input image per sample (``image``; prompts.row_settings=[image]): "" (text
    only), "optional" (edit models: references) or "required" (image-to-image, image-to-video)."""
    strength: bool = False
    """Image-to-image: ``__call__`` takes ``strength`` (how far a sample may go from its input image)."""
    image_per_call: bool = False
    """The pipeline conditions a whole call on one image (Wan image-to-video): rows are batched by input image."""
    cuts_text: bool = True
    """``encode_prompt`` cuts the prompt's tokens at ``max_sequence_length`` (diffusers' pipelines do, but
    Qwen-Image-Edit's, whose text carries the image's vision tokens): what a sample's ``truncated`` flag checks."""
    image_in_sequence: bool = False
    """The input image's latent tokens join the sample's in the transformer's attention (edit models: FLUX.1
    Kontext, FLUX.2 references, Qwen-Image-Edit; shardgen fits the image to the sample's size, or to
    ``input_image_area``'s, so a conditioned call attends over the sample's image tokens and the input's)."""
    input_image_area: int = 0
    """The pixel area the pipeline resizes an input image to, keeping its aspect ratio (Qwen-Image-Edit: 1024x1024
    whatever the sample's size); 0: the sample's size. Each image is fitted to that size before the call
    (shardgen/models/condition.py: ``area_size``)."""
    own_components: dict[str, Callable[[], type]] = field(default_factory=dict)
    """Component name -> a function returning the class that loads it instead of the class the model's
    ``model_index.json`` names (``Class.from_pretrained(<model>, subfolder=<name>)``): Qwen-Image-Edit's processor
    without torchvision."""
    repeated_blocks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Transformer class name -> its repeated block classes, for transformers that do not list them in diffusers'
    ``_repeated_blocks`` (what regional compilation and fp8 work on)."""
    fused_blocks: dict[str, Callable[[], ModuleType]] = field(default_factory=dict)
    """Transformer class name -> a function returning the module of its fused block forwards (``applicable``,
    ``enable``, ``disable``; ``COMPILED``: whether compiled blocks use them too), which ``fused_blocks=true`` runs
    instead of the stock forwards (handed down: speed/ imports no family)."""
    cuda_graphs: bool = False
    """Whether the transformer's eager call is the same kernels for every call of one shape (no host decision on
    values, no host sync), so ``cuda_graphs=true`` may capture and replay it (shardgen/speed/cuda_graphs.py);
    checked on a GPU (tests/test_gpu.py) before a family declares it."""
    tiny_models: tuple[TinyModel, ...] = ()
    """The embedded tiny models of the family's pipeline (``model=tiny``'s FLUX.1 pipeline ...)."""
    eight_bit_attention: str | None = None
    """The 8-bit attention kernel (``sdpa_backend`` name) measured faster than lossless attention for the family's
    models, which ``sdpa_backend=auto_8bit`` (``speed=fast``) takes where the GPU runs it (shardgen/run/auto_8bit.py);
    None: none was, and auto_8bit keeps lossless attention."""
    compiled_speedup: float | None = None
    """Measured seconds per sample of the family's default eager path (its fused blocks where it has them) over
    its compiled blocks', which ``compile=auto`` expects before a process has recorded its own; None: the generic
    prior (shardgen/speed/autocompile.py)."""
    compiled_speedup_fp8: float | None = None
    """The same with ``fp8=true``: the fused eager blocks then write float8 rows straight from their LayerNorm, GELU
    and joined passes, which compiled blocks do not, so compiling may lose; None: ``compiled_speedup``."""

    @property
    def is_video(self) -> bool:
        """Whether the family makes videos (samples of ``num_frames`` frames)."""
        return self.frame_stride > 0

    def latent_frames(self, num_frames: int | None) -> int:
        """Frames the transformer sees (1 for an image family)."""
        return 1 if not self.is_video or num_frames is None else (num_frames - 1) // self.frame_stride + 1

    def image_tokens(self, height: int, width: int) -> int:
        """Image tokens of one latent frame of ``height`` x ``width`` pixels."""
        return (height // self.latent_patch) * (width // self.latent_patch)

    def dummy(self, model_name: str) -> DummyModel:
        """The dummy architecture of ``model_name``; a family with a single one gives it for any name (a custom
        YAML of the same pipeline)."""
        if model_name in self.dummies:
            return self.dummies[model_name]
        if len(self.dummies) == 1:
            return next(iter(self.dummies.values()))
        raise KeyError(model_name)


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry (one per pipeline class name)."""
    if family.pipeline in _FAMILIES:
        raise ValueError(f"a model family for {family.pipeline} is already registered ({_FAMILIES[family.pipeline].name})")
    _FAMILIES[family.pipeline] = family
    return family


def unregister(pipeline: str) -> None:
    """Remove the family of ``pipeline`` (tests registering a temporary one)."""
    _FAMILIES.pop(pipeline, None)


def families() -> list[ModelFamily]:
    """Every registered family (the modules of shardgen/families/ are imported by the package)."""
    return list(_FAMILIES.values())


def _pipeline_class(name: str):
    import diffusers

    return getattr(diffusers, name, None)


def family_of(pipe_or_class: Any) -> ModelFamily | None:
    """The family of a pipeline object, class or class name: the registered pipeline class that is the most
    specific base of it (None when none is)."""
    if isinstance(pipe_or_class, str):
        if pipe_or_class in _FAMILIES:
            return _FAMILIES[pipe_or_class]
        cls = _pipeline_class(pipe_or_class)
    else:
        cls = pipe_or_class if isinstance(pipe_or_class, type) else type(pipe_or_class)
    if cls is None:
        return None
    best, best_cls = None, None
    for fam in _FAMILIES.values():
        base = _pipeline_class(fam.pipeline)
        if base is not None and issubclass(cls, base) and (best_cls is None or issubclass(base, best_cls)):
            best, best_cls = fam, base
    return best


# What a pipeline no family knows is taken to be: an image model of 16-pixel tokens whose text count varies.
UNKNOWN = ModelFamily(name="unknown", pipeline="", text_tokens=None)


def family_for(pipe_or_class: Any) -> ModelFamily:
    """``family_of``, or ``UNKNOWN``'s conservative rules for a pipeline no family registers."""
    return family_of(pipe_or_class) or UNKNOWN


def declared_repeated_blocks(transformer_class: str) -> tuple[str, ...]:
    """The repeated block classes a family declares for ``transformer_class`` (empty when none does)."""
    return next((fam.repeated_blocks[transformer_class] for fam in _FAMILIES.values()
                 if transformer_class in fam.repeated_blocks), ())


def declared_fused_blocks(transformer_class: str) -> ModuleType | None:
    """The fused block module a family declares for ``transformer_class`` (None when none does)."""
    load = next((fam.fused_blocks[transformer_class] for fam in _FAMILIES.values()
                 if transformer_class in fam.fused_blocks), None)
    return load() if load is not None else None


def tiny_model(source: str) -> TinyModel | None:
    """The embedded tiny model named by ``model.source`` (None: a hub id or a directory), from every family's
    ``tiny_models``: the one table of them."""
    return tiny_models().get(source)


def tiny_models() -> dict[str, TinyModel]:
    """Every embedded tiny model by its ``model.source`` (a family derived from another shares its parent's)."""
    out: dict[str, TinyModel] = {}
    for fam in _FAMILIES.values():
        for tiny in fam.tiny_models:
            if out.setdefault(tiny.source, tiny) is not tiny:
                raise ValueError(f"two tiny models are named model.source={tiny.source!r}")
    return out


def dummy_models() -> dict[str, tuple[ModelFamily, DummyModel]]:
    """Every dummy architecture by model config name, with its family."""
    return {name: (fam, d) for fam in _FAMILIES.values() for name, d in fam.dummies.items()}

