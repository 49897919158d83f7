"""Fused per-layer ops of a Llama decoder on CPU (cpu_fused_ops.cpp): the wrappers and the build.

    rms_norm(x, w, eps)                  -> w * dtype(x * rsqrt(mean(x^2) + eps))
    add_rms_norm(x, residual, w, eps)    -> residual = dtype(residual + x) (in place), then
                                            rms_norm(residual, w, eps)
    rope_(x, positions, cos, sin, heads, head_dim)
                                         rotate-half RoPE in place on the first `heads` heads of
                                         each row of x [T, >= heads * head_dim] (any row stride)
    silu_mul(gate_up)                    -> dtype(silu(gate)) * up, gate_up = [gate | up]
    dequant_int4 / dequant_int8          a quantized weight in one pass, for the many-rows path
                                         of engine/runner/quant/linear.py

Each replaces 3-12 torch ops, and so as many passes through Python and the dispatcher, which
were most of a batch-1 decode step's time outside the matmuls. The C++ side checks its inputs
(ValueError naming the argument): a check in Python would cost more than the op at one row.
The torch reference is engine/runner/models/layer_ops.py's TorchOps.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu_build import build_extension, unavailable_reason

SOURCE = Path(__file__).with_name("cpu_fused_ops.cpp")
VECTOR = 16  # float32 lanes per vector: norm widths must be multiples of it, gate_up's of 2x


@functools.cache
def load_extension() -> ModuleType:
    """Built on first use (~30 s), then loaded from the cache; CpuKernelUnavailable if not."""
    return build_extension("cpu_fused_ops", [SOURCE])


def cpu_fused_ops_status() -> str | None:
    """None when the ops load; else why not (for a log line or the UI)."""
    return unavailable_reason(load_extension)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load_extension().rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Adds x into `residual` in place and returns the normalized sum."""
    return load_extension().add_rms_norm(x, residual, weight, eps)


def rope_(
    x: torch.Tensor,  # [T, >= num_heads * head_dim], rows of heads; rotated in place
    positions: torch.Tensor,  # int64 [T]
    cos: torch.Tensor,  # float32 [max_positions, head_dim / 2]
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> torch.Tensor:
    load_extension().rope_(x, positions, cos, sin, num_heads, head_dim)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return load_extension().silu_mul(gate_up)


def rows_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its max, NaN counting as the max (torch.argmax's rule), on
    float32 / bfloat16 / float16 rows without widening them: int64 [rows]."""
    return load_extension().rows_argmax(x)


def rows_sample(
    logits: torch.Tensor,  # [rows, vocab] float32 / bfloat16 / float16, contiguous rows
    temperature: torch.Tensor,  # float32 [rows], > 0
    top_k: torch.Tensor,  # int64 [rows], <= 0: off
    top_p: torch.Tensor,  # float32 [rows], in (0, 1]
    min_p: torch.Tensor,  # float32 [rows], in [0, 1]
    uniforms: torch.Tensor,  # float64 [rows], in [0, 1): each row's one draw
) -> torch.Tensor:
    """One sampled token per row, int64 [rows]: engine/runner/sampler.py's logits_to_probs
    and draw_tokens in one pass per row (kernels/cpu_sample_rows.h). ValueError for a row
    holding NaN or giving no token a finite chance, naming the row."""
    return load_extension().rows_sample(logits, temperature, top_k, top_p, min_p, uniforms)


def dequant_int4(
    wt: torch.Tensor,  # [K, rows] in scale_and_zero's dtype, contiguous rows: written
    packed: torch.Tensor,  # uint8 [N, K/2], kernels/int4_pack.py's layout
    scale_and_zero: torch.Tensor,  # [K/G, N, 2] = (s, zf), w = (q - 8) * s + zf
    group_size: int,
    row_start: int,  # whole 64-row blocks: row_start and rows multiples of 64
    rows: int,
) -> torch.Tensor:
    """Rows [row_start, row_start + rows) of the int4 weight, dequantized and TRANSPOSED into
    wt (one packed k of a 64-row block is 64 consecutive elements of wt's row k)."""
    load_extension().dequant_int4(wt, packed, scale_and_zero, group_size, row_start, rows)
    return wt


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    int8_activations_min_rows: int = 0,
) -> torch.Tensor:
    """x [M, K] @ (qweight (int8 [N, K], K % 16 == 0) * scales [N, None]).T, in x's dtype
    (scales in x's dtype too): W8A16, float32 accumulation. Decode's few rows; with
    has_int8_rows_linear(), bfloat16 x, N % 16 == 0 and K % 32 == 0, also many rows. From
    `int8_activations_min_rows` rows (0: never), bfloat16 x with N and K multiples of 64, x is
    quantized to int8 per 64 inputs (cpu_int8_act_linear.h, W8A8) where has_int8_act_linear()."""
    return load_extension().int8_linear(x, qweight, scales, int8_activations_min_rows)


def int4_linear(
    x: torch.Tensor,  # bfloat16 [M, K]
    packed: torch.Tensor,  # uint8 [N, K/2], kernels/int4_pack.py's layout, N % 64 == 0
    scale_and_zero: torch.Tensor,  # bfloat16 [K/G, N, 2] = (s, zf), w = (q - 8) * s + zf
    group_size: int,
    int8_activations_min_rows: int = 0,
) -> torch.Tensor:
    """x @ W.T for decode's few rows with W int4 (cpu_int4_linear.h; CPUs with AVX-512
    and VBMI: has_int4_linear()), float32 accumulation, bfloat16 out. From
    `int8_activations_min_rows` rows (0: never) x is quantized to int8 per group and multiplied
    with integer dot products (cpu_int8_act_linear.h, W4A8) where has_int8_act_linear()."""
    return load_extension().int4_linear(
        x, packed, scale_and_zero, group_size, int8_activations_min_rows
    )


def has_int8_act_linear() -> bool:
    """Whether int8_linear and int4_linear can quantize many rows of x to int8 and multiply with
    AVX512-VNNI (cpu_int8_act_linear.h: CPUs with AVX512-VNNI, BW and VBMI)."""
    return load_extension().has_int8_act_linear()


def has_int8_rows_linear() -> bool:
    """Whether int8_linear takes many bfloat16 rows here (cpu_int8_rows.h, AVX-512): from 5
    rows it widens the weight rows to bfloat16 once and multiplies bfloat16 pairs (vdpbf16ps
    where the CPU has AVX512-BF16)."""
    return load_extension().has_int8_rows_linear()


def has_amx_linear() -> bool:
    """Whether int8_linear, int4_linear and packed_bf16_linear multiply many bfloat16 rows with
    AMX tiles here (cpu_amx_linear.h: built for a CPU with AMX-BF16, and Linux granted this
    process the tile state): int8 from 4 rows, int4 from 6, packed bf16 from 5."""
    return load_extension().has_amx_linear()


def has_int4_linear() -> bool:
    """Whether this CPU runs int4_linear (else the int4 layers call aten's kernel)."""
    return load_extension().has_int4_linear()


def packed_bf16_linear(
    x: torch.Tensor, weight_address: int, out_features: int, in_features: int
) -> torch.Tensor:
    """x (bfloat16 [M, K], M <= prepack.packed_gemv_max_rows(kernels)) @ W.T for W in oneDNN's
    packed bf16 layout at `weight_address` (engine/runner/models/prepack.py checks the layout
    and owns the buffer)."""
    return load_extension().packed_bf16_linear(x, weight_address, out_features, in_features)


def dequant_int8(w: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w [rows, K] = qweight (int8 [rows, K], K % 16 == 0) * scales [rows], in scales' dtype."""
    load_extension().dequant_int8(w, qweight, scales)
    return w
