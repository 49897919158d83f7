"""CPU paged attention (cpu_paged_attention.cpp): the checked wrappers and the JIT build.

The C++ kernel reads K/V blocks in place through the block table (no gather copy), GQA-aware,
online softmax in float32. It is compiled once per machine and cached (kernels/cpu_build.py).

Same signatures as kernels.reference (cache [num_blocks, block_size, num_kv_heads, head_dim],
any strides with a contiguous last dim, so a head-major cache passes as a permuted view).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu_build import CpuKernelUnavailable, build_extension

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


@functools.cache
def load_extension() -> ModuleType:
    """The compiled kernel: built on first use (~1 min), then loaded from the cache (~0.1 s).
    Raises CpuKernelUnavailable naming the reason when it cannot be built."""
    return build_extension("cpu_paged_attention", [SOURCE])


def cpu_kernel_status() -> str | None:
    """None when the kernel loads; else why not (for a log line or the UI)."""
    try:
        load_extension()
    except CpuKernelUnavailable as exc:
        return str(exc)
    return None


def _check(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, k_scale, v_scale
) -> None:
    """ValueError naming the field for anything the C++ kernel would misread."""
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.device.type != "cpu":
            raise ValueError(f"{name}: CPU tensor expected, got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous, strides {t.stride()}")
    if query.dim() != 3 or query.dtype not in MODEL_DTYPES:
        raise ValueError(
            f"query: [tokens, heads, head_dim] float32/16, got {query.shape} {query.dtype}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache: 4-d like v_cache, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    if query.shape[2] % 16:  # the kernel works in 16-float vectors
        raise ValueError(f"query: head_dim must be a multiple of 16, got {query.shape[2]}")
    if k_cache.shape[3] != query.shape[2] or query.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"query: heads/head_dim {tuple(query.shape[1:])} do not fit cache {tuple(k_cache.shape)}"
        )
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out: {tuple(query.shape)} {query.dtype} expected, got {tuple(out.shape)} {out.dtype}"
        )
    if k_cache.dtype not in (query.dtype, *QUANT_DTYPES):
        raise ValueError(
            f"k_cache: dtype {k_cache.dtype} must be the query's, int8 or float8_e4m3fn"
        )
    quantized = k_cache.dtype in QUANT_DTYPES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if quantized != (scale is not None):
            raise ValueError(f"{name}: needed exactly when the cache is int8 or float8_e4m3fn")
        if scale is None:
            continue
        if k_cache.dtype == torch.int8 and (
            scale.shape != k_cache.shape[:3] or scale.dtype != torch.float16
        ):
            raise ValueError(
                f"{name}: float16 {tuple(k_cache.shape[:3])} expected for int8, got {scale.dtype} {tuple(scale.shape)}"
            )
        if k_cache.dtype == torch.float8_e4m3fn and (
            scale.shape != k_cache.shape[2:3]
            or scale.dtype != torch.float32
            or not scale.is_contiguous()
        ):
            raise ValueError(
                f"{name}: contiguous float32 [num_kv_heads] expected for fp8, got {scale.dtype} {tuple(scale.shape)}"
            )
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables: [batch, max_blocks] expected, got {tuple(block_tables.shape)}"
        )
    batch = block_tables.shape[0]
    for name, t, shape in (
        ("block_tables", block_tables, None), ("seq_lens", seq_lens, (batch,)),
        ("query_start_loc", query_start_loc, (batch + 1,)),
    ):  # fmt: skip
        if t.dtype != torch.int32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"{name}: int32 CPU tensor with a contiguous last dim expected")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {shape} expected, got {tuple(t.shape)}")


def paged_attention_prefill_cpu(
    query: torch.Tensor,  # [total_query_tokens, num_heads, head_dim], packed varlen
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (any strides)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [batch], cached prefix + new tokens
    query_start_loc: torch.Tensor,  # int32 [batch + 1], cumulative query token counts
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,  # int8: [blocks, bs, heads] f16; fp8: [heads] f32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens (the last q_len of its context).

    The host reads block_tables / seq_lens directly (no device, no sync to worry about); the
    caller guarantees every block id < num_blocks and seq_len <= width x block_size (the
    engine's block manager does), as the Triton kernels' callers do."""
    out = torch.empty_like(query) if out is None else out
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, k_scale, v_scale)
    load_extension().paged_attention(
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        k_scale, v_scale,
    )  # fmt: skip
    return out


def paged_attention_decode_cpu(
    query: torch.Tensor,  # [batch, num_heads, head_dim], one new token per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [batch], context including the new token (0 = padding)
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,  # arange(batch + 1), if the caller has one
) -> torch.Tensor:
    """Attention of each request's newest token over its whole context (prefill, q_len 1)."""
    if query_start_loc is None:
        query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention_prefill_cpu(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
        k_scale, v_scale,
    )  # fmt: skip
