"""The output formats, one table: a sample's media member by extension -> its encoder, its decoder and the
size estimate that sizes shards (webdataset's writer handler table, extension -> encoder, is the model).

An image format is one row here; ``image_format`` accepts every image row (shardgen/config/validate.py),
the writer encodes with it, and verify, report, signals and the index find a sample's image by its
extension. A video's encoder needs the run's fps and codec: video.py's ``VideoEncoder`` writes it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable

from shardgen.dataio.shards.video import VIDEO_EXT, decode_video


@dataclass(frozen=True)
class OutputFormat:
    """One kind of media member, ``{key}.{ext}``."""

    ext: str
    encode: Callable[[Any, int], bytes] | None
    """(HxWx3 uint8 pixels, quality 1-100) -> the member's bytes; None for video (``VideoEncoder``)."""
    decode: Callable[[bytes], Any]
    """The member's bytes -> uint8 RGB pixels, HxWx3 (a video: FxHxWx3); raises on bytes that do not decode."""
    bytes_per_pixel: float
    """About how many bytes an encoded sample takes per pixel (a video: per pixel of each frame); measured on
    generated 1024x1024 images (png ~1.5 MB with compress_level=1) and H.264 at crf 18."""


def _pil_encoder(pil_format: str, quality: bool, **options: Any) -> Callable[[Any, int], bytes]:
    """An encoder through Pillow's ``pil_format``, passing the run's quality when ``quality``."""
    def encode(pixels: Any, q: int) -> bytes:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format=pil_format, **options, **({"quality": q} if quality else {}))
        return buf.getvalue()

    return encode


def _pil_decode(data: bytes) -> Any:
    """Image bytes -> HxWx3 uint8 RGB pixels."""
    from shardgen.rasters import decode_rgb

    return decode_rgb(data, "the sample's image")


# png at compress_level 1: ~4x faster than the default 6, ~10% larger
OUTPUT_FORMATS = {f.ext: f for f in (
    OutputFormat("png", _pil_encoder("PNG", quality=False, compress_level=1), _pil_decode, 1.5),
    OutputFormat("jpg", _pil_encoder("JPEG", quality=True), _pil_decode, 0.4),
    OutputFormat("webp", _pil_encoder("WEBP", quality=True), _pil_decode, 0.3),
    OutputFormat(VIDEO_EXT, None, lambda data: decode_video(data)[0], 0.3),
)}
IMAGE_EXTS = tuple(ext for ext, f in OUTPUT_FORMATS.items() if f.encode is not None)
"""The image formats (``image_format=``), in the order a sample's members are searched for its image."""
MEDIA_EXTS = tuple(OUTPUT_FORMATS)
"""Every media member a sample may have (its one image or video)."""


def image_ext(members: dict) -> str | None:
    """The extension of the sample's image among ``members`` (by extension), None when it has none."""
    return next((ext for ext in IMAGE_EXTS if ext in members), None)


def encode_image(pixels: Any, fmt: str, quality: int) -> bytes:
    """Encode an HxWx3 uint8 array as an image of format ``fmt`` (one of IMAGE_EXTS)."""
    if fmt not in IMAGE_EXTS:
        raise ValueError(f"unknown image format {fmt!r}")
    return OUTPUT_FORMATS[fmt].encode(pixels, quality)


def sample_bytes_estimate(*, width: int, height: int, image_format: str, frames: int = 1) -> float:
    """About how many bytes one encoded sample takes in a tar (``image_format`` mp4: a video of ``frames``)."""
    per_pixel = OUTPUT_FORMATS[image_format].bytes_per_pixel if image_format in OUTPUT_FORMATS else OUTPUT_FORMATS["png"].bytes_per_pixel
    return per_pixel * width * height * max(1, frames)
