"""CFG parallel: the conditional and the unconditional branch of true classifier-free guidance on two ranks.

A true-CFG pipeline (FluxPipeline / QwenImagePipeline with ``true_cfg_scale > 1``) calls its transformer
twice per step on the same latents, inside ``transformer.cache_context("cond")`` and then
``cache_context("uncond")``, and combines the two noise predictions only after the second call. With
``cfg_degree=2`` both ranks of a cfg pair run the same pipeline call; a diffusers ``ModelHook`` on the
transformer makes cfg rank 0 compute only the conditional branch and cfg rank 1 only the unconditional
one. The rank that skips a branch hands the pipeline a placeholder of the output's shape; at the second
call one ``all_gather`` over the pair (two tensors of the latents' size per step, never activations)
fills it in place, so both ranks combine the same two predictions and continue with the same latents.
The pipeline's ``__call__`` stays diffusers' own.

Costs: each rank still encodes both prompts and decodes the images (cheap next to the denoising), and
one latents-sized all-gather per step. Saves: half the transformer work per rank per step, so about half
the latency of an image when the transformer dominates (it does: ~95% of a step for FLUX and Qwen-Image).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from shardgen.errors import UserError

log = logging.getLogger("shardgen.cfg")
HOOK_NAME = "shardgen_cfg_parallel"


class CfgParallelError(UserError, RuntimeError):
    """The pipeline did not call its transformer as a true-CFG pair (cond, then uncond) in every step."""


class _Branch:
    """Per-context state diffusers asks a stateful hook for; only the context's name is used."""

    def reset(self, *args, **kwargs) -> None:
        pass


def _sample(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def _wrap(sample: torch.Tensor, return_dict: bool) -> Any:
    if return_dict:
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=sample)
    return (sample,)


def output_shape(transformer: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[int, ...]:
    """The noise prediction's shape for ``hidden_states`` (packed latents, FLUX and Qwen-Image layout):
    one token per latent patch, ``patch_size**2 * out_channels`` channels each (from the config alone)."""
    c = transformer.config
    channels = (c.get("patch_size", 1) or 1) ** 2 * (c.get("out_channels") or c["in_channels"])
    return (*hidden_states.shape[:-1], channels)


def _make_hook(group: Any, cfg_rank: int):
    from diffusers.hooks.hooks import ModelHook, StateManager

    class CfgParallelHook(ModelHook):
        """cfg rank 0 computes the ``cond`` calls, rank 1 the ``uncond`` calls; the pair swaps results."""

        _is_stateful = True  # so diffusers hands it the pipeline's cache_context (the branch's name)

        def __init__(self):
            super().__init__()
            self.branch = StateManager(_Branch)
            self.pending: torch.Tensor | None = None  # this step's conditional prediction (or its placeholder)

        def new_forward(self, module: torch.nn.Module, *args, **kwargs):
            ctx = self.branch._context
            name = ctx.name if ctx is not None else None
            return_dict = kwargs.get("return_dict", True)
            if name == "cond":
                return _wrap(self._cond(module, args, kwargs), return_dict)
            if name == "uncond":
                return _wrap(self._uncond(module, args, kwargs), return_dict)
            raise CfgParallelError(
                f"cfg_degree=2: {type(module).__name__} was called outside a cond/uncond cache_context ({name!r}), so "
                "the two CFG branches cannot be told apart; this pipeline does not support CFG parallel. Set "
                "cfg_degree=1")

        def _cond(self, module, args, kwargs) -> torch.Tensor:
            if self.pending is not None:
                raise CfgParallelError("cfg_degree=2: two conditional transformer calls without an unconditional one "
                                       "between them (no true CFG in this call?); set cfg_degree=1")
            if cfg_rank == 0:
                self.pending = _sample(self.fn_ref.original_forward(*args, **kwargs))
            else:
                hidden = kwargs["hidden_states"]
                self.pending = torch.empty(output_shape(module, hidden), dtype=hidden.dtype, device=hidden.device)
            return self.pending

        def _uncond(self, module, args, kwargs) -> torch.Tensor:
            cond, self.pending = self.pending, None
            if cond is None:
                raise CfgParallelError("cfg_degree=2: an unconditional transformer call without a conditional one "
                                       "before it; set cfg_degree=1")
            mine = cond if cfg_rank == 0 else _sample(self.fn_ref.original_forward(*args, **kwargs))
            if mine.shape != cond.shape:
                raise CfgParallelError(f"cfg_degree=2: the branches' predictions differ in shape ({tuple(cond.shape)} "
                                       f"vs {tuple(mine.shape)}); set cfg_degree=1")
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine.contiguous(), group=group)
            if cfg_rank == 0:
                return both[1]
            cond.copy_(both[0])  # fills the placeholder the pipeline already holds (and any view of it)
            return mine

        def reset_state(self, module):
            self.pending = None
            self.branch.reset()
            return module

    return CfgParallelHook()


def enable(transformer: torch.nn.Module, group: Any, cfg_rank: int) -> None:
    """Make ``transformer`` compute one CFG branch on this rank (``cfg_rank`` 0: cond, 1: uncond) and exchange
    the predictions with its pair over ``group`` (the cfg sub-mesh's process group)."""
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.register_hook(_make_hook(group, cfg_rank), HOOK_NAME)
    log.info("cfg parallel: this rank computes the %s branch", "conditional" if cfg_rank == 0 else "unconditional")
