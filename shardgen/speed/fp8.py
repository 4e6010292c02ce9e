"""``fp8`` (opt-in, lossy): the linear layers of the repeated blocks compute in float8 (e4m3) with
``torch._scaled_mm``: weights quantised once per output channel, activations per token at run time (row-wise
scales), bf16 output. Needs compute capability 8.9+ (Ada, Hopper, Blackwell) for a real speed-up. The adaLN
modulation layers and everything outside the blocks stay in bf16. diffusers' ``enable_layerwise_casting
(storage_dtype=float8)`` is not offered: it only stores weights in float8 and computes in bf16 (saves memory, costs
time).

Memory: each layer is quantised in place, a slice of rows at a time, and its bf16 weight freed before the next
(never a whole bf16 copy beside the fp8 one): a model whose bf16 transformer and text encoders fill the GPU still
fits while it is converted, and ends with half the transformer's block weights. So fp8 cannot be switched off again
in the same process, unless the transformer was made reversible first (``make_reversible``: the bf16 layers are kept
on the CPU; the benchmark does this to time several ways on one pipeline).

Speed: eagerly on CUDA, an activation's row-wise quantisation is one Triton pass (``quantize_rows``: the row's
absolute maximum, then the scaled float8 values, two reads of the row and one write) instead of five torch ops, and
the bias is added in ``_scaled_mm``'s epilogue; under ``torch.compile`` the torch ops stay (inductor fuses them with
their neighbours). Off CUDA, or without Triton, the torch ops run. Three passes are saved where the family's fused
blocks know the layers are float8: an input read by several layers (q, k and v; a single block's MLP and attention)
is quantised once (``_LAST``); the MLP's tanh-GELU is computed in the down-projection's quantisation pass
(``gelu_rows``: its bf16 output is never written), its tanh the GPU's one-instruction approximation
(``APPROX_TANH``); the single blocks' output projection (FLUX.1, FLUX.2) takes the attention output beside the
MLP's activation (GELU, SwiGLU) as one float8 row each, made in one pass over both parts (``joined_rows``: one
GEMM, no concatenation or bf16 activation written; FLUX.1's narrower rows read twice, the second time from L2,
FLUX.2's held in registers and read once), and FLUX.2's feed-forward its SwiGLU the same way; a layer over a
concatenation that pass does not take (rows too wide for its registers, or off CUDA) takes its parts one GEMM each
(``Float8Linear.forward_parts``) instead of copying them together.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardgen.pick import pick
from shardgen.speed.blocks import repeated_blocks
from shardgen.speed.techniques import AccelError, AccelOptions
from shardgen.speed.techniques import Step, Technique, register_technique

log = logging.getLogger("shardgen.accel")

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZE_ROWS_AT_ONCE = 4096
"""Weight rows quantised per slice: bounds the float32 temporary of the largest layer (FLUX.2's 36864x6144
feed-forward: 3.6 GiB at once, 100 MiB a slice)."""
_REVERSIBLE = "_shardgen_fp8_reversible"
USE_FAST_ACCUM = True
"""``_scaled_mm``'s ``use_fast_accum``: Hopper's float8 tensor cores accumulate without the periodic promotion to
float32. Measured on an H200 (benchmarks/probe_fp8_step.py): 7-15% faster GEMMs at FLUX's shapes, one transformer
call's error against bf16 the same to 0.1% (FLUX.1-dev 0.0997 relative RMS either way, FLUX.2-dev 0.427)."""
ROW_MULTIPLE = 16
"""Activation rows of a float8 GEMM are padded to a multiple of this (``_padded_rows``)."""
ONE_PASS_COLS = 16384
"""Rows up to this wide are quantised from registers (one read of the row); wider rows are read twice."""

try:  # Triton ships with CUDA builds of torch; CPU builds have none (the torch path runs there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = tl = None


@dataclass(frozen=True)
class Fp8Config:
    """The option this technique reads."""

    fp8: bool = False
    """float8 matmuls in the transformer blocks."""


APPROX_TANH = os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None
"""The GELU's tanh is the GPU's one-instruction ``tanh.approx.f32`` (relative error ~2**-11, under the bf16 rounding
of the GELU's output that follows): with exp and an IEEE division instead, the GELU pass computed for longer than it
read (H100: 1.7 TB/s against 2.9 for the same pass without the GELU, benchmarks/probe_quantize_rows.py). The
instruction is NVIDIA's PTX: Triton's interpreter (numpy, the CPU tests) and ROCm builds take the tanh from exp."""


if triton is not None:

    @triton.jit
    def _gelu_tanh_bf16(v, APPROX: tl.constexpr):
        # torch's tanh-GELU in float32 (its opmath for bf16), rounded to bf16 where eager writes its output
        inner = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        if APPROX:
            tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [inner], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        return (0.5 * v * (1.0 + tanh)).to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def to_fp8(v, inv_scale, QMAX: tl.constexpr):
        # float8 e4m3 of v / scale, clamped to +-QMAX, as a multiplication by the row's reciprocal scale rather than
        # a division per value (an IEEE division costs ~10 instructions): the float8 value differs from the
        # division's only where the product lands on a rounding tie
        return tl.minimum(tl.maximum(v * inv_scale, -QMAX), QMAX).to(tl.float8e4nv)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, cols, stride_x, rows_per_batch, stride_b,
                              BLOCK: tl.constexpr, QMAX: tl.constexpr, GELU: tl.constexpr, ONE_PASS: tl.constexpr,
                              APPROX: tl.constexpr):
        # row r of the input is row r % rows_per_batch of batch sample r // rows_per_batch (a 3-D strided view,
        # e.g. the image half of an attention output, is read in place)
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + (row // rows_per_batch) * stride_b + (row % rows_per_batch) * stride_x
        q_row = q_ptr + row * cols
        if ONE_PASS:  # the whole row in registers: read once
            offs = tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
            if GELU:
                v = _gelu_tanh_bf16(v, APPROX)
            scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12) / QMAX
            tl.store(scale_ptr + row, scale)
            tl.store(q_row + offs, to_fp8(v, 1.0 / scale, QMAX), mask=offs < cols)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, cols, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
                if GELU:
                    v = _gelu_tanh_bf16(v, APPROX)
                amax = tl.maximum(amax, tl.abs(v))
            scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / QMAX
            tl.store(scale_ptr + row, scale)
            inv_scale = 1.0 / scale
            for start in range(0, cols, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
                if GELU:
                    v = _gelu_tanh_bf16(v, APPROX)
                tl.store(q_row + offs, to_fp8(v, inv_scale, QMAX), mask=offs < cols)

    @triton.jit
    def _part_chunk(ptr, row_off, start, cols, BLOCK: tl.constexpr, ACT: tl.constexpr, APPROX: tl.constexpr):
        # columns start..start+BLOCK of one row of a part, its activation applied, in float32: ACT 0 the values,
        # 1 the tanh-GELU, 2 diffusers' SwiGLU (silu of the row's first ``cols`` columns, rounded to bf16 as eager
        # rounds it, times the next ``cols``; the product rounded to bf16 where eager writes it)
        offs = start + tl.arange(0, BLOCK)
        live = offs < cols
        v = tl.load(ptr + row_off + offs, mask=live, other=0.0).to(tl.float32)
        if ACT == 1:
            v = _gelu_tanh_bf16(v, APPROX)
        if ACT == 2:
            g = tl.load(ptr + row_off + cols + offs, mask=live, other=0.0).to(tl.float32)
            v = ((v / (1.0 + tl.exp(-v))).to(tl.bfloat16).to(tl.float32) * g).to(tl.bfloat16).to(tl.float32)
        return v

    @triton.jit
    def _quantize_parts_kernel(a_ptr, b_ptr, q_ptr, scale_ptr, cols_a, cols_b, stride_a, stride_b,
                               A1: tl.constexpr, A2: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                               ACT: tl.constexpr, QMAX: tl.constexpr, APPROX: tl.constexpr):
        # row r of concat([a, act(b)]) (no a when A1 is 0) on the whole row's absolute maximum. Each part is held in
        # registers as one or two power-of-two chunks (A1 [+ A2] covers cols_a, B1 [+ B2] cols_b): read once
        row = tl.program_id(0).to(tl.int64)
        b1 = _part_chunk(b_ptr, row * stride_b, 0, cols_b, B1, ACT, APPROX)
        amax = tl.max(tl.abs(b1), axis=0)
        if B2 > 0:
            b2 = _part_chunk(b_ptr, row * stride_b, B1, cols_b, B2, ACT, APPROX)
            amax = tl.maximum(amax, tl.max(tl.abs(b2), axis=0))
        if A1 > 0:
            a1 = _part_chunk(a_ptr, row * stride_a, 0, cols_a, A1, 0, APPROX)
            amax = tl.maximum(amax, tl.max(tl.abs(a1), axis=0))
        if A2 > 0:
            a2 = _part_chunk(a_ptr, row * stride_a, A1, cols_a, A2, 0, APPROX)
            amax = tl.maximum(amax, tl.max(tl.abs(a2), axis=0))
        scale = tl.maximum(amax, 1e-12) / QMAX
        tl.store(scale_ptr + row, scale)
        inv_scale = 1.0 / scale
        q_row = q_ptr + row * (cols_a + cols_b)
        if A1 > 0:
            oa = tl.arange(0, A1)
            tl.store(q_row + oa, to_fp8(a1, inv_scale, QMAX), mask=oa < cols_a)
        if A2 > 0:
            oa = A1 + tl.arange(0, A2)
            tl.store(q_row + oa, to_fp8(a2, inv_scale, QMAX), mask=oa < cols_a)
        ob = tl.arange(0, B1)
        tl.store(q_row + cols_a + ob, to_fp8(b1, inv_scale, QMAX), mask=ob < cols_b)
        if B2 > 0:
            ob = B1 + tl.arange(0, B2)
            tl.store(q_row + cols_a + ob, to_fp8(b2, inv_scale, QMAX), mask=ob < cols_b)


    @triton.jit
    def _quantize_parts_chunked_kernel(a_ptr, b_ptr, q_ptr, scale_ptr, stride_a, stride_b, COLS_A: tl.constexpr,
                                       COLS_B: tl.constexpr, CHUNK: tl.constexpr, ACT: tl.constexpr,
                                       QMAX: tl.constexpr, APPROX: tl.constexpr):
        # ``_quantize_parts_kernel``'s row (the same bytes) read twice in chunks of CHUNK columns: the absolute
        # maximum, then the float8 values, the second read mostly from L2. A program holds one chunk, not the row,
        # so several rows' loads are in flight on an SM where the whole-row program fills its registers alone. The
        # widths are compile-time constants (a model has a few): the loops' bounds, which Triton's interpreter
        # (the CPU tests) takes only so
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, COLS_A, CHUNK):
            amax = tl.maximum(amax, tl.abs(_part_chunk(a_ptr, row * stride_a, start, COLS_A, CHUNK, 0, APPROX)))
        for start in range(0, COLS_B, CHUNK):
            amax = tl.maximum(amax, tl.abs(_part_chunk(b_ptr, row * stride_b, start, COLS_B, CHUNK, ACT, APPROX)))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / QMAX
        tl.store(scale_ptr + row, scale)
        inv_scale = 1.0 / scale
        q_row = q_ptr + row * (COLS_A + COLS_B)
        for start in range(0, COLS_A, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            v = _part_chunk(a_ptr, row * stride_a, start, COLS_A, CHUNK, 0, APPROX)
            tl.store(q_row + offs, to_fp8(v, inv_scale, QMAX), mask=offs < COLS_A)
        for start in range(0, COLS_B, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            v = _part_chunk(b_ptr, row * stride_b, start, COLS_B, CHUNK, ACT, APPROX)
            tl.store(q_row + COLS_A + offs, to_fp8(v, inv_scale, QMAX), mask=offs < COLS_B)


@dataclass(frozen=True)
class Fp8Rows:
    """An activation already quantised row by row (``quantize_rows``), which a ``Float8Linear`` takes in place of
    its bf16 input: lets a kernel that makes the input (the MLP's GELU) write float8 directly."""

    data: torch.Tensor
    """(rows, cols) float8_e4m3fn."""
    scale: torch.Tensor
    """(rows, 1) float32."""
    lead: tuple
    """The input's leading shape (batch, tokens): the output is ``(*lead, out_features)``."""
    dtype: torch.dtype
    """The bf16/fp16 dtype the input had: the output's."""

    @property
    def shape(self) -> tuple:
        """The input's shape, (*lead, cols): what a processor reading the input's size sees."""
        return (*self.lead, self.data.shape[-1])


def quantize_rows_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 rows, float32 (rows, 1) scales) of a 2-D tensor: each row scaled so its absolute maximum is
    ``FP8_MAX``. The torch ops; what runs off CUDA and under torch.compile."""
    scale = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x2.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _kernel_ok(x2: torch.Tensor) -> bool:
    return (triton is not None and x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling())


def _row_warps(width: int) -> int:
    """Warps of a program holding a whole row of ``width`` columns in registers: 4 up to 4096, 8 up to 16384, 16
    beyond (an H100's sweep, benchmarks/probe_quantize_rows.py: GELU rows of 16384 took 233 us at 8 warps, 253 at
    16, 244 at 4; FLUX.1's proj_out rows of 4096 + 16384, 300 us at 16 warps, 339 at 8)."""
    return 4 if width <= 4096 else 8 if width <= 16384 else 16


def row_launch(cols: int) -> tuple[bool, int, int]:
    """``_quantize_rows_kernel``'s launch for rows of ``cols``: (the whole row in registers, the block it reads,
    warps). Rows up to ``ONE_PASS_COLS`` wide are read once; wider ones twice, in blocks of 1024 at 4 warps."""
    width = triton.next_power_of_2(cols)
    return (True, width, _row_warps(width)) if width <= ONE_PASS_COLS else (False, 1024, 4)


def quantize_rows(x2: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_reference`` in one Triton pass on CUDA (eager), the torch ops elsewhere. ``gelu``: of
    ``gelu(x2, approximate="tanh")``, computed in the same pass (the GELU's output never written in bf16). ``x2``
    may also be a (batch, tokens, cols) view, its rows taken in order where they are (no contiguous copy first)."""
    if not _kernel_ok(x2):
        x2 = x2.reshape(-1, x2.shape[-1])
        return quantize_rows_reference(F.gelu(x2, approximate="tanh") if gelu else x2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.dim() == 3:
        per_batch, stride_b, stride_r = x2.shape[1], x2.stride(0), x2.stride(1)
    else:
        per_batch, stride_b, stride_r = max(x2.shape[0], 1), 0, x2.stride(0)
    cols = x2.shape[-1]
    rows = x2.numel() // cols if cols else 0
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x2.device)
    if rows:
        one_pass, block, warps = row_launch(cols)
        _quantize_rows_kernel[(rows,)](x2, q, scale, cols, stride_r, per_batch, stride_b, BLOCK=block, QMAX=FP8_MAX,
                                       GELU=gelu and x2.dtype == torch.bfloat16, ONE_PASS=one_pass,
                                       APPROX=APPROX_TANH, num_warps=warps)
    return q, scale


def gelu_rows(x: torch.Tensor) -> Fp8Rows | torch.Tensor:
    """``gelu(x, approximate="tanh")`` for a ``Float8Linear`` to take: eagerly on CUDA in bf16, quantised in the same
    pass (``Fp8Rows``); elsewhere (under a compiler, off CUDA, fp16) the bf16 GELU itself."""
    x2 = x.reshape(-1, x.shape[-1])
    if not _kernel_ok(x2) or x.dtype != torch.bfloat16:
        return F.gelu(x, approximate="tanh")
    data, scale = quantize_rows(x2, gelu=True)
    return Fp8Rows(data, scale, tuple(x.shape[:-1]), x.dtype)


ACTIVATIONS = {"none": 0, "gelu": 1, "swiglu": 2}
"""``joined_rows``' activations of its second part: tanh-GELU (FLUX.1's MLP), diffusers' SwiGLU (FLUX.2's)."""
REGISTER_COLS = 24576
"""The most lanes (columns of its power-of-two register blocks together) a ``joined_rows`` program holds: FLUX.2's
single blocks' output projection reads 6144 + 18432 in blocks of 4096 + 2048 + 16384 + 2048."""


READ_TWICE_ROW_BYTES = 32768
"""``joined_rows`` reads a row twice in chunks (``_quantize_parts_chunked_kernel``: the maximum, then the float8
values, the second read from L2) when the row's bf16 input, both parts, is at most this many bytes; wider rows are
held whole in registers and read once (``_quantize_parts_kernel``, up to ``REGISTER_COLS``; past that the caller
takes the parts). An H100's sweep (``benchmarks/probe_quantize_rows.py --only joined``, batch 4): FLUX.1's single
blocks' 30 KB rows 311.7 us read twice against 343.5 us held whole (the whole row fills an SM's registers, so few
rows' loads are in flight); FLUX.2's 86 KB rows 1170 against 782 us (their second read misses L2). 0: always whole."""
READ_TWICE_CHUNK = 4096
"""Columns a program of ``_quantize_parts_chunked_kernel`` holds at once (the sweep's fastest with ``READ_TWICE_WARPS``
at FLUX.1's widths)."""
READ_TWICE_WARPS = 8
"""Warps of a program of ``_quantize_parts_chunked_kernel``."""


def _pow2(cols: int) -> int:
    return 1 << (cols - 1).bit_length() if cols > 0 else 0


def register_chunks(cols: int) -> tuple[int, int]:
    """A row part of ``cols`` columns as at most two power-of-two register blocks (the second 0 when there is
    none): the largest power of two up to ``cols`` and the rest's (12288 = 8192 + 4096, 18432 = 16384 + 2048), where
    one block would leave up to half its lanes idle (18432 in 32768)."""
    if cols <= 0:
        return 0, 0
    first = 1 << (cols.bit_length() - 1)
    rest = cols - first
    return (first, 0) if not rest else (first, max(16, _pow2(rest)))


def _joined_launch(cols_a: int, cols_b: int) -> tuple[int, int, int, int, int] | None:
    """(A1, A2, B1, B2, warps) of ``_quantize_parts_kernel`` for parts ``cols_a`` and ``cols_b`` wide: one
    power-of-two block a part while they fit ``REGISTER_COLS`` together (FLUX.1's single blocks: 4096 + 16384, the
    launch an H100 timed at 300 us at 16 warps, benchmarks/probe_quantize_rows.py), else each part in
    ``register_chunks``; None when even those pass it."""
    whole = (_pow2(cols_a), 0, _pow2(cols_b), 0)
    chunks = whole if sum(whole) <= REGISTER_COLS else (*register_chunks(cols_a), *register_chunks(cols_b))
    lanes = sum(chunks)
    return None if lanes > REGISTER_COLS else (*chunks, _row_warps(lanes))


def joined_rows(a: torch.Tensor | None, b: torch.Tensor, activation: str) -> Fp8Rows | None:
    """The float8 rows of ``cat([a, act(b)], -1)``, ``act`` the ``activation`` (``ACTIVATIONS``; with ``a`` None,
    of ``act(b)`` alone), in one pass over the parts: what a ``Float8Linear`` over them quantises, the activation's
    bf16 output never written. A row of up to ``READ_TWICE_ROW_BYTES`` is read twice in chunks, a wider one held
    whole in registers and read once. Eagerly on CUDA for bf16 parts of one leading shape, a row held whole only
    where its chunks fit the registers (``REGISTER_COLS``); None elsewhere (the caller runs the activation in bf16
    and the layer takes the parts one GEMM each: ``Float8Linear.forward_parts``). The rows share one scale, so the
    layer runs one GEMM over them and no sum of two products is written and read again (the single blocks' output
    projection of FLUX.1 and FLUX.2; FLUX.2's feed-forward down-projection takes its SwiGLU this way)."""
    act = ACTIVATIONS[activation]
    b2 = b.reshape(-1, b.shape[-1])
    a2 = a.reshape(-1, a.shape[-1]) if a is not None else b2[:, :0]
    cols_b = b2.shape[1] // 2 if act == ACTIVATIONS["swiglu"] else b2.shape[1]
    if not (b.dtype == torch.bfloat16 and _kernel_ok(b2) and b2.stride(-1) == 1 and (a is None or (
            a.dtype == torch.bfloat16 and a.shape[:-1] == b.shape[:-1] and _kernel_ok(a2) and a2.stride(-1) == 1))):
        return None
    rows, cols_a = b2.shape[0], a2.shape[1]
    launch = _joined_launch(cols_a, cols_b)
    twice = (cols_a + b2.shape[1]) * b2.element_size() <= READ_TWICE_ROW_BYTES
    if (launch is None and not twice) or (act == ACTIVATIONS["swiglu"] and b2.shape[1] % 2):
        return None
    q = torch.empty((rows, cols_a + cols_b), dtype=torch.float8_e4m3fn, device=b.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=b.device)
    first = a2 if a is not None else b2
    if rows and not twice:
        *chunks, warps = launch
        _quantize_parts_kernel[(rows,)](first, b2, q, scale, cols_a, cols_b, a2.stride(0), b2.stride(0), *chunks,
                                        ACT=act, QMAX=FP8_MAX, APPROX=APPROX_TANH, num_warps=warps)
    elif rows:
        _quantize_parts_chunked_kernel[(rows,)](first, b2, q, scale, a2.stride(0), b2.stride(0), COLS_A=cols_a,
                                                COLS_B=cols_b, CHUNK=READ_TWICE_CHUNK, ACT=act,
                                                QMAX=FP8_MAX, APPROX=APPROX_TANH, num_warps=READ_TWICE_WARPS)
    return Fp8Rows(q, scale, tuple(b.shape[:-1]), b.dtype)


class _LastQuantized(threading.local):
    """The last activation an eager ``Float8Linear`` quantised, per thread: the layers that read one input (q, k and
    v; a single block's MLP and attention) quantise it once. The input is held by a weak reference whose death drops
    the float8 copy too (nothing outlives the activation), and its version counter tells an in-place change."""

    ref: weakref.ref | None = None
    version: int = -1
    rows: tuple | None = None

    def get(self, x: torch.Tensor):
        if self.ref is not None and self.ref() is x and x._version == self.version:
            return self.rows
        return None

    def put(self, x: torch.Tensor, rows: tuple) -> None:
        self.ref, self.version, self.rows = weakref.ref(x, self._expire), x._version, rows

    def _expire(self, ref: weakref.ref) -> None:
        if self.ref is ref:
            self.clear()

    def clear(self) -> None:
        self.ref, self.rows = None, None


_LAST = _LastQuantized()


def _quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 rows, scales) of ``x``'s rows, the last eager result reused when ``x`` is the same unchanged tensor
    (under a compiler the ops are traced each time: the graph's common-subexpression pass merges them)."""
    if torch.compiler.is_compiling():
        return quantize_rows(x.reshape(-1, x.shape[-1]))
    hit = _LAST.get(x)
    if hit is None:
        hit = quantize_rows(x if x.dim() == 3 else x.reshape(-1, x.shape[-1]))
        _LAST.put(x, hit)
    return hit


def _as_rows(x: torch.Tensor | Fp8Rows) -> Fp8Rows:
    """A layer's input as ``Fp8Rows``: as it is when already quantised, else ``_quantized_input``'s rows."""
    if isinstance(x, Fp8Rows):
        return x
    data, scale = _quantized_input(x)
    return Fp8Rows(data, scale, tuple(x.shape[:-1]), x.dtype)


def _padded_rows(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) with zero rows (scale 1) appended up to a multiple of ``ROW_MULTIPLE`` rows; as they are when
    already one. ``_scaled_mm`` is specified for sizes divisible by 16 (cuBLASLt may answer others with
    CUBLAS_STATUS_NOT_SUPPORTED), and Qwen-Image's text stream has as many rows as the prompt has tokens."""
    pad = -data.shape[0] % ROW_MULTIPLE
    if not pad:
        return data, scale
    # through uint8: byte 0 is float8 +0.0, and cat/zeros of float8 are not implemented on every backend
    zeros = data.new_zeros((pad, data.shape[1]), dtype=torch.uint8)
    data = torch.cat([data.view(torch.uint8), zeros]).view(data.dtype)
    return data, torch.cat([scale, scale.new_ones((pad, scale.shape[1]))])


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 (1, out) scales) of an (out, in) weight, one scale per output channel, computed
    ``QUANTIZE_ROWS_AT_ONCE`` rows at a time so the float32 temporary stays small."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((w.shape[0], 1), dtype=torch.float32, device=w.device)
    for a in range(0, w.shape[0], QUANTIZE_ROWS_AT_ONCE):
        part = w[a:a + QUANTIZE_ROWS_AT_ONCE]
        s = part.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # abs/max exact in bf16
        # one float32 temporary per slice, divided and clamped in place (a copy even of a float32 weight)
        temp = part.to(torch.float32, copy=True).div_(s).clamp_(-FP8_MAX, FP8_MAX)
        q[a:a + QUANTIZE_ROWS_AT_ONCE] = temp.to(torch.float8_e4m3fn)
        scale[a:a + QUANTIZE_ROWS_AT_ONCE] = s
    return q, scale.t().contiguous()


_REFUSED: set[tuple] = set()
"""GEMM shapes (rows, in, out) the float8 GEMM refused in this process (eagerly): computed from dequantised operands."""


def _float8_mm(data: torch.Tensor, scale: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_mm`` of float8 rows and an (out, in) float8 weight. A shape the GEMM refuses
    (CUBLAS_STATUS_NOT_SUPPORTED: cuBLASLt's row-wise float8 kernels do not cover every shape on every CUDA and GPU)
    is said once and computed in ``out_dtype`` from the dequantised operands (the same float8 values, at bf16
    speed) instead of failing every batch."""
    def gemm():
        return torch._scaled_mm(data, weight_fp8.t(), scale_a=scale, scale_b=weight_scale, bias=bias,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)

    if torch.compiler.is_compiling():  # traced: no try block in the graph (nothing fails while tracing)
        return gemm()
    shape = (data.shape[0], data.shape[1], weight_fp8.shape[0])
    if shape not in _REFUSED:
        try:
            return gemm()
        except RuntimeError as e:
            if "NOT_SUPPORTED" not in str(e):
                raise
            say = log.debug if _REFUSED else log.warning  # once a process: a prompt's length makes a new shape
            _REFUSED.add(shape)
            say("fp8: the float8 GEMM refused %d rows x %d -> %d on this GPU (%s); products of the shapes it refuses "
                "are computed from the dequantised float8 values instead (the same values, at bf16 speed)",
                *shape, str(e).split(" when calling")[0])
    # float8 values are exact in bf16: the products are the GEMM's, scaled afterwards in float32 as it does
    out = torch.nn.functional.linear(data.to(out_dtype), weight_fp8.to(out_dtype)).float() * scale * weight_scale
    return (out if bias is None else out + bias).to(out_dtype)


@dataclass(frozen=True)
class TpShard:
    """A tensor-parallel layer's place in its group (torch's ColwiseParallel / RowwiseParallel, as diffusers'
    ``_tp_plan`` applies them): ``rowwise`` layers hold a slice of the input features, and their partial products
    are summed over ``group`` before the (replicated) bias is added; colwise ones hold a slice of the outputs, whose
    local result is what the stock layer returns."""

    group: object
    rowwise: bool


def _tp_shard(weight: torch.Tensor) -> TpShard | None:
    """The layout of a tensor-parallel weight (a DTensor sharded over one mesh dimension); None for a plain one.
    AccelError for any other placement: its float8 copy would compute something else."""
    if type(weight).__name__ != "DTensor":  # checked by name: torch.distributed may be absent from the build
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = weight.placements
    if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim in (0, 1):
        return TpShard(group=weight.device_mesh.get_group(), rowwise=placements[0].dim == 1)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    raise AccelError(f"fp8=true: a tensor-parallel weight placed as {placements} is not a column or row shard over "
                     "one mesh dimension; set fp8=false")


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local part (a plain tensor as it is)."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


class Float8Linear(torch.nn.Module):
    """``nn.Linear`` computing ``x @ W.T + b`` in float8 e4m3: W quantised per output channel once,
    x per row (token) on every call, products accumulated in fp32 by ``torch._scaled_mm``.

    ``keep_original``: keep the bf16 layer (moved to the CPU) so ``disable_fp8`` can put it back; without it the
    layer's bf16 weight is freed once this module holds its float8 copy."""

    def __init__(self, linear: torch.nn.Linear, keep_original: bool = False):
        super().__init__()
        # tensor parallel: this rank's shard is quantised, and the layer does what the shard's hooks did (which go
        # with the replaced layer): a row shard's partial products are summed over its group
        self.tp = _tp_shard(linear.weight)
        weight = _local(linear.weight.detach())
        w_fp8, scale = quantize_weight(weight)
        self.register_buffer("weight_fp8", w_fp8)
        self.register_buffer("weight_scale", scale)  # (1, out), float32
        # a Parameter of its own over the same memory: moving the kept bf16 layer to the CPU below moves the
        # Parameters it holds, and a shared bias would leave this layer's on the CPU beside its GPU weight
        self.bias = None if linear.bias is None else torch.nn.Parameter(_local(linear.bias.detach()),
                                                                        requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # kept (not a submodule, so .to() and state_dict leave it alone) to switch fp8 off again
        object.__setattr__(self, "_original", linear.to("cpu") if keep_original else None)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        rows = _as_rows(x)
        out = self._mm(rows, self.weight_fp8, with_bias=not self._reduces)
        return self._reduced(out).reshape(*rows.lead, self.out_features)

    @property
    def _reduces(self) -> bool:
        """A row shard: its products are partial sums, the bias added once after they are summed."""
        return self.tp is not None and self.tp.rowwise

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        """A row shard's partial products summed over its tensor-parallel group, then the bias; else ``out``."""
        if not self._reduces:
            return out
        from torch.distributed import _functional_collectives as funcol

        out = funcol.all_reduce(out, "sum", self.tp.group)  # traceable: compiled blocks keep the collective
        return out if self.bias is None else out + self.bias

    def forward_parts(self, parts: list) -> torch.Tensor:
        """``self(torch.cat(parts, -1))`` without the concatenation: each part (a tensor or ``Fp8Rows``) is quantised
        row by row on its own (a scale per part: no coarser than the concatenation's) and multiplied by its block
        of the weight's columns (the same per-channel weight scales), the products summed in place."""
        out, start = None, 0
        for rows in map(_as_rows, parts):
            width = rows.data.shape[-1]
            first = out is None and not self._reduces
            product = self._mm(rows, self.weight_fp8[:, start:start + width], with_bias=first)
            out = product if out is None else out.add_(product)
            start += width
        if start != self.in_features:
            raise ValueError(f"forward_parts: the parts are {start} wide in all, the layer takes {self.in_features}")
        return self._reduced(out).reshape(*rows.lead, self.out_features)

    def _mm(self, rows: Fp8Rows, weight_fp8: torch.Tensor, with_bias: bool) -> torch.Tensor:
        """``rows @ weight_fp8.T`` scaled, in the input's dtype (float32 for a float32 input), plus the bias when
        asked (in the GEMM's epilogue where ``_scaled_mm`` takes it: on CUDA, in the output's dtype)."""
        dtype, on_cuda = rows.dtype, rows.data.is_cuda
        out_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        has_bias = with_bias and self.bias is not None
        fused = self.bias if has_bias and self.bias.dtype == out_dtype and on_cuda else None
        data, scale = _padded_rows(rows.data, rows.scale)
        out = _float8_mm(data, scale, weight_fp8, self.weight_scale, fused, out_dtype, USE_FAST_ACCUM and on_cuda)
        if data is not rows.data:
            out = out[:rows.data.shape[0]]
        if out.dtype != dtype:
            out = out.to(dtype)
        if has_bias and fused is None:
            out = out + self.bias
        return out

    def restore(self) -> torch.nn.Linear:
        """The bf16 layer this replaced, back on this layer's device; AccelError when it was not kept."""
        if self._original is None:
            raise AccelError("fp8 cannot be switched off in this process: its bf16 weights were freed when they were "
                             "quantised. Launch again with fp8=false.")
        return self._original.to(self.weight_fp8.device)

    def extra_repr(self) -> str:
        shard = "" if self.tp is None else (", row shard" if self.tp.rowwise else ", column shard")
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn row-wise{shard}"


def _modulation_linears(block: torch.nn.Module) -> set[str]:
    """Names of a block's adaLN modulation linears, which stay bf16: FLUX's (inside a ``norm*`` module) and
    Qwen-Image's (``img_mod``/``txt_mod``: ``SiLU`` then ``Linear``). They take one row per sample (the timestep
    embedding), where float8 saves nothing, and every activation of the block is scaled by what they make."""
    names = {name for name, mod in block.named_modules() if isinstance(mod, torch.nn.Linear) and "norm" in name}
    for name, mod in block.named_modules():
        if isinstance(mod, torch.nn.Sequential) and len(mod) >= 2 and isinstance(mod[0], torch.nn.SiLU):
            names.update(f"{name}.{i}" if name else str(i)
                         for i, m in enumerate(mod) if isinstance(m, torch.nn.Linear))
    return names


def _fp8_candidates(transformer: torch.nn.Module):
    """(parent, attribute, linear) for each block linear worth quantising."""
    for block in repeated_blocks(transformer):
        modulation = _modulation_linears(block)
        for name, mod in block.named_modules():
            if not isinstance(mod, torch.nn.Linear) or name in modulation:
                continue
            if mod.in_features % 16 or mod.out_features % 16:  # _scaled_mm's shape rule
                continue
            parent_name, _, attr = name.rpartition(".")
            yield block.get_submodule(parent_name) if parent_name else block, attr, mod


def converted_bytes(transformer: torch.nn.Module, dtype_bytes: int) -> int:
    """The bytes of ``transformer``'s parameters once ``enable_fp8`` converted it: each block linear it converts at
    one byte per weight plus a float32 scale per output row (its bias unchanged), the rest in ``dtype_bytes``.
    Counts only: ``transformer`` may be on the meta device."""
    total = sum(p.numel() for p in transformer.parameters()) * dtype_bytes
    for _, _, linear in _fp8_candidates(transformer):
        total -= linear.weight.numel() * (dtype_bytes - 1) - linear.out_features * 4
    return total


def make_reversible(transformer: torch.nn.Module) -> None:
    """Let ``disable_fp8`` restore this transformer's bf16 layers later: ``enable_fp8`` keeps them on the CPU."""
    setattr(transformer, _REVERSIBLE, True)


def enable_fp8(transformer: torch.nn.Module) -> int:
    """Replace the block linears by ``Float8Linear``s, one at a time, each layer's bf16 weight freed before the next
    is quantised (kept on the CPU where ``make_reversible`` asked); how many."""
    keep = bool(getattr(transformer, _REVERSIBLE, False))
    places = [(parent, attr) for parent, attr, _ in _fp8_candidates(transformer)]  # names only: no layer held here
    for parent, attr in places:
        # the parent held the bf16 layer's last reference: its memory goes back to the cache before the next layer
        setattr(parent, attr, Float8Linear(getattr(parent, attr), keep_original=keep))
    return len(places)


def disable_fp8(transformer: torch.nn.Module) -> int:
    """Put the original linears back; how many."""
    n = 0
    for block in repeated_blocks(transformer):
        for name, mod in list(block.named_modules()):
            if isinstance(mod, Float8Linear):
                parent_name, _, attr = name.rpartition(".")
                setattr(block.get_submodule(parent_name) if parent_name else block, attr, mod.restore())
                n += 1
    return n


def is_tensor_parallel(transformer: torch.nn.Module) -> bool:
    """Whether ``transformer`` is a tensor-parallel shard: DTensor weights, or float8 layers made from them (whose
    weights are local tensors, so a look for DTensors alone would miss it)."""
    return any(type(p).__name__ == "DTensor" for p in transformer.parameters()) or \
        any(isinstance(m, Float8Linear) and m.tp is not None for m in transformer.modules())


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
