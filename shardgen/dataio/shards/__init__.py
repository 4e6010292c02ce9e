"""Shards out: samples to tar shards, durably, with their index, video encoding and signals.

sink.py (``ShardSink``: encoding and writing on background threads), shardwork.py (``ShardWork``: where a
shard is checkpointed and committed), container.py (the shard container protocol and registry), tarshard.py (the tar container: writer, scanner and reader), index.py (the shard index),
formats.py (the output formats, one table: extension -> encoder, decoder, size estimate), sizing.py (samples
per shard), video.py (mp4 encode/decode), annotate.py (provenance and token counts), signals.py (curation
signals computed on the writer's threads), upload.py (committed shards copied to output_uri). Imports only the
rundir and prompts rooms.
"""

from typing import TYPE_CHECKING

from shardgen.dataio import lazy_names

if TYPE_CHECKING:
    from .annotate import SampleAnnotator, run_provenance, text_windows
    from .formats import IMAGE_EXTS, image_ext, sample_bytes_estimate
    from .index import committed_samples
    from .shardwork import Sample, ShardWork, durable_partial
    from .signals import Signals
    from .sink import ShardSink
    from .sizing import resolve_samples_per_shard
    from .container import ShardContainer, container_names, get_container, read_shard_members, register_container
    from .upload import ShardUploader, committed_tar, fetch_uploaded, upload_state, uploaded_elsewhere
    from .video import VIDEO_EXT, VideoEncoder, decode_video, encode_video, is_video, preview_png, validate_video_config

__all__ = ["IMAGE_EXTS", "Sample", "SampleAnnotator", "ShardContainer", "ShardSink", "ShardUploader", "ShardWork", "Signals",
           "VIDEO_EXT", "VideoEncoder", "committed_samples", "committed_tar", "container_names", "get_container", "decode_video", "durable_partial",
           "encode_video", "fetch_uploaded", "image_ext", "is_video", "preview_png", "read_shard_members", "register_container", "resolve_samples_per_shard",
           "run_provenance", "sample_bytes_estimate", "text_windows", "upload_state", "uploaded_elsewhere",
           "validate_video_config"]
__getattr__ = lazy_names(__name__, __all__)  # each name imported from its module on first use
