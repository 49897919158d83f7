"""AttentionMetadata and the attention backends over the paged KV cache.

KV cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives in slot block_table[p // block_size] * block_size
+ p % block_size of the flattened cache.

Tokens of a step are packed decode-first: the first `num_decode_tokens` tokens belong to
requests with exactly one new token (decodes), the rest to requests with several (prefills,
whole or chunked), in request order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    backend: str  # "torch" | "triton"
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (-1 = padding)
    num_decode_tokens: int  # decode requests come first, one token each
    # --- decode group (one query token per request) ---
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [Bd] int32: context incl. the new token
    decode_ctx_slots: torch.Tensor | None  # torch backend: [Bd, Lmax] int64 slots (0-padded)
    decode_ctx_mask: torch.Tensor | None  # torch backend: [Bd, 1, 1, Lmax] bool, True = attend
    # --- prefill group (varlen queries, causal over cached context + new tokens) ---
    prefill_q_lens: list[int]  # new tokens per prefill request
    prefill_ctx_lens: list[int]  # context after this step per prefill request
    prefill_ctx_slots: list[torch.Tensor | None]  # torch: [L] slots, None when q_len == ctx
    prefill_block_tables: torch.Tensor | None  # triton: [Bp, max_blocks] int32
    prefill_seq_lens: torch.Tensor | None  # triton: [Bp] int32
    prefill_query_start_loc: torch.Tensor | None  # triton: [Bp + 1] int32, from 0


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
    return _torch_attention(q, k, v, kv_cache, meta, scale)


def _torch_attention(q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat[meta.slot_mapping] = k
    v_flat[meta.slot_mapping] = v
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        # Gather each request's context from its blocks: [Bd, L, Hkv, D] -> [Bd, Hkv, L, D].
        k_ctx = k_flat[meta.decode_ctx_slots].transpose(1, 2)
        v_ctx = v_flat[meta.decode_ctx_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),  # [Bd, Hq, 1, D]
            k_ctx,
            v_ctx,
            attn_mask=meta.decode_ctx_mask,
            scale=scale,
            enable_gqa=True,
        )
        out[:nd] = o.squeeze(2)
    start = nd
    for q_len, ctx_len, ctx_slots in zip(
        meta.prefill_q_lens, meta.prefill_ctx_lens, meta.prefill_ctx_slots, strict=True
    ):
        end = start + q_len
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if ctx_slots is None:  # whole prompt in this step: the new K/V are the context
            ki = k[start:end].transpose(0, 1).unsqueeze(0)
            vi = v[start:end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:  # chunk or prefix hit: earlier context comes from the cache
            ki = k_flat[ctx_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vi = v_flat[ctx_slots].transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = o.squeeze(0).transpose(0, 1)
        start = end
    return out


def _triton_attention(q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    import kernels  # imported lazily: the torch path must not need a working Triton

    k_cache, v_cache = kv_cache
    kernels.kv_store(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        kernels.paged_attention_decode(
            q[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            out=out[:nd],
        )
    if meta.prefill_q_lens:
        kernels.paged_attention_prefill(
            q[nd:],
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_seq_lens,
            meta.prefill_query_start_loc,
            scale,
            out=out[nd:],
        )
    return out
