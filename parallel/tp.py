"""Tensor parallel: the transformer's weights split over the ``tp`` ranks of a replica.

Each rank reads only its slice of every planned weight: the transformer is loaded with
``from_pretrained(..., subfolder="transformer", parallel_config=TensorParallelConfig(mesh=<tp mesh>))``,
which streams each shard off the safetensors files into a DTensor. The other components (text
encoders, VAE) are loaded whole and moved one by one to the rank's device; the pipeline itself is
never moved (``pipeline.to`` on a sharded transformer is refused by diffusers, and would be wrong).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from shardgen.models.loader import ModelLoadError, check_safetensors_only, load_pipeline, resolve_source, torch_dtype
from parallel.compat import parallel_patches

log = logging.getLogger("shardgen.tp")


def tp_config(mesh):
    """The diffusers config for the replica's ``tp`` sub-mesh (its size is the degree)."""
    from diffusers import TensorParallelConfig

    return TensorParallelConfig(mesh=mesh["tp"])


def load_transformer(model_cfg: Any, dtype: torch.dtype, mesh, device: torch.device):
    """This rank's shard of the pretrained transformer, read straight off the safetensors files."""
    import diffusers

    from parallel.strategies import transformer_info

    cls = getattr(diffusers, transformer_info(model_cfg).cls_name)
    source = resolve_source(model_cfg)
    check_safetensors_only(source)
    try:
        with parallel_patches(device, tensor_parallel=True):
            return cls.from_pretrained(source, subfolder="transformer", torch_dtype=dtype, revision=model_cfg.revision,
                                       use_safetensors=True, parallel_config=tp_config(mesh))
    except (OSError, EnvironmentError) as e:
        hint = "" if os.path.isdir(source) else (
            " No model hub may be reachable: point model.source at a local directory.")
        raise ModelLoadError(f"cannot load the transformer of model.source={source!r} for tensor parallelism: "
                             f"{e}.{hint}") from e


def place_components(pipe: Any, device: torch.device, skip: tuple[str, ...] = ("transformer",)) -> None:
    """Move every module of ``pipe`` except ``skip`` to ``device``, one by one."""
    for name, component in pipe.components.items():
        if name not in skip and isinstance(component, torch.nn.Module):
            component.to(device)


def apply(cfg: Any, world, dims, mesh) -> Any:
    """This rank's pipeline: its transformer shard plus whole copies of the other components on its device."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.model.weights == "dummy":
        # random weights built on the device; diffusers shards them in memory (rank 0's values are broadcast)
        pipe = load_pipeline(cfg.model, dtype, world.device)
        with parallel_patches(world.device, tensor_parallel=True):
            pipe.transformer.enable_parallelism(config=tp_config(mesh))
    else:
        transformer = load_transformer(cfg.model, dtype, mesh, world.device)
        pipe = load_pipeline(cfg.model, dtype, None, transformer=transformer)
        place_components(pipe, world.device)
    if dims.attention_backend:
        pipe.transformer.set_attention_backend(dims.attention_backend)
    log.info("tensor parallel: transformer sharded %d ways over ranks %s", dims.tp, mesh["tp"].mesh.tolist())
    return pipe
