"""AttentionMetadata and the attention backends over the paged KV cache.

A token at position p of a request lives in slot block_table[p // block_size] * block_size
+ p % block_size. The per-layer cache layout depends on the backend:
  triton: [num_blocks, block_size, num_kv_heads, head_dim]  (the kernels' layout)
  torch:  [num_kv_heads, num_blocks, block_size, head_dim]  (head-major: one gather yields
          [kv_heads, batch, context, head_dim], which batched matmuls take with no copy)

Tokens of a step are packed decode-first: the first `num_decode_tokens` tokens belong to
requests with exactly one new token (decodes), the rest to requests with several (prefills,
whole or chunked), in request order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.runner.attention.torch_backend import torch_attention


def kv_cache_shape(
    backend: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    if backend == "torch":
        return (num_kv_heads, num_blocks, block_size, head_dim)
    return (num_blocks, block_size, num_kv_heads, head_dim)


@dataclass(frozen=True)
class DecodeGroup:
    """Decode requests [start, end) of the step, gathered together (torch backend)."""

    start: int
    end: int
    gather_index: torch.Tensor  # [Hkv * n * nb] cache rows: each request's nb blocks, padded
    ctx_mask: torch.Tensor  # [n, nb * bs] bool: which gathered positions are real context


@dataclass
class AttentionMetadata:
    backend: str  # "torch" | "triton"
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (-1 = padding)
    num_decode_tokens: int  # decode requests come first, one token each
    # --- decode group (one query token per request) ---
    decode_block_tables: torch.Tensor | None = None  # triton: [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # triton: [Bd] int32, context incl. new token
    # --- prefill group (varlen queries, causal over cached context + new tokens) ---
    prefill_q_lens: list[int] = field(default_factory=list)  # new tokens per prefill request
    prefill_ctx_lens: list[int] = field(default_factory=list)  # context after this step
    prefill_block_tables: torch.Tensor | None = None  # triton: [Bp, max_blocks] int32
    prefill_seq_lens: torch.Tensor | None = None  # triton: [Bp] int32
    prefill_query_start_loc: torch.Tensor | None = None  # triton: [Bp + 1] int32, from 0
    # --- torch backend only (indices into the head-major cache, see attention_torch.py) ---
    store_index: torch.Tensor | None = None  # [Hkv * T] rows where the new K/V go
    # Decode requests sorted by context length and split into groups, each padded only to
    # its own longest context (see split_by_length).
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # Per prefill request, [Hkv * nb] rows of its cached context; None when the whole context
    # is new in this step (attention then reads the new K/V directly).
    prefill_gather_index: list[torch.Tensor | None] = field(default_factory=list)
    # Scratch for gathered K and V, reused by every layer of the step. (Fresh multi-MB
    # tensors per layer cost more in page faults than the copy itself on CPU.)
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend. Returns [T, Hq, D]."""
    if meta.backend == "triton":
        return _triton_attention(q, k, v, kv_cache, meta, scale)
    return torch_attention(q, k, v, kv_cache, meta, scale)


def _triton_attention(q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    import kernels  # imported lazily: the torch path must not need a working Triton

    k_cache, v_cache = kv_cache
    kernels.kv_store(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        kernels.paged_attention_decode(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
            out=out[:nd],
        )  # fmt: skip
    if meta.prefill_q_lens:
        kernels.paged_attention_prefill(
            q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
            meta.prefill_query_start_loc, scale, out=out[nd:],
        )  # fmt: skip
    return out
