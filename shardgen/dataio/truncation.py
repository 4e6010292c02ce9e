"""Prompts longer than a text encoder keeps, found while planning (``prompts.on_truncation``).

Only rows long enough to be cut are tokenized: a prompt of B UTF-8 bytes has at most B + 2
tokens (byte-level BPE as in CLIP: a token covers at least a byte, plus start and end tokens;
unigram as in T5: at most a token per character plus an extra word boundary and the end token),
so rows of at most ``window - 3`` bytes are skipped unseen. Planning 100M short prompts then
tokenizes none of them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


log = logging.getLogger("shardgen.plan")
def token_counts(windows: list[tuple[str, Any, int]], prompts: list[str]) -> list[tuple[dict, bool]]:
    """Per prompt: ({encoder: tokens}, truncated?) where truncated means some encoder keeps fewer."""
    counts = [dict() for _ in prompts]
    truncated = [False] * len(prompts)
    for name, tok, window in windows if prompts else ():  # tokenizers refuse an empty batch
        ids = tok(prompts, add_special_tokens=True, truncation=False)["input_ids"]
        for i, seq in enumerate(ids):
            counts[i][name] = len(seq)
            truncated[i] = truncated[i] or len(seq) > window
    return list(zip(counts, truncated))


ON_TRUNCATION = ("warn", "error", "skip")
_BATCH = 2048


def planning_windows(model_cfg: Any) -> list[tuple[str, Any, int]]:
    """(encoder, tokenizer, tokens kept) of the model, from its tokenizer files alone (no weights);
    [] when they cannot be read here (then truncation is still recorded per sample)."""
    from transformers import AutoTokenizer

    from shardgen.models.loader import resolve_source

    try:
        root = resolve_source(model_cfg)
        index = json.loads(Path(root, "model_index.json").read_text())
        found = [s for s in ("", "_2", "_3") if (index.get(f"tokenizer{s}") or [None])[0]]
        out = []
        for i, s in enumerate(found):
            tok = AutoTokenizer.from_pretrained(root, subfolder=f"tokenizer{s}")
            name = (index.get(f"text_encoder{s}") or [None, f"tokenizer{s}"])[1]
            window = tok.model_max_length if i == 0 and len(found) > 1 else model_cfg.max_sequence_length
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
    truncated: list[int] = field(default_factory=list)
    first: tuple[int, dict] | None = None   # (line, tokens) of the first truncated row
    _pending: list = field(default_factory=list)

    @property
    def min_bytes(self) -> int:
        """Rows of at most this many bytes cannot be truncated."""
        return min((w for _, _, w in self.windows), default=1 << 62) - 3

    def offer(self, index: int, line: int, prompt: str) -> None:
        """A row that may be too long (its byte length exceeds ``min_bytes``)."""
        self._pending.append((index, line, prompt))
        if len(self._pending) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        """Tokenize the rows offered so far."""
        rows, self._pending = self._pending, []
        if not rows:
            return
        for (index, line, _), (tokens, cut) in zip(rows, token_counts(self.windows, [p for _, _, p in rows])):
            if cut:
                self.truncated.append(index)
                self.first = self.first or (line, tokens)

    def report(self, path: str) -> str | None:
        """The planning message (None when no prompt is cut)."""
        self.flush()
        if not self.truncated:
            return None
        line, tokens = self.first
        keeps = ", ".join(f"{n} keeps {w}" for n, _, w in self.windows)
        return (f"{len(self.truncated)} prompt(s) are longer than the text encoders keep ({keeps} tokens); the first, "
                f"{path}:{line}, has {tokens}")
