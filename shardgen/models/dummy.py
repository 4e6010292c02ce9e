"""The real architecture of a known model with random weights (``model.weights=dummy``), for benchmarks.

No model hub is reachable, and the speed of a diffusion pipeline does not depend on its weight
values, so a benchmark can run the real architecture with random weights (like vLLM's dummy load
format). The component configs of each supported model are embedded here (``DUMMY_ARCHITECTURES``,
keyed by the diffusers pipeline class name) and every module is built fast:

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
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

log = logging.getLogger(__name__)


class ComponentSpec(NamedTuple):
    """How to build one pipeline component: ``library`` is "diffusers", "transformers" or
    "tokenizer" (a tiny tokenizer of kind ``cls`` trained here); ``config`` is the kwargs of the
    diffusers class, of the transformers config class ``config_cls``, or of the tokenizer builder."""

    library: str
    cls: str
    config: dict[str, Any]
    config_cls: str | None = None


# --- FLUX.1-dev (black-forest-labs/FLUX.1-dev) ---------------------------------------------------
_FLUX1_DEV = {
    "transformer": ComponentSpec("diffusers", "FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
        guidance_embeds=True, axes_dims_rope=(16, 56, 56))),
    "vae": ComponentSpec("diffusers", "AutoencoderKL", dict(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, act_fn="silu", norm_num_groups=32,
        sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, force_upcast=True,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True)),
    # openai/clip-vit-large-patch14 text tower, as FLUX.1-dev's text_encoder/config.json has it.
    "text_encoder": ComponentSpec("transformers", "CLIPTextModel", dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=2, pad_token_id=1), "CLIPTextConfig"),
    # google/t5-v1_1-xxl encoder.
    "text_encoder_2": ComponentSpec("transformers", "T5EncoderModel", dict(
        vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
        layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        is_encoder_decoder=True, use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
        "T5Config"),
    "tokenizer": ComponentSpec("tokenizer", "clip", dict(model_max_length=77)),
    "tokenizer_2": ComponentSpec("tokenizer", "t5", dict(model_max_length=512)),
    "scheduler": ComponentSpec("diffusers", "FlowMatchEulerDiscreteScheduler", dict(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)),
}

# --- FLUX.2-dev (black-forest-labs/FLUX.2-dev) ---------------------------------------------------
_FLUX2_DEV = {
    "transformer": ComponentSpec("diffusers", "Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=128, out_channels=None, num_layers=8, num_single_layers=48,
        attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)),
    "vae": ComponentSpec("diffusers", "AutoencoderKLFlux2", dict(
        in_channels=3, out_channels=3, latent_channels=32,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, act_fn="silu", norm_num_groups=32,
        sample_size=1024, use_quant_conv=True, use_post_quant_conv=True,
        mid_block_add_attention=True, batch_norm_eps=1e-4, batch_norm_momentum=0.1, patch_size=(2, 2))),
    # Mistral-Small-3.1/3.2-24B (Mistral3ForConditionalGeneration: Pixtral vision tower + Mistral text model).
    # The pipeline stacks hidden states 10, 20, 30 -> joint_attention_dim = 3 * 5120.
    "text_encoder": ComponentSpec("transformers", "Mistral3ForConditionalGeneration", dict(
        text_config=dict(
            vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=11),
        vision_config=dict(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
            num_attention_heads=16, head_dim=64, num_channels=3, image_size=1540, patch_size=14,
            hidden_act="silu", rope_theta=10000.0),
        image_token_index=10, projector_hidden_act="gelu", vision_feature_layer=-1,
        multimodal_projector_bias=False, spatial_merge_size=2, tie_word_embeddings=False), "Mistral3Config"),
    "tokenizer": ComponentSpec("tokenizer", "mistral", dict(model_max_length=512)),
    "scheduler": ComponentSpec("diffusers", "FlowMatchEulerDiscreteScheduler", dict(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")),
}

# --- Qwen-Image (Qwen/Qwen-Image) ------------------------------------------------------------------
_QWEN_IMAGE = {
    "transformer": ComponentSpec("diffusers", "QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))),
    "vae": ComponentSpec("diffusers", "AutoencoderKLQwenImage", dict(
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
        temperal_downsample=[False, True, True], dropout=0.0,
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916])),
    # Qwen2.5-VL-7B-Instruct.
    "text_encoder": ComponentSpec("transformers", "Qwen2_5_VLForConditionalGeneration", dict(
        text_config=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
            max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1e6,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, use_sliding_window=False,
            sliding_window=32768, max_window_layers=28, tie_word_embeddings=False,
            bos_token_id=151643, eos_token_id=151645),
        vision_config=dict(
            depth=32, hidden_size=1280, hidden_act="silu", intermediate_size=3420, num_heads=16,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2,
            window_size=112, out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=False), "Qwen2_5_VLConfig"),
    "tokenizer": ComponentSpec("tokenizer", "qwen", dict(model_max_length=131072)),
    "scheduler": ComponentSpec("diffusers", "FlowMatchEulerDiscreteScheduler", dict(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")),
}

DUMMY_ARCHITECTURES: dict[str, dict[str, ComponentSpec]] = {
    "FluxPipeline": _FLUX1_DEV,
    "Flux2Pipeline": _FLUX2_DEV,
    "QwenImagePipeline": _QWEN_IMAGE,
}
# What each entry is, for messages.
DUMMY_MODELS = {"FluxPipeline": "FLUX.1-dev", "Flux2Pipeline": "FLUX.2-dev", "QwenImagePipeline": "Qwen-Image"}

# Order of construction: big modules first, so a build that cannot fit fails early.
_BUILD_ORDER = ("transformer", "text_encoder_2", "text_encoder", "vae")


def _architectures() -> tuple[dict[str, dict[str, ComponentSpec]], dict[str, str]]:
    """(specs, names for messages): the image pipelines above and the Wan video models, which are all
    WanPipeline and so are keyed by model config name (shardgen/models/wan_dummy.py)."""
    from shardgen.models.wan_dummy import WAN_ARCHITECTURES, WAN_MODELS

    return {**DUMMY_ARCHITECTURES, **WAN_ARCHITECTURES}, {**DUMMY_MODELS, **WAN_MODELS}


def supported_pipelines() -> list[str]:
    return sorted(_architectures()[0])


def _check_pipeline(pipeline: str) -> dict[str, ComponentSpec]:
    archs, models = _architectures()
    try:
        return archs[pipeline]
    except KeyError:
        names = ", ".join(f"{k} ({models[k]})" for k in supported_pipelines())
        raise ValueError(f"no dummy architecture for pipeline {pipeline!r}; weights=dummy supports: {names}") from None


def _merge(base: dict, override: dict) -> dict:
    """``base`` updated by ``override``, recursing into nested dicts (e.g. ``text_config``)."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def dummy_architecture(pipeline: str, overrides: dict[str, dict] | None = None) -> dict[str, ComponentSpec]:
    """The component specs of ``pipeline`` with ``overrides`` ({component: {key: value}}) merged in."""
    specs = _check_pipeline(pipeline)
    overrides = overrides or {}
    unknown = set(overrides) - set(specs)
    if unknown:
        raise ValueError(f"overrides name unknown components {sorted(unknown)} of {pipeline}; known: {sorted(specs)}")
    return {name: spec._replace(config=_merge(spec.config, overrides.get(name, {}))) for name, spec in specs.items()}


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


def _construct(spec: ComponentSpec) -> torch.nn.Module:
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


def _train_chat_tokenizer(kind: str, model_max_length: int):
    """A small byte-level BPE tokenizer with the special tokens of Qwen2 or Mistral (Tekken) chat prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from shardgen.models.tiny import _CORPUS

    # trained on English prompts too, so a prompt takes about as many tokens as with the real vocabularies
    # (~1.1-1.3 per word): models that trim the text to the batch's longest prompt (Qwen-Image) then see
    # realistic text lengths in a benchmark
    prompts = _CORPUS + _example_prompts()
    if kind == "qwen":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        corpus = prompts + [_QWEN_TEMPLATE.format(p) for p in _CORPUS]
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
        return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                       model_max_length=model_max_length)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=model_max_length,
                                   chat_template=_MISTRAL_CHAT_TEMPLATE)


def _build_tokenizer(pipeline: str, name: str, spec: ComponentSpec, tokenizer_dir, cache: dict):
    if tokenizer_dir is not None:
        from transformers import AutoProcessor, AutoTokenizer

        path = Path(tokenizer_dir) / name
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer_dir={tokenizer_dir!s} has no {name}/ folder (needed by {pipeline})")
        loader = AutoProcessor if pipeline == "Flux2Pipeline" else AutoTokenizer
        return loader.from_pretrained(path)
    max_len = spec.config.get("model_max_length")
    if spec.cls in ("clip", "t5"):
        if "tiny" not in cache:
            from shardgen.models.tiny import _train_tokenizers

            with tempfile.TemporaryDirectory() as tmp:
                cache["tiny"] = _train_tokenizers(Path(tmp))
        tok = copy.deepcopy(cache["tiny"][0 if spec.cls == "clip" else 1])
        tok.model_max_length = max_len
        return tok
    if spec.cls in ("qwen", "mistral"):
        return _train_chat_tokenizer(spec.cls, max_len)
    raise ValueError(f"unknown tokenizer kind {spec.cls!r} for {pipeline}.{name}")


# --- the builder ------------------------------------------------------------------------------------

def build_dummy_pipeline(pipeline: str, device: str | torch.device, dtype: torch.dtype, *, tokenizer_dir=None,
                         overrides: dict[str, dict] | None = None, seed: int = 0, arch: str | None = None):
    """The real architecture of a known model (by its diffusers pipeline class name: "FluxPipeline" =
    FLUX.1-dev, "Flux2Pipeline" = FLUX.2-dev, "QwenImagePipeline" = Qwen-Image) with random weights,
    built directly on ``device`` in ``dtype`` (no CPU init, no hub), for benchmarks: speed does not
    depend on weight values.

    ``overrides`` ({component: {config key: value}}, nested dicts merged) changes the embedded
    configs, e.g. to build a scaled-down copy for tests; keep the shapes consistent. ``tokenizer_dir``
    is a pipeline directory whose ``tokenizer*/`` folders hold real tokenizers (default: tiny trained
    ones, valid ids, real ``model_max_length``). The result is in eval mode with the progress bar off;
    ``pipe.dummy_build_seconds`` holds the build time of each component.
    """
    import diffusers

    specs = dummy_architecture(arch or pipeline, overrides)  # arch: a Wan model name (one pipeline, three models)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(seed)
    components, seconds, tok_cache = {}, {}, {}
    order = [n for n in _BUILD_ORDER if n in specs] + [n for n in specs if n not in _BUILD_ORDER]
    for name in order:
        spec = specs[name]
        t0 = time.perf_counter()
        if spec.library == "tokenizer":
            components[name] = _build_tokenizer(pipeline, name, spec, tokenizer_dir, tok_cache)
        elif spec.library == "value":  # a plain pipeline argument (Wan 2.2's boundary_ratio)
            components[name] = spec.config["value"]
        elif spec.cls.endswith("Scheduler"):
            components[name] = getattr(diffusers, spec.cls)(**spec.config)
        else:
            module = materialize_random(_construct(spec), device, dtype, generator)
            module.eval().requires_grad_(False)
            _synchronize(device)
            components[name] = module
        seconds[name] = time.perf_counter() - t0
        log.info("dummy %s.%s built in %.2f s", pipeline, name, seconds[name])
    pipe = getattr(diffusers, pipeline)(**components)
    pipe.set_progress_bar_config(disable=True)
    pipe.dummy_build_seconds = seconds
    return pipe
