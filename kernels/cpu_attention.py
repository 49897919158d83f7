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

from kernels.cpu_build import build_extension, unavailable_reason

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")


@functools.cache
def load_extension() -> ModuleType:
    """The compiled kernel: built on first use (~1 min), then loaded from the cache (~0.1 s).
    Raises CpuKernelUnavailable naming the reason when it cannot be built."""
    return build_extension("cpu_paged_attention", [SOURCE])


def cpu_kernel_status() -> str | None:
    """None when the kernel loads; else why not (for a log line or the UI)."""
    return unavailable_reason(load_extension)


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
    out = torch.empty_like(query) if out is None else out  # the C++ side checks every input
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


def store_kv_cpu(
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size, head_dim], contiguous
    v_cache: torch.Tensor,
    key: torch.Tensor,  # [tokens, num_kv_heads, head_dim], contiguous last dim
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [tokens]: block * block_size + offset
) -> None:
    """Write the step's K/V into a head-major 16/32-bit cache (the torch and cpu backends'
    layout) at their slots: kernels.reference's store for that layout, in one C++ call."""
    load_extension().store_kv(k_cache, v_cache, key, value, slot_mapping)
