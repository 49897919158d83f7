"""Triton paged-KV kernels against their torch references, on CPU under TRITON_INTERPRET=1.

Every cache slot that no request owns is NaN, and every output starts as NaN: a kernel that
reads past a sequence's end (even with zero weight: 0 * NaN = NaN) or leaves a row unwritten
fails. Cases are a representative sweep (each block size, head_dim, GQA ratio and dtype at
least once), not the cartesian product: the interpreter is slow on a 2-core CPU.
"""

import re

import pytest
import torch
import triton

from kernels import (
    kv_store,
    kv_store_ref,
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_prefill,
    paged_attention_prefill_ref,
)
from kernels.paged_attention_decode import partition_tokens_for

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_paged_context(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    """Random K/V for each request's positions [0, seq_len) in shuffled blocks; NaN elsewhere.

    Returns k_cache, v_cache, block_tables (int32, padded with a NaN block), seq_lens (int32).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_ids = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 2
    block_tables = torch.full((len(seq_lens), width), int(block_ids[-1]), dtype=torch.int32)
    used = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        block_tables[b, :n] = block_ids[used : used + n].to(torch.int32)
        used += n
        positions = torch.arange(seq_len)
        slots = block_tables[b, positions // block_size].long() * block_size
        slots += positions % block_size
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        kv_store_ref(key, value, k_cache, v_cache, slots)
    return k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def decode_case(dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens):
    """A DECODE_CASES row as (query, k_cache, v_cache, block_tables, seq_lens, scale): one
    query token per request over its paged context (make_paged_context)."""
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_context(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=sum(seq_lens)
    )
    gen = torch.Generator().manual_seed(len(seq_lens))
    num_heads = num_kv_heads * group_size
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, block_tables, seq_lens_t, head_dim**-0.5


def prefill_case(dtype, block_size, head_dim, num_kv_heads, group_size, requests):
    """A PREFILL_CASES row as (query, k_cache, v_cache, block_tables, seq_lens,
    query_start_loc, scale): each request's last q_len tokens of its seq_len, packed."""
    seq_lens = [seq_len for seq_len, _ in requests]
    q_lens = [q_len for _, q_len in requests]
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_context(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=sum(seq_lens) + 1
    )
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(sum(q_lens))
    num_heads = num_kv_heads * group_size
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, block_tables, seq_lens_t, query_start_loc, head_dim**-0.5


# ---------------------------------------------------------------------------------------------
# kv_store


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_kv_heads", "head_dim"),
    [(F32, 16, 2, 64), (F16, 8, 3, 128), (BF16, 32, 1, 64), (F16, 16, 8, 128)],
)
def test_kv_store_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size * 100 + num_kv_heads)
    num_blocks, num_tokens = 6, 37
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # key/value as strided views into one fused [tokens, 2 * heads * dim] projection output.
    fused = torch.randn(num_tokens, 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[::5] = -1  # padding tokens
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    kv_store(key, value, k_cache, v_cache, slot_mapping)
    kv_store_ref(key, value, k_ref, v_ref, slot_mapping)

    # Exact copy into the kept slots; every other slot (incl. the -1 tokens') untouched NaN.
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    assert (
        k_cache.isnan().any(dim=(2, 3)).sum() == num_blocks * block_size - (slot_mapping >= 0).sum()
    )


def test_kv_store_rejects_bad_inputs():
    k_cache = torch.zeros(4, 16, 2, 64)
    v_cache = torch.zeros_like(k_cache)
    key = torch.zeros(3, 2, 64)
    slots = torch.arange(3)
    with pytest.raises(AssertionError, match=r"key must be \[num_tokens, 2, 64\]"):
        kv_store(torch.zeros(3, 4, 64), key, k_cache, v_cache, slots)
    with pytest.raises(AssertionError, match="slot_mapping must be int64"):
        kv_store(key, key, k_cache, v_cache, slots.int())
    with pytest.raises(AssertionError, match=r"slot_mapping must be \[3\]"):
        kv_store(key, key, k_cache, v_cache, torch.arange(4))
    with pytest.raises(AssertionError, match=re.escape("key dtype torch.float16 != cache dtype")):
        kv_store(key.half(), key, k_cache, v_cache, slots)
    with pytest.raises(AssertionError, match="must be contiguous"):
        kv_store(key, key, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots)


# ---------------------------------------------------------------------------------------------
# paged_attention_decode

DECODE_CASES = [
    # dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens
    (F32, 16, 64, 2, 1, [1, 17, 300]),
    (F16, 8, 128, 1, 4, [33, 1, 1500]),  # 1500 tokens: several flash-decoding partitions
    (BF16, 32, 64, 3, 3, [77, 1027]),  # SmolLM2's 9 query / 3 KV heads
    (BF16, 16, 128, 1, 8, [2100, 5]),  # Llama-3-8B's group of 8
    (F32, 32, 128, 2, 3, [1, 64, 1201]),
]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group_size", "seq_lens"), DECODE_CASES
)
def test_decode_matches_reference(dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens):
    args = decode_case(dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens)
    out = torch.full_like(args[0], float("nan"))

    result = paged_attention_decode(*args, out=out)
    ref = paged_attention_decode_ref(*args)

    assert result is out and out.dtype == dtype
    assert not out.isnan().any(), "output not fully written (or NaN cache slot read)"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


def test_decode_long_contexts_use_several_partitions():
    """The > 1000-token decode cases above go through the partial/reduce path on CPU too."""
    block_size, seq_len = 8, 1500
    max_seq_len = triton.cdiv(seq_len, block_size) * block_size + 2 * block_size
    partition_tokens = partition_tokens_for(3, 1, max_seq_len, num_sms=4)  # the CPU setting
    assert triton.cdiv(max_seq_len, partition_tokens) > 1


def test_partition_count_fills_gpu_for_one_long_request():
    num_sms = 132  # H100/H200
    for num_kv_heads in (3, 8):
        partition_tokens = partition_tokens_for(1, num_kv_heads, 8192, num_sms)
        num_programs = num_kv_heads * triton.cdiv(8192, partition_tokens)
        assert num_programs >= num_sms
    # Big batches keep 512-token partitions; short contexts need no split (no reduce pass).
    assert partition_tokens_for(64, 8, 2048, num_sms) == 512
    assert partition_tokens_for(256, 8, 300, num_sms) >= 300


@pytest.mark.parametrize("extra_blocks", [0, 100])  # direct write / many empty partitions
def test_decode_padded_batch_and_wide_block_table(extra_blocks):
    """CUDA-graph shapes: a padding request with seq_len 0 (zeros out) and a block table far
    wider than the contexts (partitions past seq_len must neither write nor be read)."""
    k_cache, v_cache, block_tables, seq_lens = make_paged_context([1, 3, 40], 2, 64, 8, F16, 5)
    seq_lens[0] = 0
    padding = block_tables[:, -1:].expand(-1, extra_blocks)
    block_tables = torch.cat([block_tables, padding], dim=1).contiguous()
    query = torch.randn(3, 4, 64).half()
    out = torch.full_like(query, float("nan"))
    paged_attention_decode(query, k_cache, v_cache, block_tables, seq_lens, 0.125, out=out)
    ref = paged_attention_decode_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert relative_error(out[1:], ref[1:]) <= TOLERANCE[F16]


def test_decode_without_out_allocates_query_dtype():
    k_cache, v_cache, block_tables, seq_lens = make_paged_context([5, 9], 1, 64, 16, F16, 0)
    query = torch.randn(2, 2, 64).half()
    out = paged_attention_decode(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    ref = paged_attention_decode_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert out.dtype == F16 and out.shape == query.shape
    assert relative_error(out, ref) <= TOLERANCE[F16]


def test_decode_rejects_bad_inputs():
    k_cache, v_cache, block_tables, seq_lens = make_paged_context([5, 9], 2, 64, 16, F32, 0)
    query = torch.randn(2, 4, 64)
    with pytest.raises(AssertionError, match="must be a multiple of num_kv_heads 2"):
        paged_attention_decode(torch.randn(2, 3, 64), k_cache, v_cache, block_tables, seq_lens, 1)
    with pytest.raises(AssertionError, match="block_tables must be int32"):
        paged_attention_decode(query, k_cache, v_cache, block_tables.long(), seq_lens, 1.0)
    with pytest.raises(AssertionError, match=r"seq_lens must be \[2\]"):
        paged_attention_decode(query, k_cache, v_cache, block_tables, seq_lens[:1], 1.0)
    with pytest.raises(
        AssertionError, match=re.escape("query torch.float16 != kv cache torch.float32")
    ):
        paged_attention_decode(query.half(), k_cache, v_cache, block_tables, seq_lens, 1.0)
    with pytest.raises(AssertionError, match="query head_dim 32 != cache 64"):
        paged_attention_decode(query[..., :32], k_cache, v_cache, block_tables, seq_lens, 1.0)
    with pytest.raises(AssertionError, match="out dtype"):
        out = torch.empty_like(query, dtype=F16)
        paged_attention_decode(query, k_cache, v_cache, block_tables, seq_lens, 1.0, out=out)
    with pytest.raises(AssertionError, match="v_cache shape"):
        paged_attention_decode(query, k_cache, v_cache[:1], block_tables, seq_lens, 1.0)


# ---------------------------------------------------------------------------------------------
# paged_attention_prefill

PREFILL_CASES = [
    # dtype, block_size, head_dim, num_kv_heads, group_size, [(seq_len, q_len) per request]
    (F32, 16, 64, 2, 1, [(1, 1), (100, 100), (300, 45)]),
    (F16, 8, 128, 1, 4, [(1200, 70), (64, 64)]),  # long cached prefix (prefix hit)
    (BF16, 32, 64, 3, 3, [(130, 130), (517, 1), (50, 0), (90, 33)]),  # q_len 0 mid-batch
    (BF16, 16, 128, 1, 8, [(700, 200)]),  # chunked prefill, group of 8
    (F32, 32, 128, 2, 3, [(37, 37), (250, 129)]),
]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group_size", "requests"), PREFILL_CASES
)
def test_prefill_matches_reference(dtype, block_size, head_dim, num_kv_heads, group_size, requests):
    args = prefill_case(dtype, block_size, head_dim, num_kv_heads, group_size, requests)
    out = torch.full_like(args[0], float("nan"))

    result = paged_attention_prefill(*args, out=out)
    ref = paged_attention_prefill_ref(*args)

    assert result is out and out.dtype == dtype
    assert not out.isnan().any(), "output not fully written (or NaN cache slot read)"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


def test_prefill_last_token_equals_decode():
    """A prefill's last query row and a decode of that token are the same attention."""
    k_cache, v_cache, block_tables, seq_lens = make_paged_context([90, 41], 2, 64, 16, F32, 3)
    query = torch.randn(2 * 7, 4, 64)
    query_start_loc = torch.tensor([0, 7, 14], dtype=torch.int32)
    prefill = paged_attention_prefill(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.125
    )
    decode = paged_attention_decode(query[[6, 13]], k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(prefill[[6, 13]], decode, rtol=1e-5, atol=1e-6)


def test_prefill_rejects_bad_inputs():
    k_cache, v_cache, block_tables, seq_lens = make_paged_context([5, 9], 2, 64, 16, F32, 0)
    query = torch.randn(14, 4, 64)
    query_start_loc = torch.tensor([0, 5, 14], dtype=torch.int32)
    args = (k_cache, v_cache, block_tables, seq_lens)
    with pytest.raises(AssertionError, match=r"query_start_loc must be \[batch \+ 1\] = \[3\]"):
        paged_attention_prefill(query, *args, query_start_loc[:2], 1.0)
    with pytest.raises(AssertionError, match="query_start_loc must be int32"):
        paged_attention_prefill(query, *args, query_start_loc.long(), 1.0)
    with pytest.raises(AssertionError, match="query must be 3-D"):
        paged_attention_prefill(query.flatten(1), *args, query_start_loc, 1.0)
    with pytest.raises(AssertionError, match="head_dim must be a power of 2"):
        cache = torch.zeros(4, 16, 2, 80)
        q80 = torch.zeros(14, 4, 80)
        paged_attention_prefill(q80, cache, cache, block_tables, seq_lens, query_start_loc, 1.0)
