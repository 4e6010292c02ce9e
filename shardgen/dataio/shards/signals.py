"""Curation signals, opt-in (``signals=[phash,watermark,clip]``), computed on the writer's threads.

They run where the image is encoded, on the CPU, beside the GPU's next batch, and land in each
sample's json under "signals" and in the shard's parquet index (columns phash, watermark,
watermark_ok, clip_score):

- phash: imagehash's 64-bit perceptual hash (hex) for near-duplicate search (``jobs.dedup``).
- watermark: embeds the invisible watermark of the reference FLUX code (invisible-watermark,
  dwtDct, its fixed 48-bit message) into the image, and records the message and whether it
  decodes back from the written pixels. It changes pixels (by design, as the reference does).
- clip: CLIP score of the image against its prompt, ``100 * cos(image, text)`` (torchmetrics'
  CLIPScore before its clamp at 0, so low scores still rank), with CLIP weights the user provides
  (``signals.clip.model=PATH``, a transformers CLIPModel directory).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from shardgen.errors import UserError

# The FLUX reference code's watermark: "a fixed 48-bit message that was chosen at random".
WATERMARK_MESSAGE = 0b001010101111111010000111100111001111010100101110
WATERMARK_BITS = [int(bit) for bit in bin(WATERMARK_MESSAGE)[2:]]
WATERMARK_MIN_SIDE = 256  # dwtDct needs images at least this big


class SignalConfigError(UserError, ValueError):
    """A curation signal that cannot run as configured; the message says what to change."""


def phash(pixels: np.ndarray) -> str:
    """imagehash's perceptual hash of an HxWx3 uint8 image, as 16 hex digits."""
    import imagehash
    from PIL import Image

    return str(imagehash.phash(Image.fromarray(pixels)))


def embed_watermark(pixels: np.ndarray) -> np.ndarray:
    """The image with the FLUX reference watermark embedded (RGB in, RGB out; the library works in BGR)."""
    from imwatermark import WatermarkEncoder

    enc = WatermarkEncoder()
    enc.set_watermark("bits", WATERMARK_BITS)
    return np.ascontiguousarray(enc.encode(np.ascontiguousarray(pixels[:, :, ::-1]), "dwtDct")[:, :, ::-1])


def decode_watermark(pixels: np.ndarray) -> list[int]:
    """The 48 bits the dwtDct decoder reads from an RGB image."""
    from imwatermark import WatermarkDecoder

    bits = WatermarkDecoder("bits", len(WATERMARK_BITS)).decode(np.ascontiguousarray(pixels[:, :, ::-1]), "dwtDct")
    return [int(b) for b in bits]


class ClipScorer:
    """CLIP score of images against prompts with a local transformers CLIPModel (loaded once, lazily).
    ``setting`` is how the user named the model's directory, for the message when it cannot be loaded."""

    def __init__(self, model: str, device: str = "cpu", setting: str = "signals.clip.model="):
        self.path, self.device, self.setting = model, device, setting
        self._lock = threading.Lock()
        self._model = self._processor = None

    def load(self) -> None:
        """Load the model now (once): SignalConfigError when the directory holds no loadable CLIP model."""
        if self._model is None:
            self._load()

    def _load(self) -> None:
        from safetensors import SafetensorError
        from transformers import CLIPModel, CLIPProcessor
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a bar per load in a tool's one-line output or the writer's log
        try:
            self._model = CLIPModel.from_pretrained(self.path).to(self.device).eval()
            self._processor = CLIPProcessor.from_pretrained(self.path)
        except (OSError, SafetensorError) as e:  # SafetensorError: a damaged weights file
            raise SignalConfigError(f"{self.setting}{self.path!r}: cannot load a CLIP model there "
                                    f"({' '.join(str(e).split())}). Point it at a transformers CLIPModel directory "
                                    "(config, weights, tokenizer, preprocessor_config.json)") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()

    def __call__(self, pixels: np.ndarray, prompt: str) -> float:
        """100 * cosine(image embedding, text embedding); of a video (FxHxWx3), the mean over its frames."""
        import torch

        frames = list(pixels) if pixels.ndim == 4 else [pixels]
        with self._lock:  # one model shared by the encoder threads
            self.load()
            inputs = self._processor(text=[prompt], images=frames, return_tensors="pt", padding=True,
                                     truncation=True).to(self.device)
            with torch.no_grad():
                out = self._model(**inputs)
            img = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)
            txt = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
            return round(100.0 * float((img * txt).sum(dim=-1).mean()), 4)


class Signals:
    """The configured signals, applied to one sample's pixels before it is encoded."""

    def __init__(self, cfg: Any):
        cfg = dict(cfg or {})
        unknown = set(cfg) - {"phash", "watermark", "clip"}
        if unknown:
            raise SignalConfigError(f"unknown signal(s) {sorted(unknown)}: use signals=[phash,watermark,clip] "
                                    "or a subset")
        self.phash = "phash" in cfg
        self.watermark = "watermark" in cfg
        clip = cfg.get("clip")
        if clip is not None and not (clip or {}).get("model"):
            raise SignalConfigError("signals=[clip] needs CLIP weights: set signals.clip.model=PATH (a transformers "
                                    "CLIPModel directory); none can be downloaded here")
        self.clip = ClipScorer(clip["model"], clip.get("device", "cpu")) if clip else None

    def __bool__(self) -> bool:
        return self.phash or self.watermark or self.clip is not None

    def check(self, width: int, height: int) -> None:
        """Refuse settings a signal cannot work with, before any weight is read."""
        if self.watermark and min(width, height) < WATERMARK_MIN_SIDE:
            raise SignalConfigError(f"signals=[watermark] needs images of at least {WATERMARK_MIN_SIDE}x"
                                    f"{WATERMARK_MIN_SIDE} (dwtDct); this run makes {width}x{height}")

    def apply(self, pixels: np.ndarray, prompt: str | None) -> tuple[np.ndarray, dict]:
        """(pixels to encode, the sample's signals)."""
        out: dict = {}
        if self.watermark:
            pixels = embed_watermark(pixels)
            out["watermark"] = f"{WATERMARK_MESSAGE:012x}"
            out["watermark_ok"] = decode_watermark(pixels) == WATERMARK_BITS
        if self.phash:
            out["phash"] = phash(pixels)
        if self.clip is not None and prompt:
            out["clip_score"] = self.clip(pixels, prompt)
        return pixels, out
