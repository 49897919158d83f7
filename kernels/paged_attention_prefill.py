"""paged_attention_prefill: causal attention of packed new tokens over paged KV contexts.

Request b brings q_len_b = query_start_loc[b+1] - query_start_loc[b] new tokens, the last
q_len_b positions of its seq_len_b-token context (a cached prefix, then the new tokens; their
K/V are already in the cache). New token i sits at position seq_len_b - q_len_b + i and sees
positions [0, that position]. This covers whole prompts (q_len == seq_len), chunked prefill and
prefix-cache hits (q_len < seq_len) with one kernel.

Grid (num_query_tiles, num_kv_heads). A tile is TILE_QUERY_TOKENS new tokens of one request
times all GROUP_SIZE query heads of one KV group, packed into BLOCK_ROWS rows
(row r = token r // GROUP_SIZE, head r % GROUP_SIZE), so GQA reads each K/V tile once per group.
Each program streams its request's K/V in tiles of TILE_TOKENS with an online softmax in
float32 and stops at the tile's last causal position.

Tiles are numbered without a host sync: request b owns tiles starting at
    first_tile(b) = query_start_loc[b] // TILE_QUERY_TOKENS + b,
which leaves room for its cdiv(q_len_b, TILE_QUERY_TOKENS) tiles (floor(c/T) - floor(a/T) >=
floor((c-a)/T)); the grid is sized total_tokens // TILE_QUERY_TOKENS + batch, a program finds
its request by binary search, and spare tiles write nothing.
"""

import torch
import triton
import triton.language as tl

from kernels.kv_store import check_kv_scales, kv_quant_mode
from kernels.paged_attention_decode import (
    LOG2_E,
    Launch,
    check_attention_inputs,
    dot_f32,
    head_scales,
    load_kv_tile,
    online_softmax_step,
    upcast_dot,
)


def prefill_launch(head_dim: int, dtype: torch.dtype) -> Launch:
    """The prefill kernel's K/V tile and warps (64 query rows per program).

    16-bit, head_dim <= 128: 64-token tiles in 4 warps, from the `tune` rows of
    scripts/gpu_check.py on an H200 (2026-12-04, Llama-3-8B heads, 2048 tokens): 160 us (214
    TFLOP/s) against 281 us for the 8 warps picked before from ptxas alone; 4 warps beat 8 at
    every tile there (16: 220 vs 381 us, 32: 174 vs 277). ptxas: 179 registers, no spill.
    float32 (no tensor cores, not timed) keeps the register-based pick: 32-token tiles in 8
    warps (64 spills); head_dim 256 gets 16.
    """
    if head_dim > 128:
        return Launch(16, 8)
    if dtype == torch.float32:
        return Launch(32, 8)
    return Launch(64, 4)


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_requests, TILE_QUERY_TOKENS: tl.constexpr):
    """The largest b in [0, num_requests) with first_tile(b) <= tile."""
    low = tile * 0  # an int32 scalar; first_tile(0) == 0 <= tile
    high = num_requests
    while high - low > 1:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // TILE_QUERY_TOKENS + mid
        low = tl.where(first_tile <= tile, mid, low)
        high = tl.where(first_tile <= tile, high, mid)
    return low


@triton.jit
def _prefill_kernel(
    query_ptr,  # [total_query_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    k_scale_ptr,  # int8: [num_slots, num_kv_heads] f16; fp8: [num_kv_heads] f32; else unused
    v_scale_ptr,
    block_tables_ptr,  # int32 [batch, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [batch]
    query_start_loc_ptr,  # int32 [batch + 1]
    out_ptr,  # [total_query_tokens, num_heads, head_dim]
    scale_log2,  # softmax scale * log2(e)
    num_requests,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_block_tables_batch,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_ROWS: tl.constexpr,  # rows per tile: TILE_QUERY_TOKENS * GROUP_SIZE, padded to pow2
    TILE_QUERY_TOKENS: tl.constexpr,
    TILE_TOKENS: tl.constexpr,  # context tokens per K/V tile
    UPCAST_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_store.py's modes: 0 none, 1 int8 per token, 2 fp8 per head
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _find_request(query_start_loc_ptr, tile, num_requests, TILE_QUERY_TOKENS)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + request)
    prefix_len = seq_len - query_len  # cached positions before the first new token
    tile_first_query = (tile - (query_start // TILE_QUERY_TOKENS + request)) * TILE_QUERY_TOKENS

    rows = tl.arange(0, BLOCK_ROWS)
    dims = tl.arange(0, HEAD_DIM)
    query_index = tile_first_query + rows // GROUP_SIZE  # within the request
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    row_valid = (rows < TILE_QUERY_TOKENS * GROUP_SIZE) & (query_index < query_len)
    tokens = (query_start + query_index).to(tl.int64)
    query_offsets = tokens[:, None] * stride_query_token + heads[:, None] * stride_query_head
    query = tl.load(query_ptr + query_offsets + dims[None, :], mask=row_valid[:, None], other=0.0)
    # Invalid rows still get a position >= 0, so position 0 keeps every row's max finite.
    query_positions = prefix_len + query_index  # [ROWS]

    # Context this tile needs: up to its last valid query's position (none for spare tiles).
    last_query = tl.minimum(tile_first_query + TILE_QUERY_TOKENS, query_len)
    context_end = tl.where(tile_first_query < query_len, prefix_len + last_query, 0)

    row_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + request.to(tl.int64) * stride_block_tables_batch
    key_head_scale, value_head_scale = head_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_QUANT)
    score_scale = scale_log2 * key_head_scale  # fp8: q . (s_k k_q) = s_k (q . k_q)
    for tile_start in range(0, context_end, TILE_TOKENS):
        positions = tile_start + tl.arange(0, TILE_TOKENS)
        valid = positions < context_end
        key, value, key_scale, value_scale = load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table, positions, valid,
            kv_head, dims, query_ptr.dtype.element_ty, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
            KV_QUANT,
        )  # fmt: skip
        scores = dot_f32(query, tl.trans(key), UPCAST_DOT) * score_scale  # [ROWS, TILE]
        if KV_QUANT == 1:  # int8: each key column's own scale
            scores = scores * key_scale[None, :]
        causal = valid[None, :] & (positions[None, :] <= query_positions[:, None])
        scores = tl.where(causal, scores, float("-inf"))
        row_max, row_sum, acc = online_softmax_step(
            scores, value, value_scale, row_max, row_sum, acc, UPCAST_DOT, KV_QUANT == 1
        )

    # fp8's V scale folds into the normalization: sum_j p_j (s_v v_j) / l = s_v acc / l.
    out = acc * (value_head_scale / tl.where(row_sum > 0, row_sum, 1.0))[:, None]
    out_offsets = tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head
    tl.store(
        out_ptr + out_offsets + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def paged_attention_prefill(
    query: torch.Tensor,  # [total_query_tokens, num_heads, head_dim], packed varlen
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [batch], cached prefix + new tokens
    query_start_loc: torch.Tensor,  # int32 [batch + 1], cumulative query token counts
    scale: float,
    out: torch.Tensor | None = None,  # [total_query_tokens, num_heads, head_dim]
    launch: Launch | None = None,  # default prefill_launch(); set by tuning sweeps
    k_scale: torch.Tensor | None = None,  # int8 / fp8 caches: kv_store's scales
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its context. Returns out.

    Expects query_start_loc[-1] == total_query_tokens and q_len_b <= seq_len_b (not checked:
    reading device values would sync the host). An int8 or float8_e4m3fn cache is dequantized
    after load (scales as kv_store wrote them).
    """
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_attention_inputs(query, k_cache, v_cache, block_tables, seq_lens, batch, out)
    check_kv_scales(k_cache, k_scale, v_scale)
    assert query_start_loc.shape == (batch + 1,), (
        f"query_start_loc must be [batch + 1] = [{batch + 1}], got {tuple(query_start_loc.shape)}"
    )
    assert query_start_loc.dtype == torch.int32, (
        f"query_start_loc must be int32, got {query_start_loc.dtype}"
    )
    assert query_start_loc.device == query.device, (
        f"query_start_loc on {query_start_loc.device}, query on {query.device}"
    )
    assert query_start_loc.is_contiguous(), "query_start_loc must be contiguous"
    out = torch.empty_like(query) if out is None else out
    total_tokens = query.shape[0]
    if total_tokens == 0 or batch == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads

    block_rows = max(64, triton.next_power_of_2(group_size))
    tile_query_tokens = block_rows // group_size
    num_tiles = total_tokens // tile_query_tokens + batch
    launch = launch or prefill_launch(head_dim, query.dtype)
    _prefill_kernel[(num_tiles, num_kv_heads)](
        query,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # unused without quantization
        v_cache if v_scale is None else v_scale,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        float(scale) * LOG2_E,
        batch,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_ROWS=block_rows,
        TILE_QUERY_TOKENS=tile_query_tokens,
        TILE_TOKENS=launch.tile_tokens,
        UPCAST_DOT=upcast_dot(query.dtype, query.device),
        KV_QUANT=kv_quant_mode(k_cache.dtype),
        num_warps=launch.num_warps,
    )
    return out
