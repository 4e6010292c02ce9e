"""Conditioning images (``prompts.row_settings=[image]``): the input image a row names for image-to-image, edit
and image-to-video pipelines, checked in two steps.

While planning (cheap, no pixel decoded): a path is a regular file (not a link, a directory, a FIFO), neither empty
nor over ``MAX_IMAGE_BYTES``; encoded bytes (a parquet binary column) likewise. When its row is generated: the bytes
are read once (``O_NOFOLLOW | O_NONBLOCK``: a file swapped for a link or a FIFO since planning is refused, never
followed or waited on), hashed, and decoded by PIL (PNG, JPEG or WebP only, through shardgen/rasters.py) with a
pixel limit checked before any pixel is decoded (a decompression bomb) and every pixel loaded (a truncated PNG/JPEG
fails here). A row whose image fails is rejected with the reason; the rest of the run goes on.

The image used is identified by its content: its sha256 goes into the sample's json (``input_image``) and the
shard index (``input_image_sha256``). The prompt file is in the run's fingerprint, the images are not: a file
changed under a run changes the rows generated after the change, and each sample's json says which content it
was made from.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from shardgen.errors import UserError
from shardgen.rasters import NotARaster, open_raster, to_rgb

ROW_FIELD = "image"
"""The ``prompts.row_settings`` name of a row's input image."""
STRENGTH_FIELD = "strength"
"""The ``prompts.row_settings`` name of a row's image-to-image strength."""
MAX_IMAGE_BYTES = 64 << 20
"""The largest input image file a row may name (encoded bytes)."""
MAX_IMAGE_PIXELS = 8192 * 8192
"""The most pixels an input image may decode to (width x height), checked before decoding."""


class BadImage(UserError, ValueError):
    """A row's input image cannot be used; the message says what is wrong and what to give instead."""


class ImageGone(BadImage):
    """A row's input image file that planning accepted cannot be read now (gone, swapped for a directory, a link or a
    FIFO, unreadable): a reason that may pass, so the row fails (``retry_failed=true`` makes it again) instead of
    being rejected for good."""


class InputImage(NamedTuple):
    """A row's input image: ``ref`` as the row wrote it (a path; ``None`` for encoded bytes in the row itself),
    ``path`` the file it resolves to, ``data`` the encoded bytes of a binary column (``None`` for a file)."""

    ref: str | None
    path: str | None
    data: bytes | None = None

    @property
    def shown(self) -> str:
        """How a message names it."""
        return self.path if self.path is not None else f"the row's {len(self.data or b'')}-byte image"

    def digest_key(self) -> Any:
        """What it counts as in a shard's digest: the path as written, or the bytes' sha256 (never the resolved path:
        a run moved with its prompt file and images keeps its digests)."""
        return self.ref if self.data is None else hashlib.sha256(self.data).hexdigest()


class Conditioned(NamedTuple):
    """A decoded input image, fitted to the sample's size: the PIL image, the encoded bytes' sha256, the size it had."""

    image: Any
    sha256: str
    width: int
    height: int

    def as_json(self, ref: str | None) -> dict:
        """For the sample's json (``input_image``)."""
        return dict(sha256=self.sha256, path=ref, width=self.width, height=self.height)


def parse_row(value: Any, base_dir: Path | None) -> InputImage:
    """A row's ``image``: a path (relative to the prompt file's folder, or absolute) or encoded image bytes (parquet
    binary column; a ``{"bytes": ...}`` struct as Hugging Face datasets write images). Only what the row itself holds
    is checked (the file is not opened: ``check_file`` does that while planning), so a row reads back the same
    whatever happens to the file later. BadImage says what is wrong."""
    if isinstance(value, dict) and not isinstance(value, str):  # datasets' Image feature: {"bytes", "path"}
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        _check_size("the row's image", len(data))
        return InputImage(ref=None, path=None, data=data)
    if not isinstance(value, str) or not value.strip():
        raise BadImage(f"{value!r} is not an image: give a path (relative to the prompt file's folder, or absolute) "
                       "or, in parquet, a binary column of encoded image bytes")
    if "://" in value:
        raise BadImage(f"{value.strip()[:80]!r} is a URL: input images are read from local files (or parquet image "
                       "bytes); copy the images to this machine and give their paths")
    p = Path(os.path.expanduser(value.strip()))
    p = p if p.is_absolute() else (base_dir or Path.cwd()) / p
    return InputImage(ref=value.strip(), path=str(p))


def check_file(path: Path) -> None:
    """BadImage unless ``path`` is a regular file (not a symbolic link) of 1 to MAX_IMAGE_BYTES bytes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BadImage(f"{path} does not exist; give the path of an image file") from None
    except ValueError:  # a NUL byte
        raise BadImage(f"{str(path)!r} holds a NUL byte, which no file name may; give the image's path") from None
    except OSError as e:
        raise BadImage(f"{path} cannot be read ({e.strerror or e}); give a readable image file") from None
    if stat.S_ISLNK(st.st_mode):
        raise BadImage(f"{path} is a symbolic link; give the image file itself (links are not followed)")
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise BadImage(f"{path} is {what}; give the path of an image file")
    _check_size(str(path), st.st_size)


def _check_size(name: str, size: int) -> None:
    if size == 0:
        raise BadImage(f"{name} is empty (0 bytes); give an image file")
    if size > MAX_IMAGE_BYTES:
        raise BadImage(f"{name} is {size / 2**20:.0f} MiB, over the {MAX_IMAGE_BYTES >> 20} MiB an input image may "
                       "have; give a smaller image (it is resized to the sample's size anyway)")


def read_bytes(img: InputImage) -> bytes:
    """The encoded bytes of ``img``: a file opened without following a link and without blocking (a FIFO swapped in
    since planning), read up to MAX_IMAGE_BYTES."""
    if img.data is not None:
        return img.data
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(img.path, flags)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        if isinstance(e, ValueError):
            raise BadImage(f"{img.path!r} holds a NUL byte, which no file name may; give the image's path") from None
        if not os.path.exists(img.path) and not os.path.islink(img.path):
            raise ImageGone(f"{img.path} does not exist (any more); put the image back and re-run with "
                            "retry_failed=true") from None
        raise ImageGone(f"{img.path} cannot be opened ({e.strerror or e}); make it a readable image file (links "
                        "are not followed) and re-run with retry_failed=true") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # checked on the descriptor: Python's file object raises on a directory
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise ImageGone(f"{img.path} is {what} now; put the image file back and re-run with retry_failed=true")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise ImageGone(f"{img.path} cannot be read ({e.strerror or e}); re-run with retry_failed=true") from None
    finally:
        os.close(fd)
    _check_size(img.path, len(data))
    return data


def decode(data: bytes, name: str, cover: tuple[int, int] | None = None) -> tuple[Any, tuple[int, int]]:
    """``data`` decoded by PIL, every pixel loaded, as RGB (EXIF orientation applied), and the (width, height) the
    file declares (oriented likewise); BadImage for anything PIL cannot read whole or that decodes to over
    MAX_IMAGE_PIXELS. ``cover``: the (width, height) the image will be fitted to; a JPEG is then decoded at the
    smallest of libjpeg's 1/2, 1/4, 1/8 scales still covering it (a 12 MP photo for a 1024x1024 sample: about 4x
    faster)."""
    from PIL import Image, ImageOps

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            im = open_raster(data, name)
        except NotARaster as e:
            raise BadImage(str(e)) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise BadImage(f"{name} declares too many pixels ({e}); give an image of at most "
                           f"{MAX_IMAGE_PIXELS} pixels") from None
        except Exception as e:  # a corrupt header: PIL raises many types
            raise BadImage(f"{name} cannot be read as an image ({type(e).__name__}: {e})") from None
        w, h = im.size
        if w * h > MAX_IMAGE_PIXELS or w < 1 or h < 1:
            raise BadImage(f"{name} is {w}x{h} pixels, over the {MAX_IMAGE_PIXELS} an input image may have; give a "
                           "smaller image")
        try:
            if cover is not None and im.format == "JPEG":
                scale = max(cover[0] / w, cover[1] / h)  # what fitting keeps of the image: it must still cover
                im.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))
            im.load()  # every pixel now: a truncated file fails here, not inside the pipeline
            turned = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # EXIF orientations a quarter turn away
            return to_rgb(ImageOps.exif_transpose(im)), ((h, w) if turned else (w, h))
        except Exception as e:
            raise BadImage(f"{name} does not decode whole ({type(e).__name__}: {e}); give an intact image") from None


def fit(image: Any, width: int, height: int) -> Any:
    """``image`` cropped to the aspect ratio of ``width`` x ``height`` around its centre and resized to it (Lanczos):
    what the pipelines' own resizing would otherwise stretch."""
    from PIL import Image, ImageOps

    if image.size == (width, height):
        return image
    return ImageOps.fit(image, (width, height), method=Image.Resampling.LANCZOS)


def area_size(width: int, height: int, area: int, multiple: int = 32) -> tuple[int, int]:
    """The (width, height) of about ``area`` pixels, multiples of ``multiple``, at the aspect ratio of ``width`` x
    ``height``, as Qwen-Image-Edit's ``calculate_dimensions`` rounds them: the size that pipeline resizes an input
    image to. Repeated until the size gives itself back (rounding moves the ratio; at most a few rounds), so the
    pipeline, computing it again from an image of that size, finds the same and resizes nothing."""
    size = (width, height)
    for _ in range(16):
        ratio = size[0] / size[1]
        w = math.sqrt(area * ratio)  # the pipeline's own arithmetic, in its order: the same floats round alike
        new = (round(w / multiple) * multiple, round(w / ratio / multiple) * multiple)
        if new == size:
            break
        size = new
    return size


def input_size(width: int, height: int, area: int = 0) -> tuple[int, int]:
    """The (width, height) a row's input image is fitted to for a sample of ``width`` x ``height``: the sample's,
    or with ``area`` (``ModelFamily.input_image_area``) the size the pipeline itself resizes an input to."""
    return area_size(width, height, area) if area else (width, height)


def load(img: InputImage, width: int, height: int) -> Conditioned:
    """The input image of a row, read, hashed, decoded and fitted to ``width`` x ``height``; BadImage says why not."""
    data = read_bytes(img)
    digest = hashlib.sha256(data).hexdigest()
    im, size = decode(data, img.shown, cover=(width, height))
    return Conditioned(fit(im, width, height), digest, *size)


def check_strength(value: Any, text: bool) -> float:
    """A row's ``strength`` (0 < strength <= 1: how far from its input image a sample may go; 1 = the image's
    content is replaced by noise). BadImage says what to write."""
    if text and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 < value <= 1.0:
        raise BadImage(f"{value!r} is not a strength: write a number above 0 and at most 1 (e.g. 0.6; "
                       "1 = the input image replaced by noise)")
    return float(value)
