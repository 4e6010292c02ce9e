"""The real architecture of a known model with random weights (``model.weights=dummy``), for benchmarks.

No model hub is reachable, and the speed of a diffusion pipeline does not depend on its weight
values, so a benchmark can run the real architecture with random weights (like vLLM's dummy load
format). The component configs of each supported model are held by its family (shardgen/families/, keyed by
model config name) and every module is built fast here:

- its parameters are created on the ``meta`` device (``accelerate.init_empty_weights`` with
  ``include_buffers=False``), so no CPU memory is allocated and no CPU init runs;
- each parameter is then allocated directly on the target device in the target dtype and filled
  with a cheap random init there (normal(0, 0.02) for matrices, zeros for biases, ones for 1-D
  weights, i.e. norms); tied parameters stay tied;
- buffers (rotary ``inv_freq`` tables, CLIP ``position_ids``, the FLUX.2 VAE's BatchNorm statistics)
  were computed normally on the CPU during construction, so they are correct; they are moved to the
  device and keep their dtype (as ``from_pretrained`` leaves them).

Tokenizers are tiny ones trained here (token ids only need to be valid for the real vocabularies),
with the real ``model_max_length``; pass ``tokenizer_dir`` (a pipeline directory holding the real
``tokenizer*/`` folders) to use real ones instead.
"""

from __future__ import annotations

import copy
import os
import logging
import tempfile
import time
import zlib
from pathlib import Path
import torch

from shardgen.models.compat import guard_ftfy
from shardgen.families import ComponentSpec, DummyModel, ModelFamily, dummy_models, family_of

log = logging.getLogger(__name__)


# Order of construction: big modules first, so a build that cannot fit fails early.
_BUILD_ORDER = ("transformer", "text_encoder_2", "text_encoder", "vae")


def find_dummy(model: str, pipeline: str | None = None) -> tuple[ModelFamily, DummyModel]:
    """The family and dummy architecture of ``model``: a model config name (conf/model/<name>.yaml's ``name``,
    e.g. "flux_dev", "wan21_t2v_14b") or, for a family with a single one, any name of ``pipeline`` or the
    pipeline class name itself (e.g. "FluxPipeline")."""
    known = dummy_models()
    if model in known and (pipeline is None or known[model][0].pipeline == pipeline):
        return known[model]
    family = family_of(pipeline or model)
    if family is not None and (model in family.dummies or len(family.dummies) == 1):
        return family, family.dummy(model)
    names = ", ".join(f"{k} ({d.title}, {f.pipeline})" for k, (f, d) in sorted(known.items()))
    raise ValueError(f"no dummy architecture for model {model!r}" + (f" ({pipeline})" if pipeline else "") +
                     f"; weights=dummy supports: {names}")


def _merge(base: dict, override: dict) -> dict:
    """``base`` updated by ``override``, recursing into nested dicts (e.g. ``text_config``)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def dummy_architecture(model: str, overrides: dict[str, dict] | None = None,
                       pipeline: str | None = None) -> dict[str, ComponentSpec]:
    """The component specs of ``model`` (see ``find_dummy``) with ``overrides`` ({component: {key: value}}) merged in."""
    specs = find_dummy(model, pipeline)[1].components
    overrides = overrides or {}
    unknown = set(overrides) - set(specs)
    if unknown:
        raise ValueError(f"overrides name unknown components {sorted(unknown)} of {model}; known: {sorted(specs)}")
    return {name: spec._replace(config=_merge(spec.config, overrides.get(name, {}))) for name, spec in specs.items()}


def dummy_params(model: str, pipeline: str | None = None) -> dict[str, int]:
    """Parameters per weighted component (the diffusers and transformers modules, no scheduler) of ``model``'s dummy
    architecture, built on the meta device."""
    return {name: sum(p.numel() for p in construct_meta(spec).parameters())
            for name, spec in dummy_architecture(model, pipeline=pipeline).items()
            if spec.library in ("diffusers", "transformers") and not spec.cls.endswith("Scheduler")}


# --- fast random init on the device ---------------------------------------------------------------

def _fp32_names(module: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Module names kept in float32 the way ``from_pretrained`` keeps them (``_keep_in_fp32_modules``
    for float16, ``_keep_in_fp32_modules_strict`` for float16 and bfloat16)."""
    keep = set()
    if dtype == torch.float16:
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    return keep


@torch.no_grad()
def materialize_random(module: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                       generator: torch.Generator | None = None, std: float = 0.02) -> torch.nn.Module:
    """Allocate every meta parameter of ``module`` on ``device`` in ``dtype`` and fill it randomly.

    Matrices/kernels (ndim >= 2) get normal(0, std), biases zeros, other 1-D weights (norm scales)
    ones. Parameters that already hold data are moved and cast; buffers are moved and keep their
    dtype. Parameters shared between modules (tied embeddings) stay shared.
    """
    keep_fp32 = _fp32_names(module, dtype)
    done: dict[int, torch.nn.Parameter] = {}
    for mod_name, mod in module.named_modules():
        fp32 = bool(keep_fp32) and any(part in keep_fp32 for part in mod_name.split("."))
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in done:
                mod._parameters[name] = done[id(p)]
                continue
            target = (torch.float32 if fp32 else dtype) if p.is_floating_point() else p.dtype
            if p.is_meta:
                data = torch.empty(p.shape, device=device, dtype=target)
                if name.endswith("bias"):
                    data.zero_()
                elif data.ndim >= 2:
                    data.normal_(0.0, std, generator=generator)
                else:
                    data.fill_(1.0)
            else:
                data = p.data.to(device=device, dtype=target)
            new = torch.nn.Parameter(data, requires_grad=False)
            done[id(p)] = new
            mod._parameters[name] = new
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                raise RuntimeError(f"buffer {mod_name}.{name} of {type(module).__name__} was built on meta")
            mod._buffers[name] = b.to(device)
    return module


def construct_meta(spec: ComponentSpec) -> torch.nn.Module:
    """The module of ``spec`` with parameters on meta and buffers computed on the CPU."""
    from accelerate import init_empty_weights

    if spec.library == "diffusers":
        import diffusers

        cls = getattr(diffusers, spec.cls)
        with init_empty_weights(include_buffers=False):
            return cls(**spec.config)
    import transformers

    config = getattr(transformers, spec.config_cls)(**spec.config)
    with init_empty_weights(include_buffers=False):
        model = getattr(transformers, spec.cls)(config)
    # transformers skips tying parameters that are on meta (e.g. T5's shared / encoder.embed_tokens): tie now,
    # so they are materialized once and stay shared.
    model.tie_weights()
    return model


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- tokenizers -------------------------------------------------------------------------------------

_QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                  "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                  "<|im_end|>\n<|im_start|>assistant\n")
# QwenImageEditPipeline's template: trained on too, so its system prefix is the 64 tokens the pipeline drops
# (prompt_template_encode_start_idx), as with the real vocabulary, and the kept text starts at <|vision_start|>
_QWEN_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
# Qwen2's special tokens at their real ids: Qwen2.5-VL finds the image in the text by these ids (its config's
# vision_start_token_id, image_token_id, ...), so a tiny vocabulary must keep them
QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
                    "<|image_pad|>": 151655, "<|video_pad|>": 151656}
# Mistral's instruct format, reduced to text content (what Flux2Pipeline.format_input produces).
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set text = m['content'] if m['content'] is string else "
    "(m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}")


def _example_prompts() -> list[str]:
    """examples/prompts.txt of a source checkout (none in an installed package)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "prompts.txt"
    return [l for l in path.read_text(encoding="utf-8").splitlines() if l.strip()] if path.is_file() else []


def train_chat_tokenizer(kind: str, model_max_length: int, real_ids: bool = True):
    """A small byte-level BPE tokenizer with the special tokens of Qwen2 or Mistral (Tekken) chat prompts;
    ``real_ids``: Qwen2's special tokens at the real vocabulary's ids (``QWEN_SPECIAL_IDS``), else at the trained
    vocabulary's first ids (a tiny model's compact embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from shardgen.models.tiny import CORPUS

    # trained on English prompts too, so a prompt takes about as many tokens as with the real vocabularies
    # (~1.1-1.3 per word): models that trim the text to the batch's longest prompt (Qwen-Image) then see
    # realistic text lengths in a benchmark
    prompts = CORPUS + _example_prompts()
    if kind == "qwen":
        specials = list(QWEN_SPECIAL_IDS)
        corpus = prompts + [t.format(p) for t in (_QWEN_TEMPLATE, _QWEN_EDIT_TEMPLATE) for p in CORPUS]
    else:
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>"]
        corpus = prompts + [SYSTEM_MESSAGE]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=4000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "qwen":
        return PreTrainedTokenizerFast(tokenizer_object=_with_ids(bpe, QWEN_SPECIAL_IDS) if real_ids else bpe,
                                       pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                       model_max_length=model_max_length)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=model_max_length,
                                   chat_template=_MISTRAL_CHAT_TEMPLATE)


def _with_ids(bpe, ids: dict[str, int]):
    """The trained tokenizer ``bpe`` with its special tokens moved to ``ids`` (the rest of the vocabulary keeps its
    ids; the ones the specials leave are unused)."""
    import json

    from tokenizers import Tokenizer

    state = json.loads(bpe.to_str())
    state["model"]["vocab"].update({t: ids[t] for t in state["model"]["vocab"] if t in ids})
    for added in state["added_tokens"]:
        added["id"] = ids.get(added["content"], added["id"])
    return Tokenizer.from_str(json.dumps(state))


def _build_tokenizer(pipeline: str, name: str, spec: ComponentSpec, tokenizer_dir, cache: dict):
    if tokenizer_dir is not None:
        from transformers import AutoProcessor, AutoTokenizer

        path = Path(tokenizer_dir) / name
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer_dir={tokenizer_dir!s} has no {name}/ folder (needed by {pipeline})")
        loader = AutoProcessor if spec.cls == "mistral" else AutoTokenizer  # Flux2Pipeline takes a processor
        return loader.from_pretrained(path)
    max_len = spec.config.get("model_max_length")
    if spec.cls in ("clip", "t5"):
        if "tiny" not in cache:
            from shardgen.models.tiny import train_tokenizers

            with tempfile.TemporaryDirectory() as tmp:
                cache["tiny"] = train_tokenizers(Path(tmp))
        tok = copy.deepcopy(cache["tiny"][0 if spec.cls == "clip" else 1])
        tok.model_max_length = max_len
        return tok
    if spec.cls in ("qwen", "mistral"):
        return train_chat_tokenizer(spec.cls, max_len)
    raise ValueError(f"unknown tokenizer kind {spec.cls!r} for {pipeline}.{name}")


def _build_processor(pipeline: str, name: str, spec: ComponentSpec, built: dict, tokenizer_dir):
    """A transformers processor: ``cls(**config)``, its ``tokenizer`` the built component the config names and its
    ``image_processor`` made from its dict; with ``tokenizer_dir``, one taking a tokenizer is the real one saved in
    the pipeline directory's ``<name>/`` folder."""
    config = dict(spec.config)
    tokenizer = config.pop("tokenizer", None)
    if tokenizer is not None and tokenizer_dir is not None:
        path = Path(tokenizer_dir) / name
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer_dir={tokenizer_dir!s} has no {name}/ folder (needed by {pipeline})")
        return _class(spec.cls).from_pretrained(path)
    if tokenizer is not None:
        config["tokenizer"] = built[tokenizer]
    if isinstance(config.get("image_processor"), dict):
        sub = dict(config["image_processor"])
        config["image_processor"] = _class(sub.pop("cls"))(**sub)
    return _class(spec.cls)(**config)


def _is_text_encoder(name: str, spec: ComponentSpec) -> bool:
    return name.startswith("text_encoder") and spec.library not in ("tokenizer", "processor", "value")


def _class(name):
    """A transformers class by name, or the class a family's function returns (Qwen-Image-Edit's image-only
    Qwen2-VL processor)."""
    import transformers

    return name() if callable(name) else getattr(transformers, name)


# --- the builder ------------------------------------------------------------------------------------

def build_dummy_pipeline(model: str, device: str | torch.device, dtype: torch.dtype, *, tokenizer_dir=None,
                         overrides: dict[str, dict] | None = None, seed: int = 0, pipeline: str | None = None,
                         encoders_on_cpu: bool = False):
    """The real architecture of a known model (``model``: its model config name, e.g. "flux_dev",
    "qwen_image", "wan21_t2v_14b", or the pipeline class of a family with one, e.g. "FluxPipeline") with
    random weights, built directly on ``device`` in ``dtype`` (no CPU init, no hub), for benchmarks: speed
    does not depend on weight values. ``pipeline``: the configured pipeline class (default: the family's).

    ``overrides`` ({component: {config key: value}}, nested dicts merged) changes the embedded
    configs, e.g. to build a scaled-down copy for tests; keep the shapes consistent. ``tokenizer_dir``
    is a pipeline directory whose ``tokenizer*/`` folders hold real tokenizers (default: tiny trained
    ones, valid ids, real ``model_max_length``). The result is in eval mode with the progress bar off;
    ``pipe.dummy_build_seconds`` holds the build time of each component. ``encoders_on_cpu``: the text encoders are
    built first, each moved to the CPU once built, so ``device`` holds at most one of them beside nothing else (a
    pipeline larger than the GPU, e.g. FLUX.2-dev's on an 80 GB card under strategy=device_map).
    """
    import diffusers

    specs = dummy_architecture(model, overrides, pipeline)
    pipeline = pipeline or find_dummy(model, pipeline)[0].pipeline
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    components, seconds, tok_cache = {}, {}, {}
    order = [n for n in _BUILD_ORDER if n in specs] + [n for n in specs if n not in _BUILD_ORDER]
    order.sort(key=lambda n: specs[n].library == "processor")  # after the tokenizers they take
    if encoders_on_cpu:
        order.sort(key=lambda n: not _is_text_encoder(n, specs[n]))
    for name in order:
        spec = specs[name]
        t0 = time.perf_counter()
        if spec.library == "tokenizer":
            components[name] = _build_tokenizer(pipeline, name, spec, tokenizer_dir, tok_cache)
        elif spec.library == "value":  # a plain pipeline argument (Wan 2.2's boundary_ratio)
            components[name] = spec.config["value"]
        elif spec.library == "processor":  # Wan 2.1 I2V's CLIP image processor, Qwen-Image-Edit's VL one: no weights
            components[name] = _build_processor(pipeline, name, spec, components, tokenizer_dir)
        elif spec.cls.endswith("Scheduler"):
            components[name] = getattr(diffusers, spec.cls)(**spec.config)
        else:
            # a generator per component, seeded from its name: the same weights whatever the build order
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            module = materialize_random(construct_meta(spec), device, dtype, generator)
            module.eval().requires_grad_(False)
            _synchronize(device)
            if encoders_on_cpu and _is_text_encoder(name, spec):
                module.to("cpu")
            components[name] = module
        seconds[name] = time.perf_counter() - t0
        log.info("dummy %s.%s built in %.2f s", pipeline, name, seconds[name])
    guard_ftfy(getattr(diffusers, pipeline))
    pipe = getattr(diffusers, pipeline)(**components)
    pipe.set_progress_bar_config(disable=True)
    pipe.dummy_build_seconds = seconds
    return pipe


# --- random LoRA adapters for a dummy model -------------------------------------------------------

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""The attention projections an adapter trained for a DiT usually adapts (diffusers' training scripts' default)."""


def save_random_lora(model: str, path: str | os.PathLike, rank: int = 64, seed: int = 0,
                     targets: tuple[str, ...] = LORA_TARGETS, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save a LoRA of ``rank`` for the transformer of the dummy ``model`` (e.g. "flux_dev") to the .safetensors
    file ``path``, in diffusers' layout (``transformer.<module>.lora_A/B.weight``), random from ``seed``: an adapter
    with a real adapter's shapes for benchmarks, made without building the model's weights. Returns ``path``."""
    from safetensors.torch import save_file

    transformer = construct_meta(dummy_architecture(model)["transformer"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, mod in transformer.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            a = torch.randn(rank, mod.in_features, generator=gen) / mod.in_features ** 0.5
            b = torch.randn(mod.out_features, rank, generator=gen) * (0.02 / rank ** 0.5)
            tensors[f"transformer.{name}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"transformer.{name}.lora_B.weight"] = b.to(dtype).contiguous()
    if not tensors:
        raise ValueError(f"no Linear of {model}'s transformer is named like {targets}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path
