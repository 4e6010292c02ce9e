"""Per-row generation settings (``prompts.row_settings``): columns/fields of a prompt row that set how its sample
is generated (size, aspect ratio, negative prompt, guidance, true CFG scale, frames) instead of staying metadata.

Only the names listed in ``prompts.row_settings`` are read as settings (default: none, so a prompt file whose
columns happen to be named ``width`` keeps them as metadata). Each value is checked while planning, before any
weight is read: a bad one is a bad row (``file:line: <field>: what is wrong and what to write``, or a reject with
``prompts.on_bad_row=skip``). ``RowRules`` holds what the checks need (the model's size multiple, the run's area
for ``aspect_ratio``, the video frame stride); it is recorded in plan.json with the prompt source, so a resumed
run reads its rows back with exactly the rules it was planned with.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from shardgen.errors import UserError

ROW_SETTINGS = ("width", "height", "aspect_ratio", "negative_prompt", "guidance", "true_cfg_scale", "steps",
                "num_frames", "loras", "image", "strength", "images_per_prompt")
"""The names ``prompts.row_settings`` may list."""
MAX_SIDE = 8192
"""The largest image side a row may ask for, in pixels."""
MAX_STEPS = 1000
"""The most denoising steps a row may ask for."""
MAX_IMAGES = 1000
"""The most images of one prompt (images_per_prompt, the run's or a row's)."""
MAX_RATIO = 8.0
"""The most elongated ``aspect_ratio`` a row may ask for (8:1 or 1:8)."""
_RATIO = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*[:x/]\s*([0-9]+(?:\.[0-9]+)?)\s*")
# text cells (csv, tsv) read as numbers: digits bounded, so no conversion meets Python's int-string limit
_NUMBER = re.compile(r"\s*[+-]?([0-9]{1,30}\.?[0-9]{0,30}|\.[0-9]{1,30})([eE][+-]?[0-9]{1,4})?\s*")
_INT = re.compile(r"\s*[0-9]{1,18}\s*")


class Shape(NamedTuple):
    """What sets the size of a pipeline call's tensors (a compiled graph, attention's sequence length): the image
    width and height in pixels, and the frames of a video (None: an image model)."""

    width: int
    height: int
    frames: int | None = None

    @property
    def label(self) -> str:
        """``WIDTHxHEIGHT`` or ``WIDTHxHEIGHTxFRAMES``, as jobs.status and jobs.report show it."""
        return shape_label(self.width, self.height, self.frames)


def count_shapes(rules: RowRules, rows: Iterable[Any]) -> Counter:
    """Rows per ``Shape`` of ``rows`` (PromptRow or PlannedRow: ``settings``, ``reject``), rejected rows left
    out: a shard's shape set, or (summed while planning) a run's, as ``Plan.shapes`` gives it."""
    return Counter(rules.shape(r.settings) for r in rows if r.reject is None)


def shapes_json(shapes: Counter) -> list[list]:
    """``shapes`` (Shape -> rows) for plan.json: [[width, height, frames or null, rows], ...], most rows first."""
    return [[*shape, n] for shape, n in sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0].label))]


class BadSetting(UserError, ValueError):
    """A row's setting is wrong; ``str(exc)`` says which field, what is wrong and what to write (the reader
    puts the file and line in front, or records a reject under ``prompts.on_bad_row=skip``)."""


def unknown_names(names: Any) -> list[str]:
    """The names of ``names`` (``prompts.row_settings``) that are not settings a row may give."""
    return [str(n) for n in (names or ()) if n not in ROW_SETTINGS]


@dataclass(frozen=True)
class RowRules:
    """What a row's settings are checked against: the names read as settings, the model's size multiple (pixels
    per latent token along a side), the run's height and width (their product is the area an ``aspect_ratio``
    keeps), and the video frame stride (0: an image model)."""

    names: tuple[str, ...]
    multiple: int = 16
    height: int = 1024
    width: int = 1024
    frame_stride: int = 0
    frames: int | None = None
    """The run's ``num_frames`` (video models): the frames of a row that gives none."""
    base_dir: str | None = None
    """Where a row's relative adapter paths (``loras``) are taken from: the prompt file's folder (not recorded in
    plan.json: a moved run reads them from its file's new place); input images (``image``) likewise."""
    images: str = ""
    """Whether the model takes an input image per row (its family's ``input_image``): "" none, "optional",
    "required" (a row without one is a bad row)."""
    steps: int = 0
    """The run's denoising steps: a row's ``strength`` must leave at least one (0: not checked)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(self.names))  # plan.json gives a list back

    def as_json(self) -> dict:
        """For plan.json (``RowRules(**d)`` reads it back)."""
        out = dict(names=list(self.names), multiple=self.multiple, height=self.height, width=self.width,
                   frame_stride=self.frame_stride, frames=self.frames)
        return out | ({"images": self.images, "steps": self.steps} if self.images else {})  # image runs only

    def shape(self, settings: dict) -> Shape:
        """The shape a row whose own settings are ``settings`` (``parse``'s) is generated at: its own size and
        frames, else the run's."""
        return Shape(int(settings.get("width", self.width)), int(settings.get("height", self.height)),
                     settings.get("num_frames", self.frames) if self.frame_stride else None)

    def parse(self, rec: dict, text: bool = False) -> dict:
        """Remove the setting fields from ``rec`` (a row's fields) and return them checked and resolved
        (``aspect_ratio`` becomes ``height``/``width`` too); a null or, in csv/tsv (``text``), empty value is
        unset: the run's own. Raises BadSetting."""
        raw = {}
        for name in self.names:
            value = rec.pop(name, None)
            if text and isinstance(value, str) and value.strip() == "":
                value = None
            if value is not None:
                raw[name] = value
        out: dict = {}
        for name in ("guidance", "true_cfg_scale"):
            if name in raw:
                out[name] = _number(name, raw[name], text, low=0.0 if name == "guidance" else 1.0)
        if "negative_prompt" in raw:
            if not isinstance(raw["negative_prompt"], str):
                raise BadSetting(f"negative_prompt: {_kind(raw['negative_prompt'])} is not a string: write the "
                                 "negative prompt as text (or null for the run's model.negative_prompt)")
            out["negative_prompt"] = raw["negative_prompt"]
        if "steps" in raw:
            out["steps"] = _count("steps", raw["steps"], text)
        if "loras" in raw:
            from shardgen.models.lora import LoraError, parse_row

            try:
                out["loras"] = parse_row(raw["loras"], text, Path(self.base_dir) if self.base_dir else None)
            except LoraError as e:
                raise BadSetting(f"loras: {e}") from None
        if "num_frames" in raw:
            out["num_frames"] = self._frames(raw["num_frames"], text)
        if "images_per_prompt" in raw:
            n = whole(raw["images_per_prompt"], text)
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_IMAGES:
                raise BadSetting(f"images_per_prompt: {_shown(raw['images_per_prompt'])} is not a number of images: "
                                 f"write a whole number from 1 to {MAX_IMAGES}")
            out["images_per_prompt"] = n
        out.update(self._image(raw, text, out.get("steps", self.steps)))
        if "aspect_ratio" in raw:
            if "width" in raw or "height" in raw:
                raise BadSetting("aspect_ratio: the row gives width/height too: give either aspect_ratio or "
                                 "width and height, not both")
            out["aspect_ratio"] = str(raw["aspect_ratio"]).strip()
            out["height"], out["width"] = self.ratio_size(raw["aspect_ratio"])
        for name in ("height", "width"):
            if name in raw:
                out[name] = self._side(name, raw[name], text)
        return out

    def ratio_size(self, ratio: Any) -> tuple[int, int]:
        """(height, width) of ``ratio`` ("16:9", "3:4", also "16x9") at the run's area, each side rounded to the
        model's multiple."""
        m = _RATIO.fullmatch(ratio) if isinstance(ratio, str) else None
        w, h = (float(m.group(1)), float(m.group(2))) if m else (0.0, 0.0)
        if not (w > 0 and h > 0 and 1 / MAX_RATIO <= w / h <= MAX_RATIO):
            raise BadSetting(f"aspect_ratio: {ratio!r} is not an aspect ratio: write WIDTH:HEIGHT, e.g. \"16:9\", "
                             f"\"1:1\" or \"3:4\" (at most {MAX_RATIO:g}:1 either way)")
        area = self.height * self.width
        width = max(self.multiple, round(math.sqrt(area * w / h) / self.multiple) * self.multiple)
        height = max(self.multiple, round(math.sqrt(area * h / w) / self.multiple) * self.multiple)
        if max(width, height) > MAX_SIDE:
            raise BadSetting(f"aspect_ratio: {ratio!r} at the run's {self.width}x{self.height} area needs a "
                             f"{width}x{height} image, over {MAX_SIDE} pixels a side: use a less elongated ratio")
        return height, width

    def _image(self, raw: dict, text: bool, steps: int) -> dict:
        """A row's ``image`` and ``strength`` checked (the image's file, not its pixels: shardgen/models/condition.py)."""
        from shardgen.models import condition as C

        out: dict = {}
        if not self.images and ("image" in raw or "strength" in raw):
            raise BadSetting("image: this model takes no input image: remove image and strength from "
                             "prompts.row_settings, or use an image-to-image model")
        checks = {"image": lambda v: C.parse_row(v, Path(self.base_dir) if self.base_dir else None),
                  "strength": lambda v: C.check_strength(v, text)}
        for name, check in checks.items():
            if name in raw:
                try:
                    out[name] = check(raw[name])
                except C.BadImage as e:
                    raise BadSetting(f"{name}: {e}") from None
        if self.images == "required" and "image" not in out:
            raise BadSetting("image: this model makes each sample from an input image: give the row one (a path, "
                             "or encoded image bytes in parquet)")
        if "strength" in out and steps and int(steps * out["strength"]) < 1:
            raise BadSetting(f"strength: {out['strength']:g} of {steps} steps is less than one denoising step: "
                             f"write at least {1 / steps:g}, or give the row more steps")
        return out

    def _side(self, name: str, value: Any, text: bool) -> int:
        value = whole(value, text)
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or value % self.multiple or not self.multiple <= value <= MAX_SIDE:
            got = _shown(value) if ok or text else _kind(value)
            raise BadSetting(f"{name}: {got} is not an image {name} this model can make: write a whole number of "
                             f"pixels, a multiple of {self.multiple} from {self.multiple} to {MAX_SIDE}")
        return value

    def _frames(self, value: Any, text: bool) -> int:
        if not self.frame_stride:
            raise BadSetting("num_frames: this is an image model: remove num_frames from prompts.row_settings "
                             "(or the row)")
        value = whole(value, text)
        s = self.frame_stride
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (value - 1) % s:
            raise BadSetting(f"num_frames: {_shown(value)} is not a frame count this model can make: write "
                             f"{s}k+1 frames (1, {s + 1}, {2 * s + 1}, ...)")
        return value


def shape_label(width: Any, height: Any, frames: Any = None) -> str:
    """A sample's shape as ``jobs.status``/``jobs.report`` and a shard's stats name it: ``WIDTHxHEIGHT``, with
    ``xFRAMES`` for a video (``832x480x81``)."""
    return f"{width}x{height}" + (f"x{frames}" if frames is not None else "")


def shape_legend(labels: Iterable[str]) -> str:
    """What the numbers of ``shape_label``s mean: "width x height", or with video shapes "width x height x frames"."""
    return "width x height" + (" x frames" if any(str(s).count("x") == 2 for s in labels) else "")


def rules_from_cfg(cfg: Any) -> RowRules | None:
    """The rules of a GenerateConfig's ``prompts.row_settings`` (None when it lists none): the size multiple is
    the model family's latent patch (VAE downscale x transformer patch; shardgen/families/)."""
    names = tuple(cfg.prompts.get("row_settings") or ())
    if not names:
        return None
    from shardgen.families import family_for

    fam = family_for(cfg.model.pipeline)
    frames = cfg.get("num_frames") if fam.frame_stride else None
    return RowRules(names=names, multiple=fam.latent_patch, height=int(cfg.height), width=int(cfg.width),
                    frame_stride=fam.frame_stride, frames=None if frames is None else int(frames),
                    images=fam.input_image, steps=int(cfg.steps) if fam.strength else 0)


def _shown(value: Any) -> str:
    """``value`` in a message: its repr, cut to 40 characters (a cell may hold megabytes)."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() <= 1023 else "a huge integer"
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(value: Any) -> str:
    names = {type(None): "null", bool: "a boolean", str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), repr(value))


def whole(value: Any, text: bool = False) -> Any:
    """``value`` as an int where it is a whole number written another way: a float without a fraction (pandas
    stores an integer column that has a null as float64, so 64 arrives as 64.0; up to 2**53, where a float still
    holds every integer), or in csv/tsv text ``64`` or ``64.0``; anything else as it is, for the caller to refuse."""
    if text and isinstance(value, str):
        if _INT.fullmatch(value):
            return int(value)
        if _NUMBER.fullmatch(value):
            value = float(value)
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    return value


def _count(name: str, value: Any, text: bool) -> int:
    value = whole(value, text)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STEPS:
        raise BadSetting(f"{name}: {_shown(value)} is not a number of denoising steps: write a whole number from 1 to "
                         f"{MAX_STEPS}")
    return value


def _number(name: str, value: Any, text: bool, low: float) -> float:
    if text and isinstance(value, str) and _NUMBER.fullmatch(value):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadSetting(f"{name}: {_kind(value) if not text else _shown(value)} is not a number: write a number "
                         f"from {low:g} up, e.g. 3.5")
    if isinstance(value, int) and value.bit_length() > 1023:  # beyond a float: no guidance scale
        value = math.inf
    if not (math.isfinite(value) and value >= low):
        raise BadSetting(f"{name}: {_shown(value)} is out of range: write a number from {low:g} up"
                         + (" (1 = true CFG off)" if name == "true_cfg_scale" else ""))
    return float(value)

