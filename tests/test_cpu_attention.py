"""The C++ CPU paged-attention kernel against the torch references, on the Triton kernels'
cases (test_kernels.py, test_kernels_kvq.py): every unowned cache slot NaN (or a NaN scale for
int8), every output starting NaN, GQA ratios 1-8, odd lengths, block boundaries, padded block
tables, and the torch backend's head-major cache passed as a strided view."""

from __future__ import annotations

import pytest
import torch
from test_kernels import (
    BF16,
    DECODE_CASES,
    F16,
    F32,
    PREFILL_CASES,
    TOLERANCE,
    decode_case,
    make_paged_context,
    prefill_case,
    relative_error,
)
from test_kernels_kvq import make_quantized_context

from kernels import cpu_attention
from kernels.cpu_attention import (
    cpu_kernel_status,
    paged_attention_decode_cpu,
    paged_attention_prefill_cpu,
    store_kv_cpu,
)
from kernels.reference import paged_attention_decode_ref, paged_attention_prefill_ref


@pytest.fixture(autouse=True, scope="module")
def _needs_compiler():
    if (why := cpu_kernel_status()) is not None:
        pytest.skip(f"CPU kernel unavailable: {why}")


def head_major_view(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored as [Hkv, blocks, bs, D] (the torch backend's layout), seen
    through a [blocks, bs, Hkv, D] view: what the cpu backend hands the kernel."""
    return cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


@pytest.mark.parametrize("layout", ["kernel", "head_major"])
@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group_size", "seq_lens"), DECODE_CASES
)
def test_decode_matches_reference(
    dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens, layout
):
    query, k_cache, v_cache, block_tables, seq_lens_t, scale = decode_case(
        dtype, block_size, head_dim, num_kv_heads, group_size, seq_lens
    )
    ref = paged_attention_decode_ref(query, k_cache, v_cache, block_tables, seq_lens_t, scale)
    if layout == "head_major":
        k_cache, v_cache = head_major_view(k_cache), head_major_view(v_cache)
    out = torch.full_like(query, float("nan"))

    result = paged_attention_decode_cpu(
        query, k_cache, v_cache, block_tables, seq_lens_t, scale, out=out
    )

    assert result is out and out.dtype == dtype
    assert not out.isnan().any(), "output not fully written (or NaN cache slot read)"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("block_size", "head_dim", "num_kv_heads", "group_size", "seq_lens"),
    [
        (8, 64, 2, 4, [5, 16, 100]),  # blocks shorter than the 16-key reduction tree
        (64, 128, 2, 2, [63, 64, 65, 640]),  # 4 trees per block, tails of 15, 0 and 1 keys
        (256, 64, 1, 3, [255, 700]),  # a block longer than a 128-key softmax span
        (16, 64, 1, 12, [40]),  # a group with no AVX512-BF16 instantiation: the generic path
        (16, 96, 2, 2, [40]),  # likewise a head_dim
    ],
)
def test_bf16_decode_shapes(block_size, head_dim, num_kv_heads, group_size, seq_lens):
    """bfloat16 decode takes cpu_decode_bf16.h's path where the CPU has AVX512-BF16 and the
    shape an instantiation, the generic one elsewhere: both must match the reference."""
    query, k_cache, v_cache, block_tables, seq_lens_t, scale = decode_case(
        BF16, block_size, head_dim, num_kv_heads, group_size, seq_lens
    )
    ref = paged_attention_decode_ref(query, k_cache, v_cache, block_tables, seq_lens_t, scale)
    out = torch.full_like(query, float("nan"))
    paged_attention_decode_cpu(query, k_cache, v_cache, block_tables, seq_lens_t, scale, out=out)
    assert not out.isnan().any(), "output not fully written (or NaN cache slot read)"
    assert relative_error(out, ref) <= TOLERANCE[BF16]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group_size", "requests"), PREFILL_CASES
)
def test_prefill_matches_reference(dtype, block_size, head_dim, num_kv_heads, group_size, requests):
    args = prefill_case(dtype, block_size, head_dim, num_kv_heads, group_size, requests)
    ref = paged_attention_prefill_ref(*args)
    out = torch.full_like(args[0], float("nan"))

    paged_attention_prefill_cpu(*args, out=out)

    assert not out.isnan().any(), "output not fully written (or NaN cache slot read)"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("block_size", "head_dim", "num_kv_heads", "group_size", "requests"),
    [
        (16, 64, 3, 3, [(512, 512), (40, 23), (300, 8)]),  # SmolLM2; items of 16, 7 and 8
        (8, 64, 2, 4, [(100, 37)]),  # blocks shorter than a 16-key group
        (64, 128, 1, 8, [(700, 200)]),  # cached prefix, 4 groups a block, D = 128
        (32, 32, 2, 1, [(45, 45)]),  # one 32-dim chunk, no GQA
        (16, 96, 1, 2, [(50, 50), (3, 3)]),  # three chunks; a context shorter than a group
    ],
)
def test_bf16_prefill_on_tiles_matches_reference(
    block_size, head_dim, num_kv_heads, group_size, requests
):
    """bfloat16 items of >= TILE_MIN_QUERIES query tokens take the prefill tiles where the CPU
    has them (cpu_prefill_amx.h: tile products, P rounded to bfloat16; cpu_prefill_f32.h:
    float32 FMAs, on AVX-512 without AVX512-BF16), the rest the row path: both must match the
    reference, and never read an unowned (NaN) slot."""
    ext = cpu_attention.load_extension()
    if not ext.prefill_tiles():
        pytest.skip("no prefill tiles on this CPU (no AMX granted, or AVX512-BF16 without AMX)")
    assert (ext.TILE_MIN_QUERIES, ext.QUERY_CHUNK) == (8, 16)
    args = prefill_case(BF16, block_size, head_dim, num_kv_heads, group_size, requests)
    ref = paged_attention_prefill_ref(*args)
    out = torch.full_like(args[0], float("nan"))
    paged_attention_prefill_cpu(*args, out=out)
    assert not out.isnan().any(), "output not fully written (or NaN cache slot read)"
    # Measured 1.5e-3 to 2.4e-3 (the bfloat16 reference itself is 1.6e-3 off float32).
    assert relative_error(out, ref) <= 5e-3


def test_prefill_tiles_take_the_multi_token_items():
    """The tiles run (not the row path beside them): a 512-token chunk of SmolLM2's shape sums
    in another order there (and the AMX tiles round P), so the outputs differ in some bits while
    both match the reference."""
    ext = cpu_attention.load_extension()
    if not ext.prefill_tiles():
        pytest.skip("no prefill tiles on this CPU")
    args = prefill_case(BF16, 16, 64, 3, 3, [(512, 512)])
    ref = paged_attention_prefill_ref(*args)
    tiles = paged_attention_prefill_cpu(*args)
    ext.set_prefill_tiles(False)
    try:
        rows = paged_attention_prefill_cpu(*args)
    finally:
        ext.set_prefill_tiles(True)
    assert relative_error(tiles, ref) <= 5e-3 and relative_error(rows, ref) <= 5e-3
    assert not torch.equal(tiles, rows)


def test_strided_query_and_padding_rows():
    """q as a view of a fused projection output, a seq_len-0 padding row (zeros out), and a
    block table far wider than the contexts."""
    k_cache, v_cache, block_tables, seq_lens = make_paged_context([1, 16, 17], 2, 64, 16, F32, 5)
    seq_lens[0] = 0
    block_tables = torch.cat([block_tables, block_tables[:, -1:].expand(-1, 50)], 1).contiguous()
    fused = torch.randn(3, 2 * 4 * 64)
    query = fused[:, : 4 * 64].view(3, 4, 64)
    out = torch.full_like(query, float("nan"))
    paged_attention_decode_cpu(query, k_cache, v_cache, block_tables, seq_lens, 0.125, out=out)
    ref = paged_attention_decode_ref(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert relative_error(out[1:], ref[1:]) <= 1e-5


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "block_size", "num_kv_heads", "group_size"),
    [(torch.int8, F32, 16, 3, 3), (torch.int8, BF16, 8, 2, 4),
     (torch.float8_e4m3fn, F32, 16, 3, 3), (torch.float8_e4m3fn, BF16, 32, 1, 8)],
)  # fmt: skip
def test_quantized_cache_matches_reference(
    cache_dtype, dtype, block_size, num_kv_heads, group_size
):
    requests = [(1, 1), (37, 37), (300, 1), (129, 40)]  # decodes, a prompt, a chunk
    seq_lens = [n for n, _ in requests]
    k_cache, v_cache, k_scale, v_scale, tables, seq_lens_t = make_quantized_context(
        seq_lens, num_kv_heads, 64, block_size, cache_dtype, dtype, seed=block_size
    )
    q_lens = [q for _, q in requests]
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_kv_heads * group_size, 64).to(dtype)
    args = (query, k_cache, v_cache, tables, seq_lens_t, starts, 0.125)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    ref = paged_attention_prefill_ref(*args, **scales)
    out = torch.full_like(query, float("nan"))
    paged_attention_prefill_cpu(*args, out=out, **scales)
    assert not out.isnan().any()
    assert relative_error(out, ref) <= TOLERANCE[dtype]


def test_bad_inputs_name_the_field():
    k_cache, v_cache, tables, seq_lens = make_paged_context([5, 9], 2, 64, 16, F32, 0)
    query = torch.randn(2, 4, 64)
    cases = [
        ("query", dict(query=torch.randn(2, 3, 64))),
        ("block_tables", dict(block_tables=tables.long())),
        ("seq_lens", dict(seq_lens=seq_lens[:1])),
        ("k_cache", dict(query=query.half(), out=None)),
        ("out", dict(out=torch.empty(2, 4, 64, dtype=F16))),
        ("k_cache", dict(v_cache=v_cache[:1])),
        ("k_scale", dict(k_scale=torch.ones(2))),
        ("k_cache", dict(k_cache=k_cache.transpose(2, 3))),
    ]
    for field, override in cases:
        kwargs = dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                      seq_lens=seq_lens, scale=1.0, out=torch.empty_like(query))  # fmt: skip
        kwargs.update(override)
        if kwargs["out"] is None:
            kwargs["out"] = torch.empty_like(kwargs["query"])
        with pytest.raises(ValueError, match=f"^{field}:"):
            paged_attention_decode_cpu(**kwargs)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_store_kv_writes_what_the_torch_store_writes(dtype):
    from engine.runner.attention.kv_quant import LayerKVCache
    from engine.runner.attention.torch_backend import store_kv, store_rows

    heads, blocks, bs, dim, tokens = 3, 6, 4, 32, 5
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (4 + 2 * heads) * dim, generator=gen).to(dtype)
    k = qkv[:, 4 * dim : (4 + heads) * dim].view(tokens, heads, dim)  # strided views, as the
    v = qkv[:, (4 + heads) * dim :].view(tokens, heads, dim)  # model hands them over
    slots = torch.tensor([0, 7, 23, 12, 5])
    expected = [torch.full((heads, blocks, bs, dim), float("nan"), dtype=dtype) for _ in "kv"]
    store_kv(LayerKVCache(*expected), k, v, store_rows(slots, heads, blocks * bs))
    actual = [torch.full_like(expected[0], float("nan")) for _ in "kv"]
    store_kv_cpu(*actual, k, v, slots)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a.nan_to_num(), e.nan_to_num())
        assert torch.equal(a.isnan(), e.isnan())  # no other slot touched
    with pytest.raises(ValueError, match="slot_mapping: slot 24 is outside"):
        store_kv_cpu(*actual, k, v, torch.tensor([0, 1, 2, 3, 24]))
    with pytest.raises(ValueError, match="k/v:"):
        store_kv_cpu(*actual, k.float() if dtype != F32 else k.half(), v, slots)


def test_read_kv_rows_reads_exactly_the_rows_decode_attention_reads():
    """The benchmark's memory-only probe: every visible K/V row once, no unowned slot (each
    32-bit word of a visible row holds 1, every other word 1000, so the sum counts words).
    The 150-token sequence spans two of the decode kernel's 128-key passes."""
    from kernels.cpu_attention import load_extension

    num_blocks, bs, heads, dim = 22, 16, 3, 64
    words = torch.full((num_blocks, bs, heads, dim // 2), 1000, dtype=torch.int32)
    seq_lens = torch.tensor([1, 17, 40, 0, 150], dtype=torch.int32)
    tables = torch.tensor(
        [[5, 0, 0] + [0] * 7, [2, 9, 0] + [0] * 7, [7, 1, 11] + [0] * 7, [0] * 10,
         [21, 12, 3, 20, 13, 4, 19, 14, 6, 18]],
        dtype=torch.int32,
    )  # fmt: skip
    for table, n in zip(tables.tolist(), seq_lens.tolist(), strict=True):
        for position in range(n):
            words[table[position // bs], position % bs] = 1
    k_cache = words.view(torch.bfloat16)  # [blocks, bs, heads, dim]
    v_cache = k_cache.clone()
    total = load_extension().read_kv_rows(k_cache, v_cache, tables, seq_lens)
    assert total == 2 * int(seq_lens.sum()) * heads * dim // 2
