"""How many samples a shard holds when samples_per_shard is not set: about TARGET_SHARD_BYTES of encoded
samples (the output format's size estimate, formats.py), spread over the replicas."""

from __future__ import annotations

import logging

from shardgen.dataio.prompts.plan import estimate_rows
from shardgen.dataio.prompts.read import PromptSource
from shardgen.dataio.shards.formats import VIDEO_EXT, sample_bytes_estimate

log = logging.getLogger("shardgen.plan")

TARGET_SHARD_BYTES = 300_000_000  # a few hundred MB: big enough for streaming reads, small enough to redo
# when the prompts allow: a replica that finishes early takes another shard. The run's tail (the replicas idle
# while the last shards finish) is about one shard's time, so its share of a run is ~1/SHARDS_PER_REPLICA: at 4 a
# simulated run lost 7-11% of its GPU time idle at the end, at 16 3-4% (benchmarks/tail_sweep.py, docs/scaling.md)
SHARDS_PER_REPLICA = 16
MAX_SAMPLES_PER_SHARD = 100_000


def choose_samples_per_shard(num_rows: int, *, width: int, height: int, image_format: str, replicas: int,
                             batch_size: int, frames: int = 1) -> tuple[int, str]:
    """(samples per shard, why): about TARGET_SHARD_BYTES of images per shard, but at least
    SHARDS_PER_REPLICA shards per replica when the prompts allow, never below a batch, and a whole
    number of batches: every batch of a shard but the run's last then has the same shape, so a compiled
    model never compiles again for a shard's short last batch (on an H200 that cost 16-40 s per process).
    ``image_format`` mp4 with ``frames``: a video run."""
    sample_bytes = sample_bytes_estimate(width=width, height=height, image_format=image_format, frames=frames)
    by_size = max(1, int(TARGET_SHARD_BYTES // sample_bytes))
    by_spread = -(-num_rows // (SHARDS_PER_REPLICA * max(1, replicas)))
    n = min(MAX_SAMPLES_PER_SHARD, max(min(by_size, by_spread), min(batch_size, by_size)))
    if n > batch_size > 1:  # rounded down: smaller shards only spread the work better
        n = n // batch_size * batch_size
    what = f"{width}x{height} {image_format}" + (f" of {frames} frames" if image_format == VIDEO_EXT else "")
    why = (f"~{sample_bytes / 1e6:.2f} MB per {what} sample: {by_size} fit in "
           f"{TARGET_SHARD_BYTES / 1e6:.0f} MB; {num_rows} prompts over {replicas} replica(s) x {SHARDS_PER_REPLICA} "
           f"shards: {by_spread}; at least a batch ({batch_size}), a whole number of batches")
    return max(1, n), why


def resolve_samples_per_shard(requested: int | None, source: PromptSource, images: int = 1, **run) -> int:
    """``requested`` if set, else the choice of ``choose_samples_per_shard`` (logged with its reasons), for
    ``images`` samples per prompt row and rounded up to a multiple of it (a shard holds whole prompts);
    ``run``: width, height, image_format, replicas, batch_size."""
    if requested is not None:
        return requested
    n, why = choose_samples_per_shard(estimate_rows(source) * images, **run)
    if n % images:
        n += images - n % images
        why += f"; a multiple of images_per_prompt ({images})"
    log.info("samples_per_shard=%d (chosen: %s; set samples_per_shard=N to choose)", n, why)
    return n
