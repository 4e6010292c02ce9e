"""Config schema: dataclasses registered in Hydra's ConfigStore (by store.py: register_configs).

``conf/generate.yaml`` starts its defaults list with ``generate_schema``, so every YAML file
and command-line override is merged onto these typed nodes: a misspelled key fails while the
config is composed ("Key 'tp_degre' is not in struct"), with nothing loaded or written.

This is the one source of every default: the YAML files choose group options and set only what
an option changes (a model's size, a strategy's own settings), never a default again.

The top-level keys are grouped by what reads them (RunConfig, GenerationConfig, OutputConfig, VideoConfig,
ParallelDegrees, SpeedConfig, QualityConfig, CoordinationConfig: ``GROUPS``); GenerateConfig inherits every group,
so the keys stay flat on the command line and in the YAML (``compile=false``, ``tp_degree=4``, ``video_crf=20``). A new key is
one field with a docstring in its group (the docstring is its ``--help`` text, under the group's heading).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import II, MISSING

from shardgen.dataio.prompts import DEFAULT_SEED_FIELD, MAX_PROMPT_CHARS
from shardgen.dataio.rundir import HEARTBEAT_S, LEASE_S


@dataclass(kw_only=True)
class ModelConfig:
    """What pipeline to build and how."""

    name: str = MISSING
    """Short name used in sample metadata and logs (tiny, flux_dev, ...)."""
    pipeline: str = "FluxPipeline"
    """diffusers pipeline class name."""
    source: str = MISSING
    """Hub id or local directory of a diffusers pipeline; ``tiny`` builds the embedded model."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) for reproducible runs."""
    weights: str = "pretrained"
    """``pretrained`` (read safetensors) or ``dummy`` (real architecture, random weights, built on the device)."""
    dtype: str = "bfloat16"
    """Default compute dtype of this model (the top-level ``dtype`` overrides it)."""
    height: int = 1024
    """The model's image height in pixels (the top-level ``height`` overrides it for a run)."""
    width: int = 1024
    """The model's image width in pixels (the top-level ``width`` overrides it)."""
    steps: int = 28
    """The model's denoising steps (the top-level ``steps`` overrides it)."""
    guidance: float = 3.5
    """Guidance scale (FLUX: distilled guidance embedding)."""
    true_cfg_scale: float = 1.0
    """True classifier-free guidance (Qwen-Image, FLUX with a negative prompt); 1.0 = off."""
    strength: float = 0.6
    """Image-to-image models: how far a sample may go from its input image, above 0 and at most 1 (1 = the image
    replaced by noise); a row may give its own (prompts.row_settings=[image,strength])."""
    negative_prompt: Optional[str] = None
    """With true CFG: the negative prompt of every sample; null = a blank one. At most prompts.max_prompt_chars."""
    max_sequence_length: int = 512
    """Text tokens for the T5/LLM encoder; the same for every prompt so batching never pads differently."""
    num_frames: Optional[int] = None
    """Video models: frames per sample (4k+1 for Wan); null = an image model."""
    fps: Optional[int] = None
    """Video models: frame rate of the written mp4 (the model card's)."""
    guidance_2: Optional[float] = None
    """Wan 2.2 A14B: guidance scale of the low-noise expert (``guidance_scale_2``); null = ``guidance``."""
    cache_dir: Optional[str] = None
    """Where the embedded tiny model is built and cached (default: $SHARDGEN_CACHE or ~/.cache/shardgen)."""
    loras: List[Any] = field(default_factory=list)
    """LoRA adapters applied to every sample, fused into the weights before any strategy splits them, each a
    .safetensors path (relative: from the current directory) at scale 1, a "PATH:SCALE" string, or {path, scale}:
    'model.loras=[style.safetensors]', 'model.loras=["style.safetensors:0.8"]', 'model.loras=[{path:
    style.safetensors, scale: 0.8}]' (scale 1.0 = as trained, 0 = off). A different file on resume is refused like any
    other setting; each sample's json lists the adapters it was made with (path, scale, sha256). Rows may name
    their own with prompts.row_settings=[loras]."""


@dataclass(kw_only=True)
class StrategyConfig:
    """How one model replica is spread over devices; replicas always split the data (dp)."""

    name: str = MISSING
    """dp | tp | cp_ulysses | cp_ring | cp_unified | device_map | auto: one YAML each in conf/strategy/ (the
    defaults list picks dp)."""
    attention_backend: Optional[str] = None
    """diffusers attention backend (``_native_cudnn``, ``flash``, ...); null = a default for the device."""
    ulysses_anything: bool = False
    """Ulysses over any sequence length / head count (no divisibility requirement)."""
    ring_anything: bool = False
    """Ring over any sequence length."""
    max_memory: Any = None
    """device_map: memory cap of each GPU of the replica (``70GiB``), or per GPU index within the replica
    (``+strategy.max_memory.0=70GiB``); null = 90% of what is free."""
    gpus_per_replica: int = 1
    """device_map: GPUs one replica (one process) spans."""
    degree: int = 1
    """Ranks per replica of a strategy whose mesh dimension is its own (its YAML says so)."""


@dataclass(kw_only=True)
class LauncherConfig:
    """Where the ranks come from: what every launcher has (each launcher= option extends it with its own fields)."""

    name: str = "none"
    """none (this process; torchrun's ranks when detected; a strategy whose replica takes N ranks: those N spawned
    here) | local (spawn nprocs ranks) | slurm (submitit) | ray (actors on a Ray cluster)"""
    backend: Optional[str] = None
    """torch.distributed backend; null = nccl on CUDA, gloo on CPU."""


@dataclass(kw_only=True)
class LocalLauncherConfig(LauncherConfig):
    """launcher=local: ranks spawned on this machine."""

    name: str = "local"
    """The launcher's name in LAUNCHERS (shardgen/config/launchers.py)."""
    nprocs: int = 1
    """Ranks to spawn on this machine."""


@dataclass(kw_only=True)
class SlurmLauncherConfig(LauncherConfig):
    """launcher=slurm: SLURM tasks submitted through submitit, one rank each."""

    name: str = "slurm"
    """The launcher's name in LAUNCHERS (shardgen/config/launchers.py)."""
    partition: Optional[str] = None
    """the partition (sbatch --partition); null = the cluster's default."""
    account: Optional[str] = None
    """the account to charge (sbatch --account)."""
    qos: Optional[str] = None
    """the quality of service (sbatch --qos)."""
    nodes: int = 1
    """nodes per job."""
    gpus_per_node: int = 0
    """GPUs per node (sbatch --gpus-per-node); 0 = a CPU job."""
    tasks_per_node: Optional[int] = None
    """Ranks per node; null = gpus_per_node (or 1 without GPUs)."""
    cpus_per_task: int = 4
    """CPU cores per rank."""
    mem_gb: Optional[int] = None
    """memory per node in GB; null = the cluster's default."""
    time_min: int = 240
    """Wall-time limit of each job, minutes; on timeout the job requeues and resumes."""
    constraint: Optional[str] = None
    """node features required (sbatch --constraint)."""
    exclude: Optional[str] = None
    """nodes not to use (sbatch --exclude)."""
    array: int = 1
    """Independent jobs sharing the run directory (each one a full set of nodes)."""
    array_parallelism: Optional[int] = None
    """at most this many of the array's jobs at once; null = all."""
    max_num_timeout: int = 3
    """Requeues allowed after timeouts (submitit); preemptions do not count."""
    signal_delay_s: int = 90
    """SLURM warns the job this many seconds before its time limit, so it can checkpoint and requeue."""
    max_failures: int = 2
    """A job whose rank failed (an error, or a stall: stall_timeout_s) requeues itself this many times,
    resuming from the run directory; 0 = stop at the first failure. Setup errors are never retried."""
    kill_on_bad_exit: bool = True
    """srun --kill-on-bad-exit: a rank that dies ends the whole job at once, instead of leaving its peers
    waiting in collectives (as torchrun does); the same command, rerun, continues the run."""
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    """Extra sbatch parameters, e.g. {mail-type: END}."""
    wait: bool = False
    """Wait for the jobs and report, instead of returning after submission."""
    log_dir: Optional[str] = None
    """SLURM logs; null = <run_dir>/logs/slurm."""


@dataclass(kw_only=True)
class RayLauncherConfig(LauncherConfig):
    """launcher=ray: each replica a Ray placement group whose ranks are actors (shardgen/launch/ray_cluster.py)."""

    name: str = "ray"
    """The launcher's name in LAUNCHERS (shardgen/config/launchers.py)."""
    address: Optional[str] = None
    """The Ray cluster to run on (ray.init's address: ``auto``, ``HOST:PORT`` or ``ray://HOST:10001``); null =
    RAY_ADDRESS, else a one-machine cluster started for this launch (the local debug path)."""
    replicas: int = 1
    """Replicas to start: each one its own torch.distributed world of ranks_per_replica actors, packed on one
    node; the replicas share the run directory's shards through its claims, as SLURM array jobs do."""
    ranks_per_replica: Optional[int] = None
    """Ranks (actors) per replica; null = what the strategy's degrees make (tp_degree=2: 2), 1 with strategy=auto."""
    gpus_per_rank: float = 1.0
    """GPUs each rank asks Ray for (0 = a CPU rank); device=cpu asks for none whatever this says."""
    cpus_per_rank: float = 1.0
    """CPU cores each rank asks Ray for (its torch threads)."""
    max_restarts: int = 3
    """A replica whose actor or node is lost is started again (it resumes from the run directory) at most this
    many times in a launch; 0 = the launch stops at the first loss."""
    placement_timeout_s: float = 600.0
    """How long the launch waits for the cluster to place the first replica (an autoscaler adding nodes) before
    it stops, saying what the cluster has; the replicas after it start whenever they are placed."""


@dataclass(kw_only=True)
class PromptsConfig:
    """The prompt file and how to read it."""

    path: str = MISSING
    """The prompt file (mandatory for every prompts option but default: prompts=parti prompts.path=FILE), or its
    fsspec URL (s3://bucket/captions.parquet, gs://, hf://, https://; read by ranged requests)."""
    format: str = "auto"
    """auto (by extension) | txt | jsonl | csv | tsv | parquet"""
    field: str = "prompt"
    """Column (csv/tsv/parquet) or field (jsonl) holding the prompt."""
    seed_field: str = DEFAULT_SEED_FIELD
    """Optional per-row seed column/field."""
    on_bad_row: str = "error"
    """error: stop before any generation, naming file and line | skip: record a reject and go on."""
    limit: Optional[int] = None
    """Only the first N rows (a quick try on a big file)."""
    on_truncation: str = "warn"
    """A prompt longer than a text encoder keeps: warn (generate it truncated, flagged in its json) |
    error (stop while planning) | skip (record it as a reject)."""
    max_prompt_chars: int = MAX_PROMPT_CHARS
    """A longer prompt (or a row's negative_prompt) is a bad row (an error naming file:line, or a reject with
    on_bad_row=skip), found before anything tokenizes it; model.negative_prompt is held to it too. A line over
    12 bytes a character plus 1 MiB (other fields) is a bad row read past in bounded chunks, never held: a runaway
    line (a whole file without newlines) cannot exhaust memory."""
    row_settings: List[str] = dataclasses.field(default_factory=list)  # (``field`` is a key of this class)
    """Fields (jsonl) or columns (csv/tsv/parquet) that set a row's own generation settings, e.g.
    prompts.row_settings=[aspect_ratio,negative_prompt,guidance]; a null or empty value keeps the run's. Any of:
    width, height (pixels, a multiple of the model's 16), aspect_ratio ("16:9", "1:1", "3:4": a size at the run's
    height x width area), negative_prompt, guidance, true_cfg_scale (1 = off), steps, num_frames (video models),
    loras (LoRA adapters instead of model.loras: [{"path": "style.safetensors", "scale": 0.8}] or
    ["style.safetensors:0.8"], csv/tsv "style.safetensors:0.8;other.safetensors", paths from the prompt file's
    folder, [] = none; not with strategy=tp or fp8), image (image-to-image, edit and image-to-video models: the
    row's input image, a path from the prompt file's folder or absolute, or parquet image bytes; a missing or
    unreadable one rejects its row, one gone after planning fails it for retry_failed=true; its sha256 in the
    sample's json and the index), strength (image-to-image: above 0, at most 1), images_per_prompt (1 to 1000
    samples of the row instead of the run's images_per_prompt).
    Checked while planning (a bad value is a bad row: file:line, or a reject with on_bad_row=skip); rows of the
    same size, guidance and adapters are batched together; each sample's json records its settings. Default []: every
    column stays metadata (shardgen/dataio/prompts/rowsettings.py)."""


@dataclass(kw_only=True)
class RunConfig:
    """Run: the run directory and what this launch does with it."""

    run_dir: str = "runs/default"
    """The run: plan, shards, checkpoints, claims. Re-running the same command continues it. s3://BUCKET/PREFIX
    keeps the whole run in the bucket, for machines without a shared file system (docs/scaling.md)."""
    samples_per_shard: Optional[int] = None
    """Samples per shard; null = chosen from the image size and the ranks (a few hundred MB per shard,
    several shards per replica; the choice is logged). Fixed once the run is planned."""
    plan_replicas: Optional[int] = None
    """With samples_per_shard null: the replicas the shards are sized for (about 16 shards each, so the run's tail,
    the last shards' time with replicas idle, stays ~1/16 of the run); null = this launch's replicas. Set it when
    more launches will work on the same run_dir than the one that plans it (e.g. 500 one-GPU SLURM jobs:
    plan_replicas=500). Fixed once the run is planned."""
    retry_failed: bool = False
    """Regenerate exactly the samples recorded as failed in committed shards."""
    allow_fingerprint_change: bool = False
    """Continue a run whose pixel-determining settings changed: its samples then mix both settings (the ones already
    made stay; jobs.verify notes them, and recorded in fingerprint_changes.jsonl). Not needed for a run without a
    sample yet (one whose model did not load): it takes new settings by itself. To compare settings, use a new
    run_dir instead."""
    dry_run: bool = False
    """Print what this launch would do (prompts, shards, replicas, strategy, expected size and time) and stop:
    no model is loaded and nothing is written to run_dir (a new plan is made in a temporary directory)."""
    check_memory: bool = True
    """Before building the model: refuse when its weights (sized from its config) do not fit the memory of the
    device each rank builds it on, saying what to change; false = try anyway (parallel/memory.py)."""
    progress: bool = True
    """Show a progress bar (leader of replica 0)."""


@dataclass(kw_only=True)
class GenerationConfig:
    """Generation: what every sample is made with.

    A row may set its own size, steps and guidance (prompts.row_settings)."""

    height: int = II("model.height")
    """Image height in pixels (default: the model's); a multiple of 16, at most 8192."""
    width: int = II("model.width")
    """Image width in pixels (default: the model's); a multiple of 16, at most 8192."""
    steps: int = II("model.steps")
    """Denoising steps (default: the model's)."""
    guidance: float = II("model.guidance")
    """Guidance scale (default: the model's); a finite number, like every number of the config."""
    scheduler: Optional[str] = None
    """The sampler, instead of the model's own: euler (flow-matching Euler), unipc (UniPC), lcm (flow-matching
    LCM, for few-step distilled models), dpmpp_2m (DPM-Solver++ 2M; Wan only), each in its flow-matching form
    and built from the model's scheduler config (shardgen/models/schedulers.py); null = the model's own. Recorded
    in each sample's provenance and the run's fingerprint."""
    scheduler_shift: Optional[float] = None
    """The flow shift of the sampler (sigma shift; FLUX.1-dev's 3.0, Wan 720p's 5.0): a number fixes it and turns
    resolution-dependent dynamic shifting off; null = the model's. In the fingerprint."""
    seed: int = 0
    """Run seed; a sample's seed is f(seed, prompt index) unless its row has one."""
    images_per_prompt: int = 1
    """Samples made of each prompt (diffusers' num_images_per_prompt), 1 to 1000: image k of prompt i is sample
    i x images_per_prompt + k, with its own key and seed (image 0 the prompt's seed, image k a hash of it and k:
    the same whatever the batch size or ranks); its json and index record prompt_index and image. A multiple of it
    is each shard's size (samples_per_shard)."""
    batch_size: int = 4
    """Prompts per pipeline call, per replica."""
    device: str = "auto"
    """auto | cpu | cuda"""
    dtype: str = II("model.dtype")
    """float32 | float64 | bfloat16 | float16 (default: the model's)."""


@dataclass(kw_only=True)
class OutputConfig:
    """Output: how samples are encoded and written."""

    image_format: str = "png"
    """png | jpg | webp"""
    image_quality: int = 95
    """jpg/webp quality (1-100)."""
    writer_threads: int = 2
    """Background image encoders per replica."""
    shard_container: str = "tar"
    """The shard files' format: tar (webdataset's) or a container a module registers
    (shardgen/dataio/shards/container.py). Fixed once the run is planned (plan/plan.json records it)."""
    output_uri: Optional[str] = None
    """Where committed shards are uploaded besides run_dir/shards (an fsspec URL: s3://bucket/run/, gs://...):
    tar, index, then stats (the done marker, last); null = run_dir only. Claims and heartbeats stay in run_dir."""
    keep_local: bool = True
    """With output_uri: false deletes a shard's local tar, index and stats once their upload is confirmed
    (run_dir/uploads keeps the record: the shard's done marker; status/verify/report/dedup read the bucket), so
    run_dir/shards holds only the shards in flight."""


@dataclass(kw_only=True)
class VideoConfig:
    """Video models: frames, the mp4 encoding, mid-sample checkpoints.

    shardgen/dataio/shards/video.py, shardgen/run/latent_ckpt.py."""

    num_frames: Optional[int] = II("model.num_frames")
    """Video models: frames per sample (default: the model's); null for image models."""
    fps: Optional[int] = II("model.fps")
    """Video models: mp4 frame rate (default: the model's)."""
    video_codec: str = "libx264"
    """Video models: FFmpeg encoder of the mp4 (libx264 = H.264, libx265, libvpx-vp9, mpeg4);
    shardgen/dataio/shards/video.py."""
    video_crf: int = 18
    """Video models: x264/x265 constant rate factor, 0 (lossless) .. 51; 18 is visually lossless."""
    latent_checkpoint_every: Any = "auto"
    """Video models (strategy dp): save each batch's latents and scheduler state durably every N denoising steps,
    so a killed run resumes the batch from the last saved step (shardgen/run/latent_ckpt.py). auto: whenever
    latent_checkpoint_s of a batch's denoising passed since its start or last save (only batches that take
    longer than that ever save; image models and model-parallel strategies: off); null = off."""
    latent_checkpoint_s: float = 60.0
    """With latent_checkpoint_every=auto: the most denoising time a kill may cost a video batch, seconds."""


@dataclass(kw_only=True)
class ParallelDegrees:
    """Parallel degrees: ranks per replica along each model-parallel dimension.

    Top-level keys, read by the strategies (parallel/dims.py), so that ``strategy=tp tp_degree=4`` works as typed."""

    tp_degree: int = 1
    """Tensor-parallel ranks per replica (strategy=tp)."""
    ulysses_degree: int = 1
    """Ulysses context-parallel ranks per replica (strategy=cp_ulysses / cp_unified)."""
    ring_degree: int = 1
    """Ring context-parallel ranks per replica (strategy=cp_ring / cp_unified)."""
    cfg_degree: int = 1
    """CFG-parallel ranks per replica (1 or 2): with true CFG (model.true_cfg_scale > 1), one rank computes the
    conditional branch and one the unconditional; composes with the other degrees (parallel/cfg.py)."""


# sdpa_backend values that are LOSSY 8-bit attention kernels: part of the fingerprint and provenance
EIGHT_BIT_ATTENTION = ("sage", "fp8", "fa3_fp8")
# and the value that asks for one of them where it pays (shardgen/run/auto_8bit.py): part of the fingerprint as asked
LOSSY_SDPA_BACKENDS = EIGHT_BIT_ATTENTION + ("auto_8bit",)


@dataclass(kw_only=True)
class SpeedConfig:
    """Speed: shardgen/speed/accel.py; the LOSSY options are opt-in.

    Measured in docs/performance.md."""

    compile: Any = "auto"
    """Regional compilation of the transformer's repeated blocks: true | false | auto. auto: off on CPU and for
    the model-parallel strategies; on CUDA with strategy dp each process compiles only when the work it has
    left saves more than compiling costs (recorded per GPU and model in $SHARDGEN_CACHE/compile, else priors;
    the first batch runs eagerly to measure). shardgen/speed/regional_compile.py, shardgen/speed/autocompile.py."""
    compile_mode: str = "default"
    """torch.compile mode for the regional compilation (compile=true): default | max-autotune-no-cudagraphs |
    max-autotune. Autotuning costs minutes of compilation per shape. shardgen/speed/regional_compile.py."""
    compile_tuning: Any = "auto"
    """Inductor's coordinate-descent tuning of the compiled blocks' Triton kernels on CUDA (~+40 s of compilation
    once per cache, ~2% faster steps): true | false | auto. auto: tuned under compile=true; under compile=auto a
    process tunes only when the work it has left pays for the tuning's compile time (shardgen/speed/autocompile.py)."""
    fused_blocks: bool = True
    """The transformer's blocks run its family's fused forwards (FLUX.1: shardgen/families/flux/fused.py, FLUX.2:
    flux2/fused.py, Qwen-Image: qwen_image/fused.py): LayerNorm+modulation, q/k RMSNorm+RoPE, SwiGLU in one Triton pass
    each, GELU in the GEMM epilogue, gated residuals in one pass (in bf16 together with the LayerNorm+modulation that
    reads them, the next block's first one included: shardgen/speed/block_chain.py). Eagerly on CUDA (compile=false
    included; on an H200 FLUX.2-dev's and Qwen-Image's eager blocks then run as fast as their compiled ones,
    FLUX.1-dev's within 4%), and compiled with compile=true for FLUX.1. Qwen-Image's joint attention runs without its
    key-padding mask on CUDA (shardgen/speed/prefix_attention.py). Exact up to bf16 rounding; other models, tp/cp runs
    and CPU runs keep the stock blocks; false = diffusers' own blocks."""
    fused_decode: bool = True
    """On CUDA, the VAE's decode in fewer passes: the image decoder of FLUX.1, FLUX.2 and SD3 channels-last with each
    GroupNorm and its SiLU in two Triton passes; the causal video VAEs (Qwen-Image, Wan) decode a frame without a
    cache (an image, a video's first frame) with 2-D convolutions instead of zero-padded 3-D ones. Exact up to bf16
    rounding; CPU runs keep the stock decoder; false = diffusers' own. shardgen/speed/fused_decode.py."""
    sdpa_backend: str = "auto"
    """Kernel behind diffusers' default attention (torch SDPA) on CUDA: auto (the fastest of flash / cudnn /
    efficient, and of FlashAttention-3's bf16 kernel where fa3-fwd is installed, measured once at the run's shape;
    flash unless another is 5% faster) | default | flash | cudnn | efficient | math | fa3 (FlashAttention-3's bf16
    kernel: pip install fa3-fwd; H100/H200 only; 7-15% faster than cuDNN at FLUX's and Qwen-Image's shapes) | fa4 (FlashAttention-4: needs pip install flash-attn-4, torch>=2.11 and an H100/H200/B200;
    faster than cuDNN for long videos and 64-wide heads, see docs/performance.md). Exact up to bf16 rounding.
    sage | fp8 | fa3_fp8: opt-in, LOSSY 8-bit attention, compiled blocks included; the calls it cannot take keep
    auto's kernel: sage is SageAttention's INT8 QK / fp16 PV Triton kernel (pip install 'sageattention>=1.0.6,<2');
    fp8 is shardgen's own INT8 QK / float8 PV Triton kernel (compute capability 8.9+, nothing to install); fa3_fp8
    is FlashAttention-3's float8 kernel (pip install fa3-fwd; H100/H200 only; docs/lossy.md). auto_8bit (LOSSY,
    speed=fast's): the 8-bit kernel measured faster for the model (fa3_fp8 for FLUX.1 and FLUX.2) where this GPU
    runs it, else auto; chosen at the run's first launch and kept for the run (RUN_DIR/attention.json).
    shardgen/speed/sdpa.py, fa4.py, sage.py, fp8_attention.py, fa3_fp8.py."""
    cfg_batching: bool = False
    """Models with true CFG (Qwen-Image, true_cfg_scale > 1): the conditional and unconditional transformer
    calls of a step run as one call of twice the batch. Exact (same pixels on CPU in float64); off by default:
    on an H200 at batch 4, 1024x1024 it is no faster (1.00x; docs/performance.md)."""
    cuda_graphs: bool = True
    """On CUDA, with the blocks eager and one GPU per replica, the transformer's calls replay CUDA graphs (one per
    call shape, captured at its second call) instead of launching each kernel from Python: on an H200 batches 1.1%
    (FLUX.1-dev) and 0.4% (FLUX.2-dev) faster, ~1.5 s once to capture. Exact (the same kernels on the same inputs);
    families that declare it (FLUX.1, FLUX.2); false = every call eager. shardgen/speed/cuda_graphs.py."""
    first_block_cache: float = 0.0
    """Opt-in, LOSSY: diffusers First-Block-Cache threshold (e.g. 0.05-0.2); 0 = off. Skips the remaining
    blocks of a step when the first block's output barely changed; decided per batch."""
    fp8: bool = False
    """Opt-in, LOSSY: the transformer blocks' linear layers in float8 e4m3 (torch._scaled_mm, row-wise
    scales); needs compute capability 8.9+. Each layer is converted in place (half its weight memory, no bf16 copy
    kept), eagerly with one Triton pass per activation quantisation. What it costs in fidelity: calibrate_samples
    below, or jobs.compare against a lossless run. shardgen/speed/fp8.py."""


@dataclass(kw_only=True)
class QualityConfig:
    """Quality gate: what a LOSSY setting (fp8, first_block_cache) costs, measured before the run is spent.

    shardgen/quality/gate.py; figures against a whole lossless run: python -m jobs.compare."""

    calibrate_samples: int = 0
    """With a lossy setting on: the run's first N prompts are also made losslessly before the run starts, and
    the lossy samples compared with them (PSNR, SSIM); the figures go into every sample's provenance and
    RUN_DIR/calibration.json. 0 = no calibration. Costs 2N samples on the run's first launch, split among the
    job's replicas (each of k makes every k-th row both ways; a one-GPU job's replica then commits its lossy ones
    instead of making them again); a later launch (a requeue, a resume) on the same GPU model and package versions
    takes the passed verdict from calibration.json instead."""
    calibrate_min_psnr: float = 0.0
    """The worst calibration sample's PSNR (dB) must reach this; 0 = no bound."""
    calibrate_min_ssim: float = 0.0
    """The worst calibration sample's SSIM must reach this; 0 = no bound."""
    calibrate_max_lpips: float = 0.0
    """The worst calibration sample's LPIPS must stay at or under this; 0 = no bound. Needs the two LPIPS weight
    files below (docs/lossy.md: where they come from; nothing is downloaded)."""
    calibrate_lpips_backbone: Optional[str] = None
    """torchvision's AlexNet state dict (alexnet-owt-7be5be79.pth), a local file: with calibrate_lpips_layers, the
    calibration's figures include LPIPS."""
    calibrate_lpips_layers: Optional[str] = None
    """The lpips package's weights/v0.1/alex.pth, a local file (with calibrate_lpips_backbone)."""
    calibrate_fallback: str = "stop"
    """Below a bound: stop (the job ends with one line before any sample is made) | lossless (the run goes on
    with the lossy settings off; with fp8 the bf16 layers are kept on the CPU meanwhile to switch back)."""


@dataclass(kw_only=True)
class CoordinationConfig:
    """Coordination: how replicas share a run directory.

    Shard claims (shardgen/dataio/rundir/claims.py) and stalled ranks (shardgen/run/watchdog.py)."""

    lease_s: float = LEASE_S
    """A shard claim whose heartbeat is older than this is taken over by another replica."""
    heartbeat_s: float = HEARTBEAT_S
    """How often a replica renews its shard claims (below lease_s)."""
    stall_timeout_s: Optional[float] = 1800.0
    """A rank stuck this long inside one batch or commit (a hung GPU or collective) exits, so the job ends
    instead of idling to its time limit; null = never. shardgen/run/watchdog.py."""


@dataclass(kw_only=True)
class NestedConfigs:
    """The config groups chosen with ``group=option`` (model=flux_dev, strategy=tp, ...), each a node of its own."""

    model: ModelConfig = MISSING
    strategy: StrategyConfig = MISSING
    launcher: LauncherConfig = MISSING
    prompts: PromptsConfig = MISSING
    signals: Dict[str, Any] = field(default_factory=dict)
    """Curation signals, a config group: signals=[phash,watermark,clip] (shardgen/dataio/shards/signals.py)."""


# The top-level keys' groups, in --help's order. GenerateConfig inherits their fields, so the keys stay flat
# (``tp_degree=4``, ``compile=false``) while each is defined once, in its group; a class reading a group's keys
# takes them with shardgen/pick.py (``pick(SpeedConfig, cfg)``), never by listing them again.
GROUPS = (RunConfig, GenerationConfig, OutputConfig, VideoConfig, ParallelDegrees, SpeedConfig, QualityConfig,
          CoordinationConfig)


@dataclass(kw_only=True)
class GenerateConfig(*reversed(GROUPS), NestedConfigs):  # a dataclass lists its last base's fields first
    """The main job: every prompt of ``prompts`` into one sample of ``run_dir``'s shards.

    Nothing of its own: the nested configs (``model.*``, ... first in a saved config) and every top-level key, each
    from one of ``GROUPS``."""
