"""The C++ kernels built without AVX512-BF16 (cpu_simd.h's dot_bf16_pairs / bf16_pairs_from:
the instructions' arithmetic in AVX-512F) give the outputs built with it give.

The fallback follows Intel's description of vdpbf16ps (the odd product added, then the even
one, each rounded), which makes them the same bits; a CPU whose instruction rounds the pair's
sum once would differ in a last float32 bit now and then. So the products are checked within
the output's bfloat16 rounding with nine in ten elements bit-equal (int4 at 1-2 rows takes
float32 lanes without AVX512-BF16: summed in another order, the same check), attention within
its rounding.

CPUs without AVX512-BF16 (Skylake-X to Ice Lake, and guests whose hypervisor hides the flag)
run the fallback in every kernel test; on a CPU with it, this file builds the extensions a
second time with the instruction switched off (-mno-avx512bf16, and AMX off in both builds so
that both multiply many rows the same way) and compares every kernel that multiplies bfloat16
pairs: int4 (nibbles and dequantized pairs), int8 (dot products and x lanes), the packed bf16
product and decode attention (decode rows and the generic path's scores).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from fused_close import assert_close, int4_weight

from kernels import cpu_attention, cpu_fused_ops
from kernels.cpu_build import CpuKernelUnavailable, build_extension

NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
NO_BF16 = ["-mno-avx512bf16", *NO_AMX]


def _cpu_has_avx512_bf16() -> bool:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("flags"))  # fmt: skip
    except (OSError, StopIteration):
        return False
    return " avx512_bf16" in flags


pytestmark = pytest.mark.skipif(
    not _cpu_has_avx512_bf16(),
    reason="no AVX512-BF16 here: the kernels already run the fallback (tested everywhere else)",
)


@functools.cache
def _build(source: Path, flags: tuple[str, ...]):
    try:
        return build_extension(source.stem, [source], list(flags))
    except CpuKernelUnavailable as exc:
        pytest.skip(f"C++ kernels unavailable: {exc}")


def _pair(source: Path):
    """(with AVX512-BF16, without), both without AMX."""
    return _build(source, tuple(NO_AMX)), _build(source, tuple(NO_BF16))


@pytest.fixture(scope="module")
def fused():
    return _pair(cpu_fused_ops.SOURCE)


@pytest.fixture(scope="module")
def attention():
    return _pair(cpu_attention.SOURCE)


def _same_within_rounding(native: torch.Tensor, fallback: torch.Tensor) -> None:
    assert_close(fallback, native, torch.bfloat16)
    assert (fallback == native).float().mean() > 0.9


def test_the_builds_differ_as_intended(fused):
    native, fallback = fused
    assert native.has_int4_linear() and fallback.has_int4_linear()
    assert native.has_int8_rows_linear() and fallback.has_int8_rows_linear()
    assert not native.has_amx_linear() and not fallback.has_amx_linear()


# 3-4: the nibbles' products (tiles of 4); 5: two tiles; 13, 38 and 64: the dequantized pairs
# (without AVX512-BF16 float32 lanes, cpu_f32_tiles.h; 38: a last tile of 2 rows). Not 9-12:
# there only the native build dequantizes (to bfloat16 weights: another rounding, not only
# another order; the fallback keeps the nibbles up to 12 rows).
@pytest.mark.parametrize("rows", [3, 5, 13, 38, 64])
def test_int4_linear_matches_the_native_build(fused, rows):
    gen = torch.Generator().manual_seed(rows)
    packed, scale_and_zero, _ = int4_weight(192, 576, 64, gen)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    native, fallback = (m.int4_linear(x, packed, scale_and_zero, 64, 0) for m in fused)
    _same_within_rounding(native, fallback)


@pytest.mark.parametrize("rows", [1, 2])
def test_int4_linear_one_or_two_rows_take_float_lanes_without_bf16(fused, rows):
    """Without AVX512-BF16, 1-2 rows multiply float32 lanes made straight from the nibbles
    (cpu_int4_linear.h, block_rows_lanes): the same products summed in another order, so
    within the output's bfloat16 rounding of the pairs path, most elements bit-equal."""
    gen = torch.Generator().manual_seed(rows)
    packed, scale_and_zero, w = int4_weight(192, 576, 64, gen)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    native, fallback = (m.int4_linear(x, packed, scale_and_zero, 64, 0) for m in fused)
    _same_within_rounding(native, fallback)
    assert_close(fallback, (x.float() @ w.T).bfloat16(), torch.bfloat16)


# 1: the FMA kernel (no pairs); 5 and 17: dot products; 32, 64 and 100: x lanes (100: a
# partial x tile). Without AVX512-BF16 the FMA kernel up to 12 rows, then float32 blocks
# (cpu_int8_rows.h, linear_block_f32): the same products summed in other orders.
@pytest.mark.parametrize("rows", [1, 5, 17, 32, 64, 100])
def test_int8_linear_matches_the_native_build(fused, rows):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (192, 576), dtype=torch.int8, generator=gen)
    s = (torch.rand(192, generator=gen) * 0.02 + 0.001).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    native, fallback = (m.int8_linear(x, q, s, 0) for m in fused)
    _same_within_rounding(native, fallback)


# From 25 rows, without AVX512-BF16, blocks widened to float32 (cpu_f32_tiles.h); 26 and 38: a
# last pairs tile of 2 rows (two accumulator sets, as the pairs loop).
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 25, 26, 38, 64])
def test_packed_bf16_linear_matches_the_native_build(fused, rows):
    n, k = 192, 576
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=gen).bfloat16()
    # The packed layout: 64-row blocks, per input pair the rows' (w[n, 2p], w[n, 2p + 1]).
    pairs = w.view(n // 64, 64, k // 2, 2).transpose(1, 2).contiguous()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    native, fallback = (m.packed_bf16_linear(x, pairs.data_ptr(), n, k) for m in fused)
    _same_within_rounding(native, fallback)


@pytest.mark.parametrize("q_len", [1, 3])  # decode rows (cpu_decode_bf16.h); generic scores
def test_attention_matches_the_native_build(attention, q_len):
    heads, kv_heads, dim, block, blocks = 9, 3, 64, 16, 96
    gen = torch.Generator().manual_seed(q_len)
    seq_lens = torch.tensor([1, 40, 130, 300], dtype=torch.int32)
    batch = len(seq_lens)
    k = torch.randn(blocks, block, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(blocks, block, kv_heads, dim, generator=gen).bfloat16()
    tables = torch.randperm(blocks, generator=gen)[: batch * 19].view(batch, 19).int()
    q = torch.randn(batch * q_len, heads, dim, generator=gen).bfloat16()
    starts = torch.arange(batch + 1, dtype=torch.int32) * q_len
    seq_lens = torch.maximum(seq_lens, torch.tensor(q_len, dtype=torch.int32))
    outs = []
    for module in attention:
        out = torch.empty_like(q)
        module.paged_attention(out, q, k, v, tables, seq_lens, starts, dim**-0.5, None, None)
        outs.append(out)
    assert_close(outs[1], outs[0], torch.bfloat16)
