"""Plain-torch references for the paged-KV kernels: slow, simple, obviously correct.

They define what the Triton kernels in this folder must compute (int8 / float8_e4m3fn caches
included: the references dequantize the whole cache, then attend in float32). Each gathers one request at a time, expands KV heads for GQA with
repeat_interleave, and does the softmax in float32.

KV cache layout (per layer, one tensor for K and one for V):
    cache[num_blocks, block_size, num_kv_heads, head_dim], contiguous.
The token at position p of a request with block table bt lives in flat slot
    bt[p // block_size] * block_size + p % block_size
of cache.view(-1, num_kv_heads, head_dim).
"""

import torch


def kv_store_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; -1 = padding, skip
    k_scale: torch.Tensor | None = None,  # int8: [num_blocks, block_size, heads] f16, written
    v_scale: torch.Tensor | None = None,  # fp8: [num_kv_heads] f32, read
) -> None:
    """Write each token's K/V into its cache slot, in place; slot -1 is skipped.

    int8 cache: scale = max(max|x| / 127, 2^-14) per token and head, rounded to float16, and
    q = floor(x / scale + 0.5) clamped to +-127 (k_scale/v_scale receive the scales).
    float8_e4m3fn cache: clamp(x / scale[head], +-448), rounded to nearest even."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = new[keep].float()  # [n, heads, head_dim]
        if cache.dtype == torch.int8:
            token_scale = (rows.abs().amax(-1) / 127.0).clamp(min=2.0**-14).half()
            quantized = torch.floor(rows / token_scale.float()[..., None] + 0.5).clamp(-127, 127)
            scale.view(-1, num_kv_heads)[slots] = token_scale
            rows = quantized
        elif cache.dtype == torch.float8_e4m3fn:
            rows = (rows / scale.float()[None, :, None]).clamp(-448.0, 448.0)
        # float8 has no CPU index_put: write its bytes through a uint8 view.
        stored = rows.to(cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim)[slots] = stored


def dequantize_cache(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale: torch.Tensor | None,  # int8: [num_blocks, block_size, heads]; fp8: [heads]
) -> torch.Tensor:
    """The K or V values a (possibly quantized) cache holds, in float32 (model dtypes as is)."""
    if cache.dtype == torch.int8:
        return cache.float() * scale.float()[..., None]
    if cache.dtype == torch.float8_e4m3fn:
        return cache.float() * scale.float()[:, None]
    return cache


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # int [max_blocks_per_seq], one request's row
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first seq_len tokens of one request's K or V, in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def _attend(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    query_positions: torch.Tensor,  # [q_len], each query's position in the context
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim], float32
    """Causal softmax attention in float32: query i sees positions [0, query_positions[i]]."""
    group_size = query.shape[1] // key.shape[1]  # query heads per KV head (GQA)
    key = key.float().repeat_interleave(group_size, dim=1)
    value = value.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale  # [H, q_len, seq_len]
    key_positions = torch.arange(key.shape[0], device=key.device)
    future = key_positions[None, :] > query_positions[:, None]  # [q_len, seq_len]
    scores = scores.masked_fill(future[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value)


def _write(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def paged_attention_decode_ref(
    query: torch.Tensor,  # [batch, num_heads, head_dim], one new token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [batch], context length including the new token
    scale: float,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim], query dtype
    k_scale: torch.Tensor | None = None,  # int8 / fp8 caches: kv_store_ref's scales
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's newest token (position seq_len-1) over its whole context."""
    k_cache, v_cache = dequantize_cache(k_cache, k_scale), dequantize_cache(v_cache, v_scale)
    result = torch.empty_like(query)
    for b, seq_len in enumerate(seq_lens.tolist()):
        key = gather_context(k_cache, block_tables[b], seq_len)
        value = gather_context(v_cache, block_tables[b], seq_len)
        position = torch.tensor([seq_len - 1], device=query.device)
        result[b] = _attend(query[b : b + 1], key, value, position, scale)[0].to(query.dtype)
    return _write(result, out)


def paged_attention_prefill_ref(
    query: torch.Tensor,  # [total_query_tokens, num_heads, head_dim], packed varlen
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [batch], cached prefix + new tokens
    query_start_loc: torch.Tensor,  # int32 [batch + 1], cumulative query token counts
    scale: float,
    out: torch.Tensor | None = None,  # [total_query_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # int8 / fp8 caches: kv_store_ref's scales
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens (the last q_len of its context)."""
    k_cache, v_cache = dequantize_cache(k_cache, k_scale), dequantize_cache(v_cache, v_scale)
    result = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        key = gather_context(k_cache, block_tables[b], seq_len)
        value = gather_context(v_cache, block_tables[b], seq_len)
        positions = torch.arange(seq_len - q_len, seq_len, device=query.device)
        attended = _attend(query[q_start:q_end], key, value, positions, scale)
        result[q_start:q_end] = attended.to(query.dtype)
    return _write(result, out)
