"""Speed options for a built pipeline, applied once before its first call (``prepare``): the public names of the
speed techniques in one place. Each technique is a module of its own, with its config, its checks and its
``apply``, registered in techniques.py (``prepare`` runs them in order):

Exact (outputs change only by bf16 rounding noise):

- regional_compile.py: ``compile`` (the repeated blocks compiled one graph per block class), ``fused_blocks``
  (the family's fused forwards: shardgen/families/<family>/fused.py, built from fused_kernels.py), ``compile_tuning``, the shared
  inductor cache;
  autocompile.py: ``compile: auto`` decided per process.
- sdpa.py: ``sdpa_backend``, the kernel behind torch SDPA (``auto``: measured once per process); fa4.py: the
  adapter that makes FlashAttention-4 SDPA's flash kernel (``sdpa_backend=fa4``).
- fused_decode.py: ``fused_decode``, the VAE decoder channels-last with its GroupNorm + SiLU pairs fused.
- family_hooks.py: the family's own hooks, handed down (handdown.py), e.g. Qwen-Image
  (shardgen/families/qwen_image/speed.py: text-length buckets, real RoPE, unmasked
  prefix attention in prefix_attention.py, ``cfg_batching``).

Opt-in, lossy (off by default, recorded in each sample's json under ``lossy``):

- first_block_cache.py: ``first_block_cache``, diffusers' First-Block-Cache.
- fp8.py: ``fp8``, float8 matmuls in the repeated blocks.
"""

from __future__ import annotations

from shardgen.speed.blocks import repeated_blocks
from shardgen.speed.family_hooks import family_speed_hooks
from shardgen.speed.first_block_cache import disable_cache, enable_first_block_cache
from shardgen.speed.fp8 import FP8_MAX, Float8Linear, disable_fp8, enable_fp8, fp8_enabled, make_reversible
from shardgen.speed.techniques import AccelError, AccelOptions, resolve_compile
from shardgen.speed.regional_compile import (COMPILE_MODES, compile_blocks, compile_cache_dir, fuse_blocks_eager,
                                             uncompile_blocks)
from shardgen.speed.sdpa import (SDPA_CHOICES, attention_shape, choose_sdpa, chosen_sdpa, measure_sdpa,
                                 sdpa_context)
from shardgen.speed.techniques import current, prepare, validate

__all__ = ["AccelError", "AccelOptions", "COMPILE_MODES", "FP8_MAX", "Float8Linear", "SDPA_CHOICES",
           "attention_shape", "choose_sdpa", "chosen_sdpa", "compile_blocks", "compile_cache_dir", "current",
           "disable_cache", "disable_fp8", "enable_first_block_cache", "enable_fp8", "family_speed_hooks",
           "fp8_enabled", "fuse_blocks_eager", "make_reversible", "measure_sdpa", "prepare", "repeated_blocks",
           "resolve_compile", "sdpa_context", "uncompile_blocks", "validate"]
