"""Strategies: every misconfiguration stopped with a message saying what to change before any weight is
read; auto's choice on synthetic machines; the CPU compatibility patches (and that they are still needed);
device_map's staged wrapper giving the pipeline's own pixels."""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import parallel.strategies as S
from shardgen.run.generation import GenSettings, pipeline_kwargs
from jobs.generate import run
from parallel.auto import AutoInputs, choose, decide
from parallel.strategies import DeviceFacts, ParallelConfigError, parallel_dims
from tests.conftest import compose_cfg

CPU = DeviceFacts(type="cpu", count=0, local_ranks=1)
GPUS = lambda n, local=1: DeviceFacts(type="cuda", count=n, local_ranks=local)  # noqa: E731


@pytest.fixture
def no_weights(monkeypatch):
    """Any attempt to read weights fails the test."""
    import diffusers

    from shardgen.models import loader

    def boom(*a, **k):
        pytest.fail("weights were read before the configuration was validated")

    monkeypatch.setattr(loader, "load_pipeline", boom)
    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained", classmethod(boom))
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", classmethod(boom))


def dims_for(monkeypatch, overrides, world_size, facts=CPU):
    monkeypatch.setattr(S, "device_facts", lambda cfg, ws: facts)
    return parallel_dims(compose_cfg(*overrides), world_size)


BAD = [  # (overrides, world size, device facts, what the message must say)
    (("strategy=dp", "tp_degree=2"), 2, CPU, "strategy=dp ignores tp_degree"),
    (("strategy=tp", "tp_degree=2"), 1, CPU, "do not divide the world of 1"),
    (("strategy=tp", "tp_degree=1"), 2, CPU, "needs tp_degree >= 2"),
    (("strategy=tp", "tp_degree=3"), 3, CPU, "tp_degree=3 does not divide the 4 attention heads"),
    (("strategy=tp", "tp_degree=2", "ulysses_degree=2"), 4, CPU, "are not combined"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "tp_degree=2"), 4, CPU, "are not combined"),
    (("strategy=cp_ulysses", "ulysses_degree=2"), 3, CPU, "do not divide the world of 3"),
    (("strategy=cp_ulysses", "ulysses_degree=1"), 2, CPU, "needs ulysses_degree >= 2"),
    (("strategy=cp_ring", "ring_degree=2", "ulysses_degree=2"), 4, CPU, "cp_ring needs ring_degree >= 2 and ulysses"),
    (("strategy=cp_ulysses", "ulysses_degree=3"), 3, CPU, "ulysses_degree=3 does not divide the 4 attention heads"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "height=48", "width=48"), 2, CPU,
     r"image tokens = 9 \(48/16 x 48/16\)"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "model.max_sequence_length=33"), 2, CPU, "text tokens = 33"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "strategy.ulysses_anything=true", "height=48", "width=48"), 2, CPU,
     "needs NCCL"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "strategy.ring_anything=true"), 2, CPU, "ring_anything=true needs"),
    (("strategy=cp_ring", "ring_degree=2"), 2, CPU, "log-sum-exp .* on CPU none does"),
    (("strategy=cp_unified", "ring_degree=2", "ulysses_degree=2"), 4, CPU, "ring_degree=2 needs an attention backend"),
    (("strategy=cp_ring", "ring_degree=2", "strategy.attention_backend=native"), 2, GPUS(2, 2), "'native' does not"),
    (("strategy=cp_ring", "ring_degree=2"), 2, GPUS(2, 2),
     "_native_cudnn runs bfloat16/float16 only, and dtype=float64"),
    (("strategy=cp_ring", "ring_degree=2", "dtype=bfloat16", "sdpa_backend=fp8"), 2, GPUS(2, 2),
     r"^sdpa_backend=fp8 replaces torch's SDPA, and ring attention runs through diffusers' _native_cudnn backend: the "
     r"8-bit kernel would never run. Either use strategy=cp_ulysses \(its attention is torch's SDPA\), or set "
     r"sdpa_backend=auto$"),
    (("strategy=dp", "strategy.attention_backend=_native_cudnn", "sdpa_backend=fa3_fp8"), 1, GPUS(1),
     r"^sdpa_backend=fa3_fp8 replaces torch's SDPA, and strategy.attention_backend=_native_cudnn sends attention "
     r"past it: the 8-bit kernel would never run. Either leave strategy.attention_backend unset, or set "
     r"sdpa_backend=auto$"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "strategy.attention_backend=bogus"), 2, CPU,
     "not a diffusers attention backend"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "strategy.attention_backend=xformers"), 2, CPU,
     "does not support context parallelism"),
    (("strategy=cp_ulysses", "ulysses_degree=2", "strategy.attention_backend=_native_cudnn"), 2, CPU, "CUDA kernel"),
    (("strategy=dp", "strategy.attention_backend=bogus"), 1, CPU, "'bogus' is not a diffusers attention backend"),
    (("strategy=device_map",), 1, CPU, "has no CUDA GPU \\(CPU only\\)"),
    (("strategy=device_map", "strategy.gpus_per_replica=2"), 1, GPUS(1), "needs 2 GPUs, but this machine has 1"),
    (("strategy=device_map", "model=flux_dev", "model.weights=dummy"), 1, GPUS(8), "builds the whole pipeline on one"),
    (("strategy=device_map", "model=qwen_image_edit", "model.weights=dummy", "strategy.gpus_per_replica=1"), 1,
     GPUS(1),
     r"does not know how QwenImageEditPipeline does \(Qwen-Image-Edit: its prompts are encoded with its input "
     r"images\); use strategy=dp, tp or fsdp"),
    (("strategy=tp", "tp_degree=2"), 4, GPUS(2, 4), "4 ranks per node need one GPU each"),
    (("strategy=tp", "tp_degree=2"), 8, GPUS(8, 4), "one rank per GPU on every node"),
    (("model=qwen_image", "model.weights=dummy", "strategy=cp_ulysses", "ulysses_degree=2"), 2, GPUS(2, 2),
     "text length of its own"),
    # the edit model's input image (fitted to ~1 MP at the sample's aspect) joins the split sequence: 3840 + 4092
    (("model=qwen_image_edit", "model.weights=dummy", "strategy=cp_ulysses", "ulysses_degree=8", "height=1024",
      "width=960", "prompts.row_settings=[image]"), 8, GPUS(8, 8),
     r"image \+ input image tokens = 7932 \(1024/16 x 960/16 \+ 4092 of the input image, fitted to 992x1056\) do "
     r"not divide by the CP degree 8 .* use height/width whose tokens and the input image's add up to a multiple"),
]


@pytest.mark.parametrize("overrides,world,facts,needle", BAD, ids=[" ".join(b[0]) + f" w{b[1]}" for b in BAD])
def test_misconfiguration_stopped_before_weights(monkeypatch, no_weights, overrides, world, facts, needle):
    with pytest.raises(ParallelConfigError, match=needle):
        dims_for(monkeypatch, overrides, world, facts)


def test_dp_applies_the_configured_attention_backend(tmp_path):
    """strategy.attention_backend is honoured by dp too, and a job runs with it."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    from parallel import dp
    from parallel.world import World

    cfg = compose_cfg("strategy.attention_backend=_native_math", "height=16", "width=16", "steps=1")
    dims = parallel_dims(cfg, 1)
    pipe = dp.apply(cfg, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), dims)
    backends = {m.processor._attention_backend for m in pipe.transformer.modules() if hasattr(m, "processor")}
    assert backends == {AttentionBackendName._NATIVE_MATH}
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)  # dp.apply above made it math
    assert run(compose_cfg("strategy.attention_backend=_native_math", f"run_dir={tmp_path / 'run'}", "height=16",
                           "width=16", "steps=1", "progress=false", "prompts.limit=2")).ok == 2
    # the job's backend was its own: a next job in this process (a notebook's) starts from the process's default
    assert _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE


def test_transformer_without_a_tp_plan(monkeypatch, no_weights, tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "SD3Transformer2DModel", "num_attention_heads": 24}))
    with pytest.raises(ParallelConfigError, match="SD3Transformer2DModel has no _tp_plan"):
        dims_for(monkeypatch, ("strategy=tp", "tp_degree=2", f"model.source={tmp_path}"), 2)
    with pytest.raises(ParallelConfigError, match="has no _cp_plan"):
        dims_for(monkeypatch, ("strategy=cp_ulysses", "ulysses_degree=2", f"model.source={tmp_path}"), 2)


def test_unreadable_transformer_config_says_what_to_do(monkeypatch, no_weights, tmp_path):
    with pytest.raises(ParallelConfigError, match="point model.source at its directory"):
        dims_for(monkeypatch, ("strategy=tp", "tp_degree=2", "model.source=nobody/nothing"), 2)


def test_whole_job_stops_before_run_dir_and_weights(no_weights, tmp_path):
    """Through the real entry point, on this machine: nothing written, no weight read."""
    with pytest.raises(ParallelConfigError, match="no CUDA GPU" if not torch.cuda.is_available() else "needs 2 GPUs"):
        run(compose_cfg("strategy=device_map", f"run_dir={tmp_path / 'run'}", "progress=false"))
    with pytest.raises(ParallelConfigError, match="tp_degree=3 does not divide the 4 attention heads"):
        run(compose_cfg("strategy=tp", "tp_degree=3", f"run_dir={tmp_path / 'run'}", "progress=false"))
    assert not (tmp_path / "run").exists()


def test_a_plain_command_whose_replica_takes_more_gpus_than_the_machine_has_stops_in_one_line(no_weights, tmp_path,
                                                                                             monkeypatch):
    """`python -m jobs.generate strategy=tp tp_degree=2` starts its two ranks itself, one GPU each: on a machine
    with one GPU it says so (and what to change) before anything is written or spawned."""
    from jobs.generate import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ParallelConfigError, match=r"^2 ranks per node need one GPU each, but this machine has 1; "
                                                  r"launch at most 1 ranks per node, or lower the degrees \(one "
                                                  r"replica takes 2; a model larger than one GPU: strategy=device_map"):
        run(compose_cfg("strategy=tp", "tp_degree=2", f"run_dir={tmp_path / 'run'}", "progress=false"))
    assert not (tmp_path / "run").exists()


def test_a_plain_command_in_each_task_of_an_srun_step_is_refused_before_it_starts_ranks(tmp_path, monkeypatch):
    """`srun -n 2 python -m jobs.generate strategy=tp tp_degree=2`: srun sets SLURM_STEP_NUM_TASKS (verified on
    scripts/slurm_cluster.sh's cluster; a batch script has none) but not RANK/WORLD_SIZE, so each task would start two
    ranks of its own on the same GPUs: refused in one line naming what to use, nothing written."""
    from shardgen.errors import ConfigError

    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    with pytest.raises(ConfigError, match=r"^one replica of strategy=tp takes 2 ranks, and this process is one of 2 "
                                          r"tasks of an srun step .* Submit with launcher=slurm"):
        run(compose_cfg("strategy=tp", "tp_degree=2", f"run_dir={tmp_path / 'run'}", "progress=false"))
    assert not (tmp_path / "run").exists()


def test_ranks_spawned_by_a_plain_command_are_all_local_and_another_launchers_are_counted_as_before(monkeypatch):
    """The devices checked for launcher=none: a plain command's spawned ranks all share this machine; a world some
    other launcher set up (WORLD_SIZE without LOCAL_WORLD_SIZE, perhaps over several nodes) counts one rank here."""
    from parallel.strategies import device_facts

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert device_facts(compose_cfg("strategy=tp", "tp_degree=2"), 2).local_ranks == 2
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert device_facts(compose_cfg("strategy=tp", "tp_degree=2"), 16).local_ranks == 1


def test_a_dry_run_of_a_plain_command_counts_the_ranks_it_would_start(tmp_path):
    from shardgen.run.dryrun import describe, dry_run

    report = dry_run(compose_cfg("strategy=tp", "tp_degree=2", f"run_dir={tmp_path / 'run'}", "dry_run=true"))
    assert (report.world_size, report.replicas, report.ranks_per_replica) == (2, 1, 2)
    assert "ranks     2: 1 replica(s) of 2 rank(s), strategy tp" in describe(report)


@pytest.mark.parametrize("overrides,world,expect", [
    (("strategy=tp", "tp_degree=2"), 4, dict(dp=2, tp=2, strategy="tp")),
    (("strategy=cp_ulysses", "ulysses_degree=2"), 2, dict(dp=1, ulysses=2, attention_backend="native")),
    (("strategy=cp_ulysses", "ulysses_degree=2", "strategy.ulysses_anything=true"), 2, dict(ulysses_anything=True)),
    (("strategy=cp_unified", "ring_degree=2", "ulysses_degree=2", "dtype=bfloat16"), 8,
     dict(dp=2, ring=2, ulysses=2, attention_backend="_native_cudnn")),
    (("strategy=device_map", "strategy.gpus_per_replica=2"), 2, dict(dp=2, gpus_per_replica=2, strategy="device_map")),
])
def test_valid_layouts(monkeypatch, no_weights, overrides, world, expect):
    facts = GPUS(8, world) if "dtype=bfloat16" in overrides or "strategy=device_map" in overrides else CPU
    if "strategy=device_map" in overrides:
        facts = GPUS(4, world)
    dims = dims_for(monkeypatch, overrides, world, facts)
    for key, value in expect.items():
        assert getattr(dims, key) == value, key


def test_slurm_submission_is_checked_against_the_nodes_it_asks_for(monkeypatch, no_weights):
    from parallel.strategies import device_facts

    cfg = compose_cfg("launcher=slurm", "launcher.gpus_per_node=8", "launcher.tasks_per_node=4", "strategy=device_map")
    assert device_facts(cfg, 4) == DeviceFacts("cuda", 8, 4, device_facts(cfg, 4).where)
    with pytest.raises(ParallelConfigError, match="needs 8 GPUs, but each SLURM node"):
        parallel_dims(compose_cfg("launcher=slurm", "launcher.gpus_per_node=4", "strategy=device_map"), 4)



def test_a_launcher_row_alone_decides_how_parallel_sees_its_nodes(monkeypatch, no_weights):
    """parallel/ asks the launcher table (shardgen/config/launchers.py), never a launcher's name: a new row with
    described nodes is checked against them, and strategy=auto waits for those nodes, with parallel/ unchanged."""
    from parallel.strategies import device_facts
    from parallel.transformer import sequence_shape
    from shardgen.config import launchers

    row = launchers.Launcher("cluster", world_size=lambda cfg: 16, described_nodes=lambda cfg: (2, 2, "each node"))
    monkeypatch.setitem(launchers.LAUNCHERS, "cluster", row)
    cfg = compose_cfg("strategy=device_map", "strategy.gpus_per_replica=2")
    cfg.launcher.name = "cluster"
    assert device_facts(cfg, 16) == DeviceFacts("cuda", 2, 2, "each node")
    with pytest.raises(ParallelConfigError, match="needs 4 GPUs, but each node has 2"):
        parallel_dims(cfg, 16)
    auto = compose_cfg("strategy=auto")
    auto.launcher.name = "cluster"
    assert decide(auto, 16, device_facts(auto, 16), sequence_shape(auto)).strategy == "dp"  # chosen on the nodes when the job starts
    from shardgen.run.dryrun import world_size_of

    assert world_size_of(auto) == 16

# --- auto ------------------------------------------------------------------------------------------------

GiB = 1 << 30
FLUX_DEV = AutoInputs(  # FLUX.1-dev in bf16 at 1024x1024, batch 4 (12B transformer, 4.9B text encoders + VAE)
    device_type="cuda", device_count=8, world_size=8, free_bytes=int(139 * GiB), transformer_bytes=int(22.2 * GiB),
    other_bytes=int(9.3 * GiB), image_tokens=4096, text_tokens=512, heads=24, hidden=3072, height=1024, width=1024,
    batch_size=4, dtype_bytes=2, half_dtype=True, has_tp_plan=True, has_cp_plan=True)

# a synthetic wide DiT at 2048x2048 (16384 image tokens): the only kind of image model whose transformer
# activations outgrow its VAE decode's, i.e. where splitting the sequence is what makes a batch fit
LONG = replace(FLUX_DEV, transformer_bytes=20 * GiB, other_bytes=4 * GiB, hidden=32768, heads=128, height=2048,
               width=2048, image_tokens=16384, batch_size=1, free_bytes=36 * GiB)


# Wan 2.1 T2V 14B in bf16 at its model card's 720x1280 x 81 frames (21 latent frames x 45 x 80 = 75,600 video
# tokens; the text enters by cross-attention, so none join the sequence), batch 4: 14.29B transformer parameters,
# 5.68B UMT5-XXL + 0.13B VAE (shardgen.models.loader.component_params of conf/model/wan21_t2v_14b.yaml, weights=dummy)
WAN14B = AutoInputs(
    device_type="cuda", device_count=8, world_size=8, free_bytes=int(139 * GiB), transformer_bytes=int(26.6 * GiB),
    other_bytes=int(10.8 * GiB), image_tokens=75600, text_tokens=0, heads=40, hidden=5120, height=720, width=1280,
    batch_size=4, dtype_bytes=2, half_dtype=True, has_tp_plan=False, has_cp_plan=True)


def test_the_video_token_count_auto_sizes_from_is_frames_times_patches():
    from parallel.transformer import sequence_shape

    sequence = sequence_shape(compose_cfg("model=wan21_t2v_14b"))
    assert (sequence.image, sequence.text) == (WAN14B.image_tokens, WAN14B.text_tokens)


def test_an_edit_models_input_image_adds_its_tokens_to_the_sequence_auto_sizes_from():
    from parallel.transformer import sequence_shape

    def input_image_tokens(*overrides):
        return sequence_shape(compose_cfg(*overrides)).input_image

    edit = ("prompts.row_settings=[image]", "height=512", "width=1024")
    assert input_image_tokens("model=flux_kontext_dev", *edit) == 32 * 64  # the sample's size
    assert input_image_tokens("model=qwen_image_edit", *edit) == 46 * 90  # ~1 MP: 1440 x 736
    assert input_image_tokens("model=flux_kontext_dev", "height=512", "width=1024") == 0  # no image rows
    assert input_image_tokens("model=flux_dev_img2img", *edit) == 0  # the image starts the latents


@pytest.mark.parametrize("inputs,strategy,degrees", [
    (WAN14B, "dp", {}),                                                      # an H200 holds a batch of 4 videos
    (replace(WAN14B, free_bytes=79 * GiB), "cp_ulysses", dict(ulysses=2)),   # 80 GB cards: the sequence is split
    (replace(WAN14B, free_bytes=79 * GiB, batch_size=1), "dp", {}),          # one video at a time fits again
    (replace(FLUX_DEV, device_type="cpu", free_bytes=None), "dp", {}),
    (FLUX_DEV, "dp", {}),                                                                   # an H200: fits
    (replace(FLUX_DEV, free_bytes=32 * GiB, world_size=1, device_count=1), "device_map", dict(gpus_per_replica=1)),
    (replace(FLUX_DEV, free_bytes=24 * GiB, world_size=8), "tp", dict(tp=4)),               # 24 GB cards, 8 ranks
    (replace(FLUX_DEV, free_bytes=24 * GiB, world_size=1, device_count=4), "device_map", dict(gpus_per_replica=2)),
    # a model device_map cannot stage (Qwen-Image-Edit encodes its prompts with the input image): tp, not device_map
    (replace(FLUX_DEV, free_bytes=32 * GiB, can_stage=False), "tp", dict(tp=2)),
    (LONG, "cp_ulysses", dict(ulysses=2)),
    (replace(LONG, heads=9), "cp_ring", dict(ring=2)),
])
def test_auto_choice(inputs, strategy, degrees):
    request, reasons = choose(inputs)
    assert request.strategy == strategy, reasons
    for key, value in degrees.items():
        assert getattr(request, key) == value, reasons
    assert reasons and all(isinstance(r, str) and "\n" not in r for r in reasons)


def test_auto_says_what_would_make_it_fit():
    with pytest.raises(ParallelConfigError, match="found no way to fit the model"):
        choose(replace(FLUX_DEV, free_bytes=16 * GiB, world_size=1, device_count=1))
    with pytest.raises(ParallelConfigError, match="found no way to fit the model"):  # device_map would have
        choose(replace(FLUX_DEV, free_bytes=32 * GiB, world_size=1, device_count=1, can_stage=False))
    with pytest.raises(ParallelConfigError, match="no CP degree dividing the ranks"):  # no ring without bf16/fp16
        choose(replace(LONG, heads=9, half_dtype=False))


def test_auto_logs_one_line_per_reason_and_applies_its_choice(monkeypatch, caplog, no_weights):
    monkeypatch.setattr("parallel.auto.gather_inputs", lambda cfg, ws, facts, seq: replace(FLUX_DEV, free_bytes=24 * GiB))
    monkeypatch.setattr(S, "device_facts", lambda cfg, ws: GPUS(8, 8))
    with caplog.at_level(logging.INFO, logger="shardgen.auto"):
        dims = parallel_dims(compose_cfg("strategy=auto"), 8)
    lines = [r.getMessage() for r in caplog.records if r.name == "shardgen.auto"]
    assert (dims.strategy, dims.tp, dims.dp) == ("tp", 4, 2)
    assert len(lines) == len(choose(replace(FLUX_DEV, free_bytes=24 * GiB))[1]) + 1
    assert lines[-1] == "auto: applying strategy=tp tp_degree=4"


def test_auto_on_this_cpu_machine_picks_dp(no_weights):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    from parallel.transformer import sequence_shape

    cfg = compose_cfg("strategy=auto")
    assert decide(cfg, 1, S.device_facts(cfg, 1), sequence_shape(cfg)).strategy == "dp"


# --- diffusers compatibility patches (CPU) ----------------------------------------------------------------

@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_transformer():
    from diffusers import FluxTransformer2DModel

    from shardgen.families.flux.tiny import TRANSFORMER_CONFIG

    return FluxTransformer2DModel(**TRANSFORMER_CONFIG).eval()


@pytest.mark.skipif(torch.accelerator.device_count() > 0, reason="patch 1 concerns machines without an accelerator")
def test_compat_device_count_patch_still_needed(one_rank_gloo):
    """Fails the day diffusers stops computing rank % device_count() on CPU: then drop patch 1."""
    from diffusers import TensorParallelConfig

    with pytest.raises(ZeroDivisionError):
        tiny_transformer()._resolve_parallel_config(TensorParallelConfig(tp_degree=1))


def test_compat_tp_device_patch_still_needed(one_rank_gloo):
    """Fails the day diffusers lists "cpu" among its TP devices: then drop patch 2."""
    from diffusers import TensorParallelConfig
    from diffusers.hooks import tensor_parallel

    assert "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES, "diffusers supports TP on CPU now: drop patch 2"
    old = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1  # patch 1 only
    try:
        with pytest.raises(ValueError, match="not supported on device type 'cpu'"):
            tiny_transformer().enable_parallelism(config=TensorParallelConfig(tp_degree=1))
    finally:
        torch.accelerator.device_count = old


def test_compat_patches_applied_only_when_needed_and_undone(one_rank_gloo):
    from diffusers import TensorParallelConfig
    from diffusers.hooks import tensor_parallel

    from parallel.compat import parallel_patches

    before = (torch.accelerator.device_count, tensor_parallel._SUPPORTED_TP_DEVICES)
    with parallel_patches(torch.device("cuda", 0), tensor_parallel=True) as applied:
        assert applied == []
    with parallel_patches(torch.device("cpu"), tensor_parallel=True) as applied:
        model = tiny_transformer()
        model.enable_parallelism(config=TensorParallelConfig(tp_degree=1))
    assert len(applied) == (2 if before[0]() == 0 else 1)
    assert (torch.accelerator.device_count, tensor_parallel._SUPPORTED_TP_DEVICES) == before


def test_compat_refuses_an_unchecked_diffusers(monkeypatch):
    import diffusers

    from parallel.compat import CompatError, parallel_patches

    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    with pytest.raises(CompatError, match="written for diffusers 0.42.x, not 0.43.0"):
        with parallel_patches(torch.device("cpu"), tensor_parallel=True):
            pass


def test_lse_backends_are_context_parallel_backends():
    """The LSE list names real CP-capable backends of this diffusers (a rename would break ring validation)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from parallel.attention import LSE_BACKENDS

    assert LSE_BACKENDS <= set(_AttentionBackendRegistry._supports_context_parallel)
    assert "native" not in LSE_BACKENDS


# --- device_map's staged wrapper ----------------------------------------------------------------------------

def test_staged_pipeline_gives_the_pipelines_pixels():
    """Encoding outside the pipeline (with encoders moved in and out) changes no pixel, true CFG included,
    and the wrapper's signature offers what the generation loop passes."""
    from shardgen.models.loader import load_pipeline
    from parallel.device_map import StagedPipeline

    m = SimpleNamespace(pipeline="FluxPipeline", weights="pretrained", source="tiny", revision=None, cache_dir=None)
    pipe = load_pipeline(m, torch.float64, "cpu")
    staged = StagedPipeline(pipe, torch.device("cpu"), offloaded=["text_encoder", "text_encoder_2"])
    params = inspect.signature(staged.__call__).parameters
    assert {"prompt", "guidance_scale", "max_sequence_length", "true_cfg_scale", "negative_prompt"} <= set(params)
    for cfg_scale in (1.0, 2.0):
        s = GenSettings(height=32, width=32, steps=2, guidance=3.5, true_cfg_scale=cfg_scale, negative_prompt="blurry",
                        max_sequence_length=32, model="tiny", strategy="device_map")
        ours = staged(**pipeline_kwargs(staged, s, ["a cat", "a dog"], [1, 2])).images
        theirs = pipe(**pipeline_kwargs(pipe, s, ["a cat", "a dog"], [1, 2])).images
        assert ours.shape == (2, 3, 32, 32) and torch.equal(ours, theirs)
    assert staged.streamed == []  # on the CPU the encoders are where they compute: nothing to stream


def test_streamed_encoders_give_the_same_pixels(monkeypatch):
    """Encoders streamed layer by layer (diffusers' group offloading hooks, here with no room to encode at all) make
    the pipeline's own pixels, true CFG included; the hooks stay for the next batch."""
    import parallel.device_map as device_map
    from shardgen.models.loader import load_pipeline

    m = SimpleNamespace(pipeline="FluxPipeline", weights="pretrained", source="tiny", revision=None, cache_dir=None)
    s = GenSettings(height=32, width=32, steps=2, guidance=3.5, true_cfg_scale=2.0, negative_prompt="blurry",
                    max_sequence_length=32, model="tiny", strategy="device_map")
    pipe = load_pipeline(m, torch.float64, "cpu")
    theirs = pipe(**pipeline_kwargs(pipe, s, ["a cat", "a dog"], [1, 2])).images
    monkeypatch.setattr(device_map, "room_to_encode", lambda device, reserve: 0)
    staged = device_map.StagedPipeline(pipe, torch.device("cpu"), offloaded=["text_encoder", "text_encoder_2"])
    for _ in range(2):
        ours = staged(**pipeline_kwargs(staged, s, ["a cat", "a dog"], [1, 2])).images
        assert torch.equal(ours, theirs)
    assert sorted(staged.streamed) == ["text_encoder", "text_encoder_2"]


def test_staged_pipeline_passes_the_rows_input_images_and_strength():
    """An image-to-image row under device_map is made from its input image (the wrapper passes image and
    strength): the pipeline's own pixels, and not those of another image."""
    from PIL import Image

    from shardgen.models.loader import load_pipeline
    from parallel.device_map import StagedPipeline

    m = SimpleNamespace(pipeline="FluxImg2ImgPipeline", weights="pretrained", source="tiny", revision=None,
                        cache_dir=None)
    pipe = load_pipeline(m, torch.float64, "cpu")
    staged = StagedPipeline(pipe, torch.device("cpu"), offloaded=["text_encoder", "text_encoder_2"])
    s = GenSettings(height=32, width=32, steps=4, guidance=3.5, true_cfg_scale=1.0, negative_prompt=None,
                    max_sequence_length=32, model="tiny_img2img", strategy="device_map", strength=0.6,
                    input_image="required")
    images = [Image.new("RGB", (32, 32), c) for c in ("red", "blue")]
    ours = staged(**pipeline_kwargs(staged, s, ["a cat", "a dog"], [1, 2], images=images)).images
    theirs = pipe(**pipeline_kwargs(pipe, s, ["a cat", "a dog"], [1, 2], images=images)).images
    other = pipe(**pipeline_kwargs(pipe, s, ["a cat", "a dog"], [1, 2], images=images[::-1])).images
    assert torch.equal(ours, theirs) and not torch.equal(ours, other)


def test_device_map_helpers():
    from parallel.device_map import memory_caps, plan_encoders, replica_gpus
    from shardgen.config.sizes import parse_bytes

    assert replica_gpus(1, 2) == [2, 3]
    assert parse_bytes("70GiB") == 70 * GiB and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(1024) == 1024
    assert memory_caps({"0": "10GiB", "1": "20GiB"}, [2, 3]) == {2: 10 * GiB, 3: 20 * GiB}
    assert memory_caps("10GiB", [2, 3]) == {2: 10 * GiB, 3: 10 * GiB}
    # FLUX.1-dev on 2 x 24 GB cards: the transformer split ~11 GiB each; CLIP fits, T5-XXL (9.5 GiB) does not
    sizes = {"text_encoder": GiB // 4, "text_encoder_2": int(9.5 * GiB)}
    assert plan_encoders(sizes, {0: 11 * GiB, 1: 11 * GiB}, {0: 22 * GiB, 1: 22 * GiB}) == \
        {"text_encoder_2": None, "text_encoder": 0}
    assert plan_encoders(sizes, {0: 11 * GiB, 1: 11 * GiB}, {0: 40 * GiB, 1: 40 * GiB}) == \
        {"text_encoder_2": 0, "text_encoder": 1}
    assert memory_caps({}, []) == {}


# FLUX.2-dev's dummy architecture in bf16 (component_params): a 32.2B transformer (60.0 GiB; 30.8 GiB with its
# block layers in float8) beside a 24B text encoder and the VAE (44.9 GiB); a batch of 16 (~24 GiB of activations)
FLUX2 = replace(FLUX_DEV, transformer_bytes=int(60.0 * GiB), other_bytes=int(44.9 * GiB), heads=48, hidden=6144,
                world_size=1, device_count=1, batch_size=16)


@pytest.mark.parametrize("inputs,strategy", [
    (replace(FLUX2, batch_size=4), "dp"),                                        # bf16, batch 4: an H200 holds it all
    (FLUX2, "device_map"),                                                       # bf16, batch 16: encoders offloaded
    (replace(FLUX2, fp8_transformer_bytes=int(30.8 * GiB)), "dp"),               # fp8: all of it stays on the GPU
    (replace(FLUX2, fp8_transformer_bytes=int(30.8 * GiB), free_bytes=79 * GiB), "device_map"),  # an 80 GB card
])
def test_auto_plans_with_the_float8_transformers_size(inputs, strategy):
    request, reasons = choose(inputs)
    assert request.strategy == strategy, reasons
    assert any("fp8=true: the transformer holds 30.8 GiB" in r for r in reasons) == bool(inputs.fp8_transformer_bytes)


def test_auto_with_fp8_still_needs_the_transformer_to_load_in_its_dtype():
    """fp8 converts the transformer in place after it loads: a card that cannot hold it in bf16 is not planned for
    as if it were already float8."""
    with pytest.raises(ParallelConfigError, match="found no way to fit the model"):
        choose(replace(FLUX2, fp8_transformer_bytes=int(30.8 * GiB), free_bytes=48 * GiB))


def test_auto_sizes_fp8_from_the_architecture(no_weights):
    from parallel.auto import _fp8_bytes
    from parallel.transformer import transformer_info
    from shardgen.models.loader import component_params

    model = compose_cfg("model=flux2_dev", "model.weights=dummy", "fp8=true").model
    params = component_params(model)["transformer"]
    assert abs(_fp8_bytes(transformer_info(model), params, 2) / GiB - 30.8) < 0.1
