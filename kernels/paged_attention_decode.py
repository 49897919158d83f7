"""paged_attention_decode: one new query token per request against its paged KV context.

Flash-decoding in two kernels:
1. `_decode_partition_kernel`, grid (num_kv_heads, batch, num_partitions). Each program takes
   one request's context slice of PARTITION_TOKENS tokens and all query heads of one KV group
   (GQA), so each K/V tile is read from memory once per group. It walks the slice in tiles of
   TILE_TOKENS, gathering each token's cache row through the block table, and keeps an online
   softmax in float32: running max m, running sum l, unnormalized output acc. The group's
   query heads are padded to 16 rows so both products can use tl.dot (M, N, K >= 16).
2. `_decode_reduce_kernel`, grid (num_heads, batch), merges the partitions:
       M = max_p m_p,   w_p = 2^(m_p - M),   out = sum_p w_p acc_p / sum_p w_p l_p.
   With a single partition the first kernel writes the output itself and this one is skipped.

Scores live in the log2 domain (scale * log2(e) folded in) so the kernel uses exp2.
The wrapper never reads device values (no host sync), so it can be captured in a CUDA graph:
the grid is sized from block_tables' width, and partitions past a request's length do nothing.
"""

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.kv_store import NO_QUANT, check_kv_cache, check_kv_scales, kv_quant_mode

LOG2_E = 1.4426950408889634
MIN_PARTITION_TOKENS = 128
MAX_PARTITION_TOKENS = 512
PROGRAMS_PER_SM = 4  # enough resident programs per SM to hide gather latency


@triton.jit
def dot_f32(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in float32.

    "ieee" keeps float32 products exact (tf32 would break the 1e-5 check); 16-bit operands
    still go to tensor cores (checked in the sm_90 PTX). UPCAST converts operands to float32
    first: Triton's CPU interpreter multiplies bf16 as raw uint16 (wrong results), so the
    wrappers set it only for bf16 CPU tensors; on GPU bf16 stays on tensor cores.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table, positions, valid, kv_head,
    dims, compute_dtype: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """K and V rows [TILE, HEAD_DIM] of one KV head at `positions`, through the block table,
    in `compute_dtype` (int8 and e4m3 values are exact in float16/bfloat16), plus int8's
    per-token K and V scales [TILE] (ones otherwise; the caller folds them into the products).
    Invalid positions load zeros (and read block 0's address, never dereferenced)."""
    block = tl.load(block_table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slots = block * BLOCK_SIZE + positions % BLOCK_SIZE
    kv_offsets = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
    key = tl.load(k_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)
    value = tl.load(v_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0)
    if KV_QUANT == 1:  # INT8_PER_TOKEN: scales are [slots, heads]
        key_scale = tl.load(k_scale_ptr + slots * NUM_KV_HEADS + kv_head, mask=valid, other=0.0)
        value_scale = tl.load(v_scale_ptr + slots * NUM_KV_HEADS + kv_head, mask=valid, other=0.0)
        key_scale = key_scale.to(tl.float32)
        value_scale = value_scale.to(tl.float32)
    else:
        key_scale = tl.full(positions.shape, 1.0, tl.float32)
        value_scale = key_scale
    if KV_QUANT != 0:
        key = key.to(tl.float32).to(compute_dtype)
        value = value.to(tl.float32).to(compute_dtype)
    return key, value, key_scale, value_scale


@triton.jit
def head_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_QUANT: tl.constexpr):
    """fp8's K and V scales of one KV head (1.0 otherwise). Each program handles one KV head,
    so they fold exactly into the softmax scale (K) and the output normalization (V)."""
    if KV_QUANT == 2:  # FP8_PER_HEAD
        return tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)
    return 1.0, 1.0


@triton.jit
def online_softmax_step(
    scores, value, value_scale, row_max, row_sum, acc, UPCAST: tl.constexpr,
    PER_TOKEN_SCALES: tl.constexpr,
):  # fmt: skip
    """Fold one tile of masked log2-domain scores [ROWS, TILE] and its values into the running
    (max m, sum l, unnormalized acc):  m' = max(m, max s),  l' = l 2^(m - m') + sum 2^(s - m'),
    acc' = acc 2^(m - m') + 2^(s - m') V. With int8's per-token V scales s_v, V = V_q diag(s_v)
    and the product is (2^(s - m') diag(s_v)) V_q: the scales weight the probabilities' columns
    (TILE multiplies instead of TILE x HEAD_DIM), the sum l keeps the unweighted ones."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    rescale = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    weights = probs * value_scale[None, :] if PER_TOKEN_SCALES else probs
    acc = acc * rescale[:, None] + dot_f32(weights.to(value.dtype), value, UPCAST)
    return new_max, row_sum, acc


@triton.jit
def _decode_partition_kernel(
    query_ptr,  # [batch, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    k_scale_ptr,  # int8: [num_slots, num_kv_heads] f16; fp8: [num_kv_heads] f32; else unused
    v_scale_ptr,
    block_tables_ptr,  # int32 [batch, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [batch]
    out_ptr,  # [batch, num_heads, head_dim]; written only when DIRECT_OUTPUT
    partial_max_ptr,  # f32 [batch, num_heads, num_partitions]; log2 domain
    partial_sum_ptr,  # f32 [batch, num_heads, num_partitions]
    partial_acc_ptr,  # f32 [batch, num_heads, num_partitions, head_dim]; unnormalized
    scale_log2,  # softmax scale * log2(e)
    stride_query_batch,
    stride_query_head,
    stride_out_batch,
    stride_out_head,
    stride_block_tables_batch,
    NUM_KV_HEADS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    GROUP_ROWS: tl.constexpr,  # GROUP_SIZE padded to a power of two >= 16 (tl.dot minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_TOKENS: tl.constexpr,
    PARTITION_TOKENS: tl.constexpr,
    DIRECT_OUTPUT: tl.constexpr,  # one partition: normalize and write out, no reduce pass
    UPCAST_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_store.py's modes: 0 none, 1 int8 per token, 2 fp8 per head
):
    kv_head = tl.program_id(0)
    batch = tl.program_id(1)
    partition = tl.program_id(2)
    num_partitions = tl.num_programs(2)
    num_heads = NUM_KV_HEADS * GROUP_SIZE

    seq_len = tl.load(seq_lens_ptr + batch)
    start = partition * PARTITION_TOKENS
    end = tl.minimum(start + PARTITION_TOKENS, seq_len)

    rows = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP_SIZE + rows
    # A CUDA graph sizes the grid for the longest possible context, so most partitions of a
    # short request are empty: they load and store nothing (the reduce never reads them).
    # Partition 0 always counts, so the direct path writes every row, zeros for seq_len 0.
    row_valid = (rows < GROUP_SIZE) & ((start < seq_len) | (partition == 0))
    query_offsets = batch * stride_query_batch + heads[:, None] * stride_query_head + dims[None, :]
    query = tl.load(query_ptr + query_offsets, mask=row_valid[:, None], other=0.0)

    row_max = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + batch.to(tl.int64) * stride_block_tables_batch
    key_head_scale, value_head_scale = head_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_QUANT)
    score_scale = scale_log2 * key_head_scale  # q . (s_k k_q) = s_k (q . k_q)
    # Every tile holds at least one valid token (tile_start < end), so row_max is finite
    # after the first tile and exp2(row_max - new_max) never sees -inf - -inf.
    for tile_start in range(start, end, TILE_TOKENS):
        positions = tile_start + tl.arange(0, TILE_TOKENS)
        valid = positions < end
        key, value, key_scale, value_scale = load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table, positions, valid,
            kv_head, dims, query_ptr.dtype.element_ty, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
            KV_QUANT,
        )  # fmt: skip
        scores = dot_f32(query, tl.trans(key), UPCAST_DOT) * score_scale  # [ROWS, TILE]
        if KV_QUANT == 1:  # int8: each key column's own scale
            scores = scores * key_scale[None, :]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        row_max, row_sum, acc = online_softmax_step(
            scores, value, value_scale, row_max, row_sum, acc, UPCAST_DOT, KV_QUANT == 1
        )
    acc = acc * value_head_scale  # sum_j p_j (s_v v_j) = s_v sum_j p_j v_j

    if DIRECT_OUTPUT:
        # A request with seq_len 0 (batch padding) gets zeros instead of 0/0.
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        out_offsets = batch * stride_out_batch + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        partial = (batch * num_heads + heads).to(tl.int64) * num_partitions + partition
        tl.store(partial_max_ptr + partial, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial, row_sum, mask=row_valid)
        acc_offsets = partial[:, None] * HEAD_DIM + dims[None, :]
        tl.store(partial_acc_ptr + acc_offsets, acc, mask=row_valid[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [batch, num_heads, head_dim]
    seq_lens_ptr,  # int32 [batch]
    partial_max_ptr,  # f32 [batch, num_heads, num_partitions]
    partial_sum_ptr,
    partial_acc_ptr,  # f32 [batch, num_heads, num_partitions, head_dim]
    num_partitions,
    stride_out_batch,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    PARTITION_TOKENS: tl.constexpr,
    CHUNK: tl.constexpr,  # partitions merged per loop step
):
    head = tl.program_id(0)
    batch = tl.program_id(1)
    num_heads = tl.num_programs(0)
    seq_len = tl.load(seq_lens_ptr + batch)
    num_used = tl.cdiv(seq_len, PARTITION_TOKENS)  # partitions that saw any token
    base = (batch * num_heads + head).to(tl.int64) * num_partitions
    lanes = tl.arange(0, CHUNK)
    dims = tl.arange(0, HEAD_DIM)

    # Pass 1: the global max over used partitions.
    max_lanes = tl.full([CHUNK], float("-inf"), tl.float32)
    for chunk_start in range(0, num_used, CHUNK):
        used = chunk_start + lanes < num_used
        part_max = tl.load(partial_max_ptr + base + chunk_start + lanes, mask=used, other=0.0)
        max_lanes = tl.maximum(max_lanes, tl.where(used, part_max, float("-inf")))
    global_max = tl.max(max_lanes, 0)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)  # seq_len 0

    # Pass 2: weight each partition by 2^(m_p - M) and sum.
    sum_lanes = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([CHUNK, HEAD_DIM], tl.float32)
    for chunk_start in range(0, num_used, CHUNK):
        partitions = chunk_start + lanes
        used = partitions < num_used
        part_max = tl.load(partial_max_ptr + base + partitions, mask=used, other=0.0)
        part_sum = tl.load(partial_sum_ptr + base + partitions, mask=used, other=0.0)
        acc_offsets = (base + partitions)[:, None] * HEAD_DIM + dims[None, :]
        part_acc = tl.load(partial_acc_ptr + acc_offsets, mask=used[:, None], other=0.0)
        weight = tl.where(used, tl.exp2(part_max - global_max), 0.0)
        sum_lanes += part_sum * weight
        acc += part_acc * weight[:, None]
    total_sum = tl.sum(sum_lanes, 0)
    out = tl.sum(acc, 0) / tl.where(total_sum > 0, total_sum, 1.0)
    out_offsets = batch * stride_out_batch + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty))


class Launch(NamedTuple):
    """How a kernel is launched: context tokens per K/V tile and warps per program."""

    tile_tokens: int
    num_warps: int


def decode_launch(head_dim: int, dtype: torch.dtype) -> Launch:
    """The decode kernel's K/V tile and warps per program.

    The kernel is a memory-bound gather, so the pick maximizes K/V bytes in flight per SM
    (resident programs x one K+V tile) among launches that do not spill registers, from
    ptxas's sm_90 report of every candidate (scripts/kernel_resources.py --sweep): for Llama-3-8B
    in bf16, 64-token tiles in 4 warps take 93 registers, 5 programs/SM, 160 KiB in flight,
    vs 64 KiB for 16-token tiles. float32 (no tensor cores) halves the tile at head_dim 128.
    A GPU run of scripts/gpu_check.py times the candidates to confirm or replace the pick.
    """
    if head_dim > 128:
        return Launch(16 if dtype == torch.float32 else 32, 4)
    if dtype == torch.float32 and head_dim == 128:
        return Launch(32, 4)
    return Launch(64, 4)


@functools.cache
def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in for the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # CPU interpreter: few programs keep tests fast, still more than one partition


def partition_tokens_for(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Context tokens per flash-decoding partition: a power of two in [128, 512].

    Splits the context until batch * num_kv_heads * num_partitions reaches PROGRAMS_PER_SM
    programs per SM, so batch 1 with an 8k context still fills the GPU. The 512 cap (vLLM's
    partition size) keeps big batches in many short programs, which balances SMs better than
    a few long ones (wave tails) for a reduce pass that moves < 1% of the K/V bytes.
    """
    target_programs = PROGRAMS_PER_SM * num_sms
    wanted_partitions = triton.cdiv(target_programs, max(batch * num_kv_heads, 1))
    tokens = triton.next_power_of_2(triton.cdiv(max(max_seq_len, 1), wanted_partitions))
    return min(max(tokens, MIN_PARTITION_TOKENS), MAX_PARTITION_TOKENS)


def check_attention_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_requests: int,
    out: torch.Tensor | None,
) -> None:
    """Asserts shared by decode and prefill; query is [tokens, num_heads, head_dim]."""
    check_kv_cache(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert query.dim() == 3, (
        f"query must be 3-D [tokens, heads, head_dim], got {tuple(query.shape)}"
    )
    assert query.shape[2] == head_dim, f"query head_dim {query.shape[2]} != cache {head_dim}"
    assert query.shape[1] % num_kv_heads == 0, (
        f"num_heads {query.shape[1]} must be a multiple of num_kv_heads {num_kv_heads} (GQA)"
    )
    assert head_dim in (16, 32, 64, 128, 256), (
        f"head_dim must be a power of 2 in [16, 256], got {head_dim}"
    )
    assert query.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        f"query dtype must be float32/float16/bfloat16, got {query.dtype}"
    )
    assert query.dtype == k_cache.dtype or kv_quant_mode(k_cache.dtype) != NO_QUANT, (
        f"query {query.dtype} != kv cache {k_cache.dtype}"
    )
    assert query.device == k_cache.device, f"query on {query.device}, cache on {k_cache.device}"
    assert query.stride(2) == 1, f"query must be contiguous in head_dim, strides {query.stride()}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_requests, (
        f"block_tables must be [{num_requests}, max_blocks_per_seq], got {tuple(block_tables.shape)}"
    )
    assert block_tables.dtype == torch.int32, (
        f"block_tables must be int32, got {block_tables.dtype}"
    )
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert seq_lens.shape == (num_requests,), (
        f"seq_lens must be [{num_requests}], got {tuple(seq_lens.shape)}"
    )
    assert seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}"
    assert seq_lens.is_contiguous(), "seq_lens must be contiguous"
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        assert tensor.device == query.device, f"{name} on {tensor.device}, query on {query.device}"
    if out is not None:
        assert out.shape == query.shape, (
            f"out shape {tuple(out.shape)} != query {tuple(query.shape)}"
        )
        assert out.dtype == query.dtype, f"out dtype {out.dtype} != query {query.dtype}"
        assert out.device == query.device, f"out on {out.device}, query on {query.device}"
        assert out.stride(2) == 1, f"out must be contiguous in head_dim, strides {out.stride()}"


def upcast_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 tl.dot is wrong under the CPU interpreter; see dot_f32."""
    return dtype == torch.bfloat16 and device.type == "cpu"


def paged_attention_decode(
    query: torch.Tensor,  # [batch, num_heads, head_dim], the newest token of each request
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [batch], context length including the new token
    scale: float,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim], query dtype
    launch: Launch | None = None,  # default decode_launch(); set by tuning sweeps
    k_scale: torch.Tensor | None = None,  # int8 / fp8 caches: kv_store's scales
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's newest token over positions [0, seq_len). Returns out.

    The new token's K/V must already be in the cache (kv_store first). seq_len 0 gives zeros.
    An int8 or float8_e4m3fn cache is dequantized after load (scales as kv_store wrote them).
    """
    batch = query.shape[0] if query.dim() == 3 else -1
    check_attention_inputs(query, k_cache, v_cache, block_tables, seq_lens, batch, out)
    check_kv_scales(k_cache, k_scale, v_scale)
    out = torch.empty_like(query) if out is None else out
    if batch == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads

    # Upper bound on seq_lens from the table's width: no device read, CUDA-graph safe.
    max_seq_len = block_tables.shape[1] * block_size
    partition_tokens = partition_tokens_for(
        batch, num_kv_heads, max_seq_len, device_num_sms(query.device)
    )
    num_partitions = triton.cdiv(max_seq_len, partition_tokens)
    direct = num_partitions == 1
    scratch = (batch, num_heads, num_partitions)
    f32 = {"dtype": torch.float32, "device": query.device}
    partial_max = torch.empty(0 if direct else math.prod(scratch), **f32)
    partial_sum = torch.empty_like(partial_max)
    partial_acc = torch.empty(0 if direct else math.prod(scratch) * head_dim, **f32)
    launch = launch or decode_launch(head_dim, query.dtype)
    scale_log2 = float(scale) * LOG2_E

    _decode_partition_kernel[(num_kv_heads, batch, num_partitions)](
        query,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # unused without quantization
        v_cache if v_scale is None else v_scale,
        block_tables,
        seq_lens,
        out,
        partial_max,
        partial_sum,
        partial_acc,
        scale_log2,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP_SIZE=group_size,
        GROUP_ROWS=max(16, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_TOKENS=launch.tile_tokens,
        PARTITION_TOKENS=partition_tokens,
        DIRECT_OUTPUT=direct,
        UPCAST_DOT=upcast_dot(query.dtype, query.device),
        KV_QUANT=kv_quant_mode(k_cache.dtype),
        num_warps=launch.num_warps,
    )
    if not direct:
        _decode_reduce_kernel[(num_heads, batch)](
            out,
            seq_lens,
            partial_max,
            partial_sum,
            partial_acc,
            num_partitions,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            PARTITION_TOKENS=partition_tokens,
            CHUNK=min(16, triton.next_power_of_2(num_partitions)),
            num_warps=4,
        )
    return out
