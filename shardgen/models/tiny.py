"""The embedded default model: a tiny FLUX-architecture pipeline built offline.

No machine shardgen runs on is assumed to reach a model hub, so the default model is
built here: a CLIP tokenizer trained on a few strings, a T5 one with a fixed vocabulary (the
same on every machine), random weights from a fixed seed. It is
saved with ``save_pretrained`` and always loaded back through ``from_pretrained``, so the
real loading path runs. It generates noise-like images in milliseconds on a CPU.

The VAE has four blocks (downscale 8, like FLUX.1's), so image sizes and token counts
follow the real model's geometry: 1024x1024 -> 128x128 latents -> 4096 image tokens.
"""

from __future__ import annotations

import logging
import os
import shutil
import string
import tempfile
import time
from pathlib import Path

import torch

from shardgen.models.content import changed_files, content_sha256
from shardgen.models.quiet import quiet_libraries
from shardgen.models.versions import TINY_VERSION  # the cache's name; bumped there

log = logging.getLogger("shardgen")
CORPUS = [
    "a photo of a cat",
    "a dog on the beach",
    "cinematic film still of a cat sipping a margarita",
    "an astronaut riding a horse on the moon, digital art",
]
TRANSFORMER_CONFIG = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8), guidance_embeds=True,
)


def default_cache_dir() -> Path:
    """Where built models are cached: ``$SHARDGEN_CACHE`` or ``~/.cache/shardgen`` (also when it is set but empty,
    which would otherwise mean the current directory). A leading ``~`` is expanded."""
    value = os.environ.get("SHARDGEN_CACHE", "").strip()
    return Path(os.path.expanduser(value)) if value else Path.home() / ".cache" / "shardgen"


def tiny_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny pipeline, building it once if it is missing."""
    return cached_build(f"tiny-flux-{TINY_VERSION}", build_tiny_pipeline, cache_dir)


def cached_build(name: str, build, cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory ``name`` under the cache holding ``build()``'s pipeline, saved once with ``save_pretrained``.

    Safe when several ranks call it at once: each builds into its own temporary
    directory and the first atomic rename wins.
    """
    root = Path(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    target = root / name
    if (target / "model_index.json").exists():
        if not (changed := changed_files(target, root)):
            return target
        # nothing rewrites a built entry: a changed file is damage (a bit flip, a copy cut short); the build is
        # deterministic, so building it again restores the same bytes
        log.warning("the cached model %s changed since it was built (%s); building it again", target,
                    ", ".join(changed[:3]))
        _move_aside(target)
    tmp = _build_dir(root)
    quiet_libraries()  # a first run prints the run's lines, not the build's progress bars
    try:
        build().save_pretrained(tmp, safe_serialization=True)
        if not _has_all_weights(tmp):  # transformers writes weights on distributed rank 0 only: wait for its copy
            return _wait_for(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model_index.json").exists():
                raise  # not a lost race: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    content_sha256(target, root)  # recorded now, while the bytes are the ones just built
    return target


def _build_dir(root: Path) -> Path:
    """A fresh build directory in the cache; ModelLoadError naming SHARDGEN_CACHE when the cache cannot hold one."""
    from shardgen.models.errors import ModelLoadError

    try:
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=root))
    except OSError as e:
        raise ModelLoadError(f"the model cache {root} cannot be written ({e.strerror or e}), so the tiny model cannot be "
                             "built there. Point SHARDGEN_CACHE (or model.cache_dir) at a writable directory") from None


def _move_aside(target: Path) -> None:
    aside = target.with_name(f".{target.name}-changed-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        return  # another process moved it first
    shutil.rmtree(aside, ignore_errors=True)


def _has_all_weights(path: Path) -> bool:
    """Every component folder of a saved pipeline but the tokenizers and the scheduler holds its safetensors."""
    return all(any(d.glob("*.safetensors")) for d in path.iterdir()
               if d.is_dir() and not any((d / f).exists() for f in ("tokenizer_config.json", "scheduler_config.json")))


def _wait_for(target: Path, timeout_s: float = 600.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (target / "model_index.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target} was not built by distributed rank 0 within {timeout_s:.0f} s")
        time.sleep(0.2)
    return target


def train_tokenizers(workdir: Path):
    """A CLIP-style BPE tokenizer trained on a few strings, and the fixed T5-style one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    bpe = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|startoftext|>", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(workdir))
    clip_tok = CLIPTokenizer(str(workdir / "vocab.json"), str(workdir / "merges.txt"), model_max_length=77)

    return clip_tok, t5_style_tokenizer()


def t5_style_tokenizer(model_max_length: int = 512):
    """A T5-style (SentencePiece unigram) tokenizer with a fixed vocabulary: the corpus' words, then single
    characters. Fixed rather than trained: ``tokenizers``' unigram trainer gives a different vocabulary in
    each process (measured: 3 builds, 3 vocabularies), and the tiny models' bytes must not depend on it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    words = sorted({"\u2581" + w for line in CORPUS for w in line.replace(",", " ,").split()})
    chars = ["\u2581"] + [c for c in string.printable if not c.isspace()]
    vocab = [(t, 0.0) for t in specials] + [(w, -1.0) for w in words] + [(c, -10.0) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=model_max_length)


def build_tiny_pipeline(seed: int = 0):
    """Build the tiny FLUX pipeline in memory (random weights from ``seed``)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with tempfile.TemporaryDirectory() as tmp:
        clip_tok, t5_tok = train_tokenizers(Path(tmp))
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=clip_tok.vocab_size + 2, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, projection_dim=32, max_position_embeddings=77))
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4))
        transformer = FluxTransformer2DModel(**TRANSFORMER_CONFIG)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4,
            use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=0.3611)
    finally:
        torch.random.set_rng_state(gen_state)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer, vae=vae)


def save_tiny_lora(path: str | os.PathLike, seed: int = 1, rank: int = 4,
                   targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0"), **config: object) -> Path:
    """Save a LoRA for the tiny transformer to the .safetensors file ``path`` (diffusers' format, made with peft:
    random A and B from ``seed``, so it visibly changes the images). ``config`` overrides TRANSFORMER_CONFIG: an
    adapter for another model's shapes. Returns ``path``."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        transformer = FluxTransformer2DModel(**(TRANSFORMER_CONFIG | config))
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets),
                                           init_lora_weights=False))
    finally:
        torch.random.set_rng_state(gen_state)
    layers = get_peft_model_state_dict(transformer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # diffusers' own layout (FluxPipeline.save_lora_weights): the component's name, then peft's keys
    save_file({f"transformer.{k}": v.contiguous() for k, v in layers.items()}, str(path))
    return path
