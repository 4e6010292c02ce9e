"""Prompts longer than a text encoder keeps (``prompts.on_truncation``): counting their tokens.

With ``warn`` (the default) planning tokenizes nothing: each batch's prompts are counted when they
are generated (``dataio/shards/annotate.py``, the pipeline's own tokenizers, one batch call) and flagged
``truncated`` in their json, the index and the shard's stats. ``error`` and ``skip`` must know
before any image is made, so planning counts, with the fast tokenizers' batch call (Rust, all
cores) and a progress bar.

Only rows long enough to be cut are tokenized: a prompt of B UTF-8 bytes has at most B + 2
tokens (byte-level BPE as in CLIP: a token covers at least a byte, plus start and end tokens;
unigram as in T5: at most a token per character plus an extra word boundary and the end token),
so rows of at most ``window - 3`` bytes are skipped unseen.
"""

from __future__ import annotations

import json
import logging
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


log = logging.getLogger("shardgen.plan")


def count_tokens(tok: Any, prompts: list[str]) -> list[int]:
    """How many tokens ``tok`` makes of each prompt, special tokens included, nothing cut.

    A fast tokenizer is called through its Rust backend's batch call, which spreads the batch over
    all cores (rayon) and builds no Python lists of ids (``encode_batch_fast``, tokenizers >= 0.20,
    also skips the character offsets); others through ``tok(...)``."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [len(e) for e in encode(prompts, add_special_tokens=True)]
    return [len(seq) for seq in tok(prompts, add_special_tokens=True, truncation=False)["input_ids"]]


def token_counts(windows: list[tuple[str, Any, int]], prompts: list[str]) -> list[tuple[dict, bool]]:
    """Per prompt: ({encoder: tokens}, truncated?) where truncated means some encoder keeps fewer."""
    counts = [dict() for _ in prompts]
    truncated = [False] * len(prompts)
    for name, tok, window in windows if prompts else ():  # tokenizers refuse an empty batch
        for i, n in enumerate(count_tokens(tok, prompts)):
            counts[i][name] = n
            truncated[i] = truncated[i] or n > window
    return list(zip(counts, truncated))


ON_TRUNCATION = ("warn", "error", "skip")
_BATCH = 2048  # prompts per batch call: enough to keep every core busy; the encodings made stay ~30 MB


def checks_while_planning(policy: str) -> bool:
    """Whether planning must count tokens: only to refuse (error) or reject (skip) long prompts
    before any image is made; ``warn`` counts them at generation time instead."""
    return policy in ("error", "skip")


def planning_windows(model_cfg: Any) -> list[tuple[str, Any, int]]:
    """(encoder, tokenizer, tokens kept) of the model, from its tokenizer files alone (no weights);
    [] when they cannot be read here (then truncation is still recorded per sample)."""
    from transformers import AutoTokenizer

    from shardgen.families import family_for
    from shardgen.models.loader import resolve_source

    try:
        root = resolve_source(model_cfg)
        index = json.loads(Path(root, "model_index.json").read_text())
        found = [s for s in ("", "_2", "_3") if (index.get(f"tokenizer{s}") or [None])[0]]
        cut = model_cfg.max_sequence_length if family_for(model_cfg.pipeline).cuts_text else None
        out = []
        for i, s in enumerate(found):
            tok = AutoTokenizer.from_pretrained(root, subfolder=f"tokenizer{s}")
            name = (index.get(f"text_encoder{s}") or [None, f"tokenizer{s}"])[1]
            window = tok.model_max_length if i == 0 and len(found) > 1 else (cut or tok.model_max_length)
            out.append((name, tok, int(window)))
        return out
    except Exception as e:  # a hub id without a local copy, an unusual layout: not worth stopping for
        log.info("prompt truncation is not checked while planning (%s); each sample's json still records it", e)
        return []


@dataclass
class TruncationCheck:
    """Collects the rows that a text encoder will cut, in batches, while the plan is scanned."""

    windows: list[tuple[str, Any, int]]
    policy: str = "warn"
    total: int | None = None                # about how many rows the file has (the progress bar's end)
    progress: bool = True
    truncated: array = field(default_factory=lambda: array("q"))  # row indices, increasing: 8 bytes each
    first: tuple[int, dict] | None = None   # (line, tokens) of the first truncated row
    stopped_at: int | None = None           # error: rows scanned when the first batch with a cut prompt ended
    _pending: list = field(default_factory=list)
    _bar: Any = None

    @property
    def min_bytes(self) -> int:
        """Rows of at most this many bytes cannot be truncated."""
        return min((w for _, _, w in self.windows), default=1 << 62) - 3

    def offer(self, index: int, line: int, prompt: str) -> None:
        """A row that may be too long (its byte length exceeds ``min_bytes``)."""
        self._pending.append((index, line, prompt))
        if len(self._pending) >= _BATCH:
            self.flush()
            if self.policy == "error" and self.truncated:  # refused anyway: say so now, not after the whole file
                self.stopped_at = index + 1

    @property
    def stop(self) -> bool:
        """The planning scan may stop: the run is refused whatever the rest holds."""
        return self.stopped_at is not None

    def flush(self) -> None:
        """Tokenize the rows offered so far."""
        rows, self._pending = self._pending, []
        if not rows:
            return
        for (index, line, _), (tokens, cut) in zip(rows, token_counts(self.windows, [p for _, _, p in rows])):
            if cut:
                self.truncated.append(index)
                self.first = self.first or (line, tokens)
        self._advance(rows[-1][0] + 1)

    def _advance(self, rows_done: int) -> None:
        """The bar shows the rows scanned (up to the last one tokenized), against ``total``."""
        if not self.progress:
            return
        if self._bar is None:
            import sys

            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit="prompt", desc=f"counting tokens (prompts.on_truncation="
                             f"{self.policy})", dynamic_ncols=True, file=sys.stderr,
                             mininterval=0.1 if sys.stderr.isatty() else 30.0)
        self._bar.update(max(0, rows_done - self._bar.n))

    def report(self, path: str) -> str | None:
        """The planning message (None when no prompt is cut)."""
        self.flush()
        if self._bar is not None:
            self._bar.close()
        if not self.truncated:
            return None
        line, tokens = self.first
        keeps = ", ".join(f"{n} keeps {w}" for n, _, w in self.windows)
        among = f" (among the first {self.stopped_at} rows: planning stopped there)" if self.stop else ""
        return (f"{len(self.truncated)} prompt(s) are longer than the text encoders keep ({keeps} tokens){among}; the "
                f"first, {path}:{line}, has {tokens}")
