"""``fp8`` (opt-in, lossy): the linear layers of the repeated blocks compute in float8 (e4m3) with
``torch._scaled_mm``: weights quantised once per output channel, activations per token at run time (row-wise
scales), bf16 output. Needs compute capability 8.9+ (Ada, Hopper, Blackwell) for a real speed-up, and
``compile=true`` (eager, the quantisation kernels cost more than the faster matmul saves). The adaLN modulation
layers and everything outside the blocks stay in bf16. The bf16 weights are kept, so it can be switched off again
(memory: +1 byte per block weight). diffusers' ``enable_layerwise_casting(storage_dtype=float8)`` is not offered:
it only stores weights in float8 and computes in bf16 (saves memory, costs time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardgen.pick import pick
from shardgen.speed.blocks import repeated_blocks
from shardgen.speed.techniques import AccelError, AccelOptions
from shardgen.speed.techniques import Step, Technique, register_technique

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class Fp8Config:
    """The option this technique reads."""

    fp8: bool = False
    """float8 matmuls in the transformer blocks."""


class Float8Linear(torch.nn.Module):
    """``nn.Linear`` computing ``x @ W.T + b`` in float8 e4m3: W quantised per output channel once,
    x per row (token) on every call, products accumulated in fp32 by ``torch._scaled_mm``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # (out, 1)
        self.register_buffer("weight_fp8", (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, out), float32
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        object.__setattr__(self, "_original", linear)  # kept (not a submodule) to switch fp8 off again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        scale_a = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (tokens, 1)
        xq = (x2.float() / scale_a).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        out = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=scale_a, scale_b=self.weight_scale,
                               out_dtype=out_dtype)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn row-wise"


def _fp8_candidates(transformer: torch.nn.Module):
    """(parent, attribute, linear) for each block linear worth quantising."""
    for block in repeated_blocks(transformer):
        for name, mod in block.named_modules():
            if not isinstance(mod, torch.nn.Linear) or "norm" in name:  # adaLN modulation stays bf16
                continue
            if mod.in_features % 16 or mod.out_features % 16:  # _scaled_mm's shape rule
                continue
            parent_name, _, attr = name.rpartition(".")
            yield block.get_submodule(parent_name) if parent_name else block, attr, mod


def enable_fp8(transformer: torch.nn.Module) -> int:
    """Replace the block linears by ``Float8Linear``s; how many."""
    n = 0
    for parent, attr, lin in list(_fp8_candidates(transformer)):
        setattr(parent, attr, Float8Linear(lin))
        n += 1
    return n


def disable_fp8(transformer: torch.nn.Module) -> int:
    """Put the original linears back; how many."""
    n = 0
    for block in repeated_blocks(transformer):
        for name, mod in list(block.named_modules()):
            if isinstance(mod, Float8Linear):
                parent_name, _, attr = name.rpartition(".")
                setattr(block.get_submodule(parent_name) if parent_name else block, attr, mod._original)
                n += 1
    return n


def fp8_enabled(transformer: torch.nn.Module) -> bool:
    """Whether any layer of ``transformer`` computes in float8 now."""
    return any(isinstance(m, Float8Linear) for m in transformer.modules())


def validate(opts: AccelOptions, device=None) -> None:
    """AccelError when fp8=true cannot run with this torch or on this GPU."""
    if not pick(Fp8Config, opts).fp8:
        return
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        raise AccelError(f"fp8=true needs torch._scaled_mm and float8 dtypes (torch {torch.__version__} has not)")
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 9):
            raise AccelError(f"fp8=true needs a GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell); "
                             f"{torch.cuda.get_device_name(dev)} is {cap[0]}.{cap[1]}. Set fp8=false.")


def apply(step: Step) -> dict:
    """Swap the block linears in or out as ``fp8`` asks (``fp8_layers``: how many; negative when removed)."""
    on = pick(Fp8Config, step.opts).fp8
    if on == fp8_enabled(step.transformer):
        return {}
    return {"fp8_layers": enable_fp8(step.transformer) if on else -disable_fp8(step.transformer)}


register_technique(Technique("fp8", 10, apply, validate=validate, wanted=lambda opts: opts.fp8,
                             lossy=lambda opts: {"fp8": True} if opts.fp8 else {}))
