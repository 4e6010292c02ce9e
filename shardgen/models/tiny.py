"""What the embedded tiny models are built with: building a pipeline once into the model cache (``cached_build``:
atomic, safe for ranks building at once, rebuilt when a cached file changed; the cache is ``$SHARDGEN_CACHE``,
shardgen/cache.py) and the small tokenizers trained or fixed here.

No machine shardgen runs on is assumed to reach a model hub, so each family's tiny model (``model=tiny`` is
FLUX.1's: shardgen/families/flux/tiny.py) is built here from a fixed seed, saved with ``save_pretrained`` and always
loaded back through ``from_pretrained``, so the real loading path runs.
"""

from __future__ import annotations

import logging
import os
import shutil
import string
import tempfile
import time
from pathlib import Path

from shardgen.cache import default_cache_dir
from shardgen.models.content import changed_files, content_sha256
from shardgen.models.quiet import quiet_libraries

log = logging.getLogger("shardgen")
CORPUS = [
    "a photo of a cat",
    "a dog on the beach",
    "cinematic film still of a cat sipping a margarita",
    "an astronaut riding a horse on the moon, digital art",
]


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
