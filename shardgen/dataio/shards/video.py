"""Video samples: frames -> mp4 bytes (PyAV, H.264 by default) and back, for writers, verify and preview.

A video run is one whose model family makes videos (shardgen/families/: Wan, i.e. tiny_video.yaml, wan*.yaml):
each sample is ``{key}.mp4`` + ``{key}.txt`` + ``{key}.json``, the json adding frames, fps, duration,
size and codec to the image samples' fields. PyAV's wheels ship FFmpeg (libx264 included).

The encoder runs single-threaded: x264's output depends on its thread count, and a resumed run on
another machine must write the same bytes as an uninterrupted one. A video takes minutes to
generate and a fraction of a second to encode, and the writer pool encodes several at once anyway.
For the same reason the frames reach the encoder as yuv420p converted here (``yuv420p``), not by libswscale.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from shardgen.errors import UserError
from shardgen.pick import pick

VIDEO_EXT = "mp4"
# yuv420p: what every player decodes; it halves chroma, so width and height must be even
PIX_FMT = "yuv420p"
CRF_CODECS = ("libx264", "libx265")  # encoders whose quality is set by crf; others use their default bitrate


class VideoConfigError(UserError, ValueError):
    """A video setting that cannot work (codec, crf, fps, frame count); the message says what to set."""


def is_video(cfg: Any) -> bool:
    """True for a run of a video model (its family's, shardgen/families/: e.g. Wan)."""
    from shardgen.families import family_for

    return family_for(cfg.model.pipeline).is_video


def _takes_images(cfg: Any) -> bool:
    """Whether the run's model takes an input image per row (image-to-video): its pipeline conditions the latents
    on it, which the mid-sample checkpoints' resume does not restore."""
    from shardgen.families import family_for

    return bool(family_for(cfg.model.pipeline).input_image)


def validate_video_config(cfg: Any) -> None:
    """Check the video keys before anything is loaded (a no-op for image runs)."""
    every = cfg.get("latent_checkpoint_every")
    if every == "auto":
        if not cfg.latent_checkpoint_s > 0:
            raise VideoConfigError(f"latent_checkpoint_s={cfg.latent_checkpoint_s}: use a positive number of "
                                   "seconds (or latent_checkpoint_every=null to save none)")
    elif every is not None and _takes_images(cfg):
        raise VideoConfigError(f"latent_checkpoint_every={every}: model={cfg.model.name} starts each video from an "
                               "input image, which a mid-sample checkpoint does not keep; use "
                               "latent_checkpoint_every=null (or auto: off for such models)")
    elif every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1
                                or not is_video(cfg)):  # its strategy: where strategies are known (parallel/)
        raise VideoConfigError(f"latent_checkpoint_every={every}: use N >= 1 steps, with a video model and "
                               f"strategy=dp (model={cfg.model.name}, strategy={cfg.strategy.name}), auto or null")
    if not is_video(cfg):
        return
    import av

    n, fps = cfg.num_frames, cfg.fps
    if n is None or n < 1 or (n - 1) % 4:
        raise VideoConfigError(f"num_frames={n}: Wan's VAE compresses time 4x, so use 4k+1 frames (e.g. 9, 33, 81)")
    if fps is None or fps <= 0:
        raise VideoConfigError(f"fps={fps}: use a positive frame rate (the model cards' is 16)")
    if cfg.video_codec not in av.codecs_available:
        raise VideoConfigError(f"video_codec={cfg.video_codec!r} is not an FFmpeg encoder of this PyAV build; "
                               f"use libx264 (H.264), libx265, libvpx-vp9 or mpeg4")
    if not 0 <= cfg.video_crf <= 51:
        raise VideoConfigError(f"video_crf={cfg.video_crf}: use 0 (lossless) .. 51 (worst); 18 is visually lossless")


def video_fingerprint(cfg: Any) -> dict:
    """The settings that determine a video sample's bytes (empty for image runs, so their fingerprints stay)."""
    if not is_video(cfg):
        return {}
    return {"num_frames": cfg.num_frames, "fps": cfg.fps, "video_codec": cfg.video_codec,
            "video_crf": cfg.video_crf, "model.guidance_2": cfg.model.get("guidance_2")}


def yuv420p(frame: np.ndarray) -> np.ndarray:
    """An HxWx3 uint8 RGB frame (H and W even) as PyAV's yuv420p array ((H * 3 / 2) x W: the Y plane, then the U
    and V planes' rows): BT.601 limited range, the colour FFmpeg assumes for an untagged stream, chroma averaged
    over 2x2 pixels. Converted here rather than by the encoder's libswscale, whose output for the same frames was
    seen to vary between encodes in one process (a resumed video then differed from an uninterrupted one)."""
    h, w = frame.shape[:2]
    r, g, b = (frame[..., i].astype(np.float64) for i in range(3))
    y = 16.0 + (65.481 * r + 128.553 * g + 24.966 * b) / 255.0
    u = 128.0 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255.0
    v = 128.0 + (112.0 * r - 93.786 * g - 18.214 * b) / 255.0
    half = lambda c: c.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))  # noqa: E731
    planes = [np.clip(np.rint(c), 0, 255).astype(np.uint8).ravel() for c in (y, half(u), half(v))]
    return np.concatenate(planes).reshape(h * 3 // 2, w)


def encode_video(frames: np.ndarray, fps: int, codec: str = "libx264", crf: int = 18) -> bytes:
    """Encode FxHxWx3 uint8 frames as mp4 bytes (deterministic: one encoder thread, no timestamps in metadata)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = PIX_FMT
        stream.thread_count = 1
        if codec in CRF_CODECS:
            stream.options = {"crf": str(crf)}
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(yuv420p(frame), format=PIX_FMT)))
        out.mux(stream.encode(None))  # flush the encoder's delayed frames
    return buf.getvalue()


@dataclass(frozen=True)
class VideoInfo:
    """What a decoder finds in an mp4."""

    frames: int
    fps: float
    width: int
    height: int
    codec: str

    @property
    def duration(self) -> float:
        return round(self.frames / self.fps, 4) if self.fps else 0.0


def decode_video(data: bytes) -> tuple[np.ndarray, VideoInfo]:
    """(FxHxWx3 uint8 frames, info) of mp4 bytes; raises on a stream that does not decode (ValueError for a file
    without a video stream or without a frame: nothing to show or compare)."""
    import av

    with av.open(io.BytesIO(data), mode="r") as f:
        if not f.streams.video:
            raise ValueError("the file holds no video stream")
        stream = f.streams.video[0]
        frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(stream)]
        info = VideoInfo(frames=len(frames), fps=float(stream.average_rate or 0), width=stream.codec_context.width,
                         height=stream.codec_context.height, codec=stream.codec_context.name)
    if not frames:
        raise ValueError("its video stream holds no frame")
    return np.stack(frames), info


@dataclass(frozen=True)
class VideoEncoder:
    """The writers' encoder for a video run: a sample's frames into mp4 bytes, its json gaining the video fields.
    Its fields are the keys of the same name (schema.py's VideoConfig: their defaults and docstrings are there)."""

    fps: int
    video_codec: str
    video_crf: int
    ext: str = VIDEO_EXT

    @classmethod
    def from_cfg(cls, cfg: Any) -> "VideoEncoder":
        """The encoder of a composed config (or anything holding the keys fps, video_codec, video_crf)."""
        return pick(cls, cfg)

    def __call__(self, sample) -> bytes:
        frames, codec = sample.pixels, self.video_codec
        data = encode_video(frames, self.fps, codec, self.video_crf)
        n, h, w = (int(x) for x in frames.shape[:3])
        sample.meta.update(frames=n, fps=self.fps, duration=round(n / self.fps, 4), size=[w, h], codec=codec,
                           crf=self.video_crf if codec in CRF_CODECS else None, pix_fmt=PIX_FMT)
        return data


def check_video_member(key: str, data: bytes, meta: dict) -> list[str]:
    """Problems with one sample's mp4: it must decode, with the frame count and size its json records."""
    try:
        frames, info = decode_video(data)
    except Exception as e:
        return [f"{key}: video does not decode ({e})"]
    problems = []
    if info.frames != meta.get("frames"):
        problems.append(f"{key}: mp4 has {info.frames} frames, its json says {meta.get('frames')}")
    if "size" in meta and [info.width, info.height] != meta["size"]:
        problems.append(f"{key}: mp4 is {info.width}x{info.height}, its json says {meta['size'][0]}x{meta['size'][1]}")
    return problems


def preview_png(data: bytes) -> bytes:
    """Four frames of an mp4 (first, one third, two thirds, last) in a 2x2 grid, as PNG bytes: a
    contact-sheet cell with the video's own aspect ratio."""
    from PIL import Image

    frames, _ = decode_video(data)
    picks = [frames[i] for i in np.linspace(0, len(frames) - 1, 4).round().astype(int)]
    grid = np.concatenate([np.concatenate(picks[:2], axis=1), np.concatenate(picks[2:], axis=1)], axis=0)
    buf = io.BytesIO()
    Image.fromarray(grid).save(buf, format="PNG")
    return buf.getvalue()
