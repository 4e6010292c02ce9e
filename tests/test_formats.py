"""The output formats, one table (shardgen/dataio/shards/formats.py): what the writer encodes, what the tools
decode and what the config accepts all come from it."""

import io

import numpy as np
import pytest

from shardgen.config.validate import validate_config
from shardgen.dataio.shards.formats import IMAGE_EXTS, MEDIA_EXTS, OUTPUT_FORMATS, encode_image, image_ext
from shardgen.dataio.shards.video import VIDEO_EXT
from tests.conftest import compose_cfg

PIXELS = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)


def test_the_table_has_the_three_image_formats_and_mp4():
    assert IMAGE_EXTS == ("png", "jpg", "webp") and MEDIA_EXTS == IMAGE_EXTS + (VIDEO_EXT,)
    assert image_ext({"txt": b"", "webp": b"x", "json": b"{}"}) == "webp" and image_ext({"mp4": b""}) is None


@pytest.mark.parametrize("ext", IMAGE_EXTS)
def test_each_image_format_decodes_what_it_encodes(ext):
    data = encode_image(PIXELS, ext, 95)
    back = OUTPUT_FORMATS[ext].decode(data)
    assert back.shape == PIXELS.shape and back.dtype == np.uint8
    if ext == "png":  # lossless
        assert np.array_equal(back, PIXELS)


def test_png_bytes_are_pillows_at_compress_level_1():
    """The bytes a run writes (the fingerprint promises them across versions)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(PIXELS).save(buf, format="PNG", compress_level=1)
    assert encode_image(PIXELS, "png", 95) == buf.getvalue()


def test_an_unknown_format_is_refused_by_the_config_and_the_encoder():
    with pytest.raises(Exception, match=r"image_format='bmp': use one of \['png', 'jpg', 'webp'\]"):
        validate_config(compose_cfg("image_format=bmp"))
    with pytest.raises(ValueError, match="unknown image format 'mp4'"):
        encode_image(PIXELS, VIDEO_EXT, 95)
