"""The one way shardgen opens image bytes: input images, shard members read back by the tools, benchmark outputs.

Only the raster formats the docs name are tried (PNG, JPEG, WebP): Pillow's other plugins are never consulted.
Some of them hand the bytes to another program (EPS and PostScript run Ghostscript, the ``gs`` found on PATH), and
the bytes come from a prompt file or a run directory written elsewhere; whatever a file is named, bytes of another
format are refused before any plugin parses them.
"""

from __future__ import annotations

import io
from typing import Any

from shardgen.errors import UserError

RASTER_FORMATS = ("PNG", "JPEG", "WEBP")
"""The Pillow formats an image may have (input images and shard members alike)."""
FORMATS_SHOWN = "PNG, JPEG or WebP"


class NotARaster(UserError, ValueError):
    """Bytes that are not an image in one of RASTER_FORMATS; the message names them and what to give instead."""


def open_raster(data: bytes, name: str) -> Any:
    """``data`` opened by Pillow as one of RASTER_FORMATS (lazily: no pixel decoded yet); NotARaster for anything
    else, naming ``name``. Pillow's own errors (a decompression bomb, a corrupt header) pass through."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data), formats=RASTER_FORMATS)
    except UnidentifiedImageError:
        raise NotARaster(f"{name} is not a {FORMATS_SHOWN} image (the formats input images may have); convert it "
                         "to PNG") from None


def to_rgb(im: Any) -> Any:
    """``im`` as 8-bit RGB. 16-bit grayscale keeps its high byte (``v >> 8``), as Pillow reads 16-bit RGB: Pillow's
    own ``I;16 -> RGB`` clips every value above 255 to white."""
    if im.mode.startswith("I;16") or im.mode == "I":
        import numpy as np
        from PIL import Image

        v = np.clip(np.asarray(im, dtype=np.int64), 0, 65535)
        im = Image.fromarray((v >> 8).astype(np.uint8), mode="L")
    return im if im.mode == "RGB" else im.convert("RGB")


def decode_rgb(data: bytes, name: str = "the image") -> Any:
    """``data`` (a RASTER_FORMATS image) decoded whole as an HxWx3 uint8 RGB array."""
    import numpy as np

    return np.asarray(to_rgb(open_raster(data, name)))
