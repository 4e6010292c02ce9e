"""Make the example input images of examples/images.jsonl (small PNGs drawn with PIL): python examples/make_images.py"""

from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).parent / "images"


def picture(sky: tuple, ground: tuple, sun: tuple, size: int = 128) -> Image.Image:
    """A sky, a horizon and a sun: flat shapes, a few KB as PNG."""
    im = Image.new("RGB", (size, size), sky)
    draw = ImageDraw.Draw(im)
    draw.rectangle([0, size * 5 // 8, size, size], fill=ground)
    draw.ellipse([size // 2, size // 8, size * 3 // 4, size * 3 // 8], fill=sun)
    return im


if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    picture((120, 170, 230), (60, 140, 70), (250, 220, 80)).save(HERE / "meadow.png", optimize=True)
    picture((30, 30, 80), (200, 190, 150), (240, 240, 255)).save(HERE / "night_beach.png", optimize=True)
