"""Quantized KV caches (int8 per token and head, float8_e4m3fn per head) in the Triton kernels
against their torch references, on CPU under TRITON_INTERPRET=1.

Poisoning: slots no request owns hold NaN where the format can (fp8 codes 0x7F) and NaN scales
where it cannot (int8), so a read past a sequence's end turns the output NaN; outputs start NaN
so an unwritten row fails. The references dequantize the very bytes the kernels read, so the
tolerances are the unquantized kernels' (test_kernels.py): quantization error is not hidden in
them; its size is bounded separately (test_round_trip_error_is_bounded).
"""

import pytest
import torch
import triton
from test_kernels import BF16, F16, F32, TOLERANCE, relative_error

from kernels import (
    kv_store,
    kv_store_ref,
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_prefill,
    paged_attention_prefill_ref,
)
from kernels.reference import dequantize_cache

INT8, FP8 = torch.int8, torch.float8_e4m3fn
FP8_NAN = 0x7F  # e4m3fn's NaN code


def empty_quantized_cache(shape, cache_dtype, gen):
    """A poisoned K or V cache and its scales: int8 data 0 with NaN per-token scales; fp8 NaN
    codes with per-head scales of 0.5, 1, 2, ... (not 1.0, so folding them is exercised)."""
    num_kv_heads = shape[2]
    if cache_dtype == INT8:
        return torch.zeros(shape, dtype=INT8), torch.full(shape[:3], float("nan"), dtype=F16)
    cache = torch.full(shape, FP8_NAN, dtype=torch.uint8).view(FP8)
    scales = 2.0 ** torch.arange(-1, num_kv_heads - 1, dtype=F32)
    return cache, scales[torch.randperm(num_kv_heads, generator=gen)].contiguous()


def make_quantized_context(seq_lens, num_kv_heads, head_dim, block_size, cache_dtype, dtype, seed):
    """Random K/V (model dtype) of each request stored quantized in shuffled blocks.
    Returns (k_cache, v_cache, k_scale, v_scale, block_tables int32, seq_lens int32)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay poisoned
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, k_scale = empty_quantized_cache(shape, cache_dtype, gen)
    v_cache, v_scale = empty_quantized_cache(shape, cache_dtype, gen)
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
        # Heads of different magnitudes: per-head and per-token scales must differ.
        magnitude = 2.0 ** torch.arange(num_kv_heads, dtype=F32)[None, :, None]
        key = (torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) * magnitude).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        kv_store_ref(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens_t


# ---------------------------------------------------------------------------------------------
# kv_store


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "block_size", "num_kv_heads", "head_dim"),
    [(INT8, F32, 16, 3, 64), (INT8, BF16, 8, 2, 128), (FP8, F16, 16, 3, 64), (FP8, BF16, 8, 1, 64)],
)
def test_kv_store_quantized_matches_reference(
    cache_dtype, dtype, block_size, num_kv_heads, head_dim
):
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_tokens = 5, 29
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, k_scale = empty_quantized_cache(shape, cache_dtype, gen)
    v_cache, v_scale = empty_quantized_cache(shape, cache_dtype, gen)
    fused = (torch.randn(num_tokens, 2 * num_kv_heads * head_dim, generator=gen) * 3).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    key[0, 0] = 0.0  # an all-zero row: the smallest scale, no division by zero
    key[1, 0, :4] = 1000.0  # fp8: beyond +-448 after scaling, clamped
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[::4] = -1  # padding tokens
    refs = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]

    kv_store(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    kv_store_ref(key, value, refs[0], refs[1], slot_mapping, refs[2], refs[3])

    # Bit-exact: the same float32 ops in the same order (int8: floor(x / s + 0.5); fp8: the
    # kernel's hand-written round-to-nearest-even against torch's conversion).
    for got, want in zip((k_cache, v_cache, k_scale, v_scale), refs, strict=True):
        if got.dtype == FP8:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # Unwritten slots are still poisoned.
    written = slot_mapping[slot_mapping >= 0]
    poisoned = dequantize_cache(k_cache, k_scale).view(-1, num_kv_heads, head_dim).isnan()
    assert poisoned.all(dim=(1, 2)).sum() == num_blocks * block_size - written.numel()


def test_fp8_store_rounds_like_torch_over_the_whole_range():
    """The kernel's float32 -> e4m3 conversion (by hand: the interpreter's own is wrong) equals
    torch's on every code's neighbourhood: midpoints (ties to even), subnormals, +-448."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    midpoints = (codes[:-1] + codes[1:]) / 2
    nudged = torch.cat([midpoints * (1 + 2**-20), midpoints * (1 - 2**-20)])
    values = torch.cat([codes, midpoints, nudged, torch.tensor([1e-9, 3e-3, 447.9, 448.0])])
    values = torch.cat([values, -values])
    num_tokens = values.numel() // 64 + 1
    rows = torch.zeros(num_tokens * 64)
    rows[: values.numel()] = values
    rows = rows.view(num_tokens, 1, 64)
    cache = torch.zeros(num_tokens, 1, 1, 64, dtype=FP8)
    ones = torch.ones(1)
    kv_store(rows, rows, cache, cache.clone(), torch.arange(num_tokens), ones, ones)
    want = rows.to(FP8).float().flatten()
    got = cache.float().flatten()
    assert torch.equal(got, want), (rows.flatten()[got != want][:8], got[got != want][:8])


def test_round_trip_error_is_bounded():
    """Stored and read back: int8 is off by at most half a step (max|x| / 254) per element;
    fp8 by at most 2^-4 relative (3 mantissa bits) above e4m3's smallest normal 2^-6."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * 4
    slots = torch.arange(50)
    for cache_dtype in (INT8, FP8):
        shape = (50, 1, 3, 64)
        k_cache, k_scale = empty_quantized_cache(shape, cache_dtype, gen)
        v_cache, v_scale = empty_quantized_cache(shape, cache_dtype, gen)
        kv_store(x, x, k_cache, v_cache, slots, k_scale, v_scale)
        back = dequantize_cache(k_cache, k_scale).view(50, 3, 64)
        error = (back - x).abs()
        if cache_dtype == INT8:
            step = x.abs().amax(-1, keepdim=True) / 127
            assert (error <= step / 2 * (1 + 1e-3)).all()
        else:
            scaled = x / k_scale[None, :, None]
            normal = scaled.abs() >= 2**-6
            assert (error[normal] <= x.abs()[normal] * 2**-4).all()


# ---------------------------------------------------------------------------------------------
# attention over a quantized cache

DECODE_CASES = [
    # cache dtype, model dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens
    (INT8, F32, 16, 64, 3, 3, [1, 17, 300]),  # SmolLM2's 9 query / 3 KV heads
    (INT8, BF16, 8, 128, 2, 4, [33, 1500]),  # several flash-decoding partitions
    (FP8, F16, 32, 64, 3, 3, [77, 1027]),
    (FP8, BF16, 16, 64, 2, 1, [5, 700]),
]


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "block_size", "head_dim", "num_kv_heads", "group_size", "seq_lens"),
    DECODE_CASES,
)
def test_decode_over_quantized_cache_matches_reference(
    cache_dtype, dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens
):
    k_cache, v_cache, k_scale, v_scale, tables, lens = make_quantized_context(
        seq_lens, num_kv_heads, head_dim, block_size, cache_dtype, dtype, seed=sum(seq_lens)
    )
    gen = torch.Generator().manual_seed(len(seq_lens))
    query = torch.randn(len(seq_lens), num_kv_heads * group_size, head_dim, generator=gen)
    query = query.to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    scales = {"k_scale": k_scale, "v_scale": v_scale}

    paged_attention_decode(query, k_cache, v_cache, tables, lens, scale, out=out, **scales)
    ref = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, scale, **scales)

    assert not out.isnan().any(), "output not fully written (or a poisoned slot read)"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


PREFILL_CASES = [
    # cache dtype, model dtype, block_size, head_dim, num_kv_heads, group_size, (q_len, seq_len)
    (INT8, F32, 16, 64, 3, 3, [(5, 5), (40, 130), (0, 9)]),  # whole, prefix hit, no new token
    (INT8, BF16, 8, 64, 1, 4, [(70, 70), (17, 200)]),
    (FP8, F16, 16, 64, 3, 3, [(33, 33), (9, 90)]),
]


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "block_size", "head_dim", "num_kv_heads", "group_size", "requests"),
    PREFILL_CASES,
)
def test_prefill_over_quantized_cache_matches_reference(
    cache_dtype, dtype, block_size, head_dim, num_kv_heads, group_size, requests
):
    seq_lens = [seq_len for _, seq_len in requests]
    k_cache, v_cache, k_scale, v_scale, tables, lens = make_quantized_context(
        seq_lens, num_kv_heads, head_dim, block_size, cache_dtype, dtype, seed=len(seq_lens)
    )
    q_lens = [q_len for q_len, _ in requests]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(sum(q_lens))
    query = torch.randn(sum(q_lens), num_kv_heads * group_size, head_dim, generator=gen)
    query = query.to(dtype)
    out = torch.full_like(query, float("nan"))
    scales = {"k_scale": k_scale, "v_scale": v_scale}

    paged_attention_prefill(query, k_cache, v_cache, tables, lens, starts, 0.125, out=out, **scales)
    ref = paged_attention_prefill_ref(
        query, k_cache, v_cache, tables, lens, starts, 0.125, **scales
    )

    assert not out.isnan().any(), "output not fully written (or a poisoned slot read)"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


def test_quantized_cache_needs_its_scales():
    k_cache = torch.zeros(2, 16, 3, 64, dtype=INT8)
    key = torch.zeros(1, 3, 64)
    slots = torch.zeros(1, dtype=torch.long)
    with pytest.raises(AssertionError, match="needs k_scale"):
        kv_store(key, key, k_cache, k_cache.clone(), slots)
    fp8_scales = torch.ones(3)  # fp8's per-head shape, not int8's per-token one
    with pytest.raises(AssertionError, match=r"k_scale must be \(2, 16, 3\) torch.float16"):
        kv_store(key, key, k_cache, k_cache.clone(), slots, fp8_scales, fp8_scales)
    with pytest.raises(AssertionError, match="takes no scales"):
        kv_store(key, key, torch.zeros(2, 16, 3, 64), torch.zeros(2, 16, 3, 64), slots, key, key)
