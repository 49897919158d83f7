"""kernels/w4a16_gemm.py and w8a16_gemm.py under TRITON_INTERPRET=1: the Triton weight-only
GEMMs against the float32 references of the same stored weights
(kernels/weight_only_cpu.int4_weight_only_mm_ref, int8_weight_only_mm_ref), with and without
split-K, and the quantized layers calling them (what they do on CUDA).
Tolerance: float32 accumulation in both, so only summation order and the output rounding
differ: 1e-4 of the largest |output| in float32, 1e-2 in float16."""

from __future__ import annotations

import pytest
import torch

from engine.runner.quant.formats import quantize_int4, quantize_int8
from engine.runner.quant.linear import DequantScratch, Int4Linear, Int8Linear
from kernels.w4a16_gemm import split_k_for, w4a16_gemm
from kernels.w8a16_gemm import w8a16_gemm
from kernels.weight_only_cpu import int4_weight_only_mm_ref, int8_weight_only_mm_ref
from kernels.weight_only_launch import WeightOnlyLaunch, launch_candidates, weight_only_launch

RTOL_OF_MAX = {torch.float32: 1e-4, torch.float16: 1e-2}


def assert_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.float() - ref).abs().max().item()
    assert err <= RTOL_OF_MAX[dtype] * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_rows", "group_size"), [(1, 32), (5, 64), (17, 128)])
def test_w4a16_gemm_matches_reference(dtype, num_rows, group_size):
    gen = torch.Generator().manual_seed(num_rows)
    w = torch.randn(128, 256, generator=gen)
    layer = Int4Linear(
        quantize_int4(w, group_size), None, dtype, DequantScratch(1, dtype, "cpu"), 0
    )
    x = torch.randn(num_rows, 256, generator=gen).to(dtype)
    args = (layer.packed, layer.scale_and_zero, group_size)
    y = w4a16_gemm(x, *args)
    ref = int4_weight_only_mm_ref(x, *args)
    assert y.dtype == dtype and y.shape == (num_rows, 128)
    err = (y.float() - ref).abs().max().item()
    assert err <= RTOL_OF_MAX[dtype] * ref.abs().max().item(), err


@pytest.mark.parametrize("split_k", [2, 4, 8])
def test_w4a16_split_k_matches_reference(split_k):
    """K = 256 in 32-input tiles: splits of 128, 64, 32 inputs add into a float32 output."""
    gen = torch.Generator().manual_seed(split_k)
    layer = Int4Linear(quantize_int4(torch.randn(128, 256, generator=gen), 32), None,
                       torch.float16, DequantScratch(1, torch.float16, "cpu"), 0)  # fmt: skip
    x = torch.randn(3, 256, generator=gen).to(torch.float16)
    args = (layer.packed, layer.scale_and_zero, 32)
    ref = int4_weight_only_mm_ref(x, *args)
    assert_close(w4a16_gemm(x, *args, split_k=split_k), ref, torch.float16)


@pytest.mark.parametrize(
    "launch",
    [WeightOnlyLaunch(128, 64, 8, 4), WeightOnlyLaunch(256, 32, 4, 3)],
    ids=str,
)
@pytest.mark.parametrize("split_k", [1, 2])
def test_w4a16_wide_tiles_match_reference(launch, split_k):
    """Tiles of several packed blocks (N = 192: the last 128- or 256-row tile is partly past N,
    masked) and K tiles of 32 or 64 inside a 64-input group."""
    gen = torch.Generator().manual_seed(launch.block_n + split_k)
    layer = Int4Linear(quantize_int4(torch.randn(192, 256, generator=gen), 64), None,
                       torch.float16, DequantScratch(1, torch.float16, "cpu"), 0)  # fmt: skip
    x = torch.randn(3, 256, generator=gen).to(torch.float16)
    args = (layer.packed, layer.scale_and_zero, 64)
    y = w4a16_gemm(x, *args, split_k=split_k, launch=launch)
    assert_close(y, int4_weight_only_mm_ref(x, *args), torch.float16)


def test_w4a16_refuses_a_k_tile_that_straddles_groups():
    layer = Int4Linear(quantize_int4(torch.randn(64, 128), 32), None, torch.float32,
                       DequantScratch(1, torch.float32, "cpu"), 0)  # fmt: skip
    with pytest.raises(AssertionError, match="BLOCK_K divide group 32"):
        w4a16_gemm(torch.randn(1, 128), layer.packed, layer.scale_and_zero, 32,
                   launch=WeightOnlyLaunch(64, 64, 4, 3))  # fmt: skip


def test_launch_candidates_respect_the_group():
    assert {c.block_k for c in launch_candidates("w4a16", 64)} == {32, 64}
    assert {c.block_k for c in launch_candidates("w4a16", 128)} == {32, 64, 128}
    assert {c.block_k for c in launch_candidates("w8a16")} == {64, 128, 256}


def test_launch_picks_follow_size_rows_and_group():
    small, large = (576, 576), (28672, 4096)
    assert weight_only_launch("w4a16", 1, *large, 64) == WeightOnlyLaunch(128, 64, 4, 3)
    assert weight_only_launch("w4a16", 1, *large, 32).block_k == 32  # never straddles a group
    assert weight_only_launch("w4a16", 16, *small, 64) == WeightOnlyLaunch(64, 32, 8, 4)
    assert weight_only_launch("w4a16", 17, *small, 64) == WeightOnlyLaunch(64, 64, 4, 3)
    assert weight_only_launch("w8a16", 64, *large) == WeightOnlyLaunch(64, 128, 4, 4)
    with pytest.raises(ValueError, match="unknown weight-only kernel"):
        weight_only_launch("w2a16", 1, *small)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_rows", "n", "k", "split_k"),
                         [(1, 64, 128, 1), (5, 100, 200, 2), (17, 70, 300, 3), (2, 130, 64, 1)])  # fmt: skip
def test_w8a16_gemm_matches_reference(dtype, num_rows, n, k, split_k):
    """Ragged N and K (masked tiles); split 3 of K = 300 rounds to two 192-input splits."""
    gen = torch.Generator().manual_seed(num_rows * n)
    w = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    scales = w.scales.to(dtype)
    y = w8a16_gemm(x, w.qweight.contiguous(), scales, split_k=split_k)
    assert_close(y, int8_weight_only_mm_ref(x, w.qweight, scales), dtype)
    wide = w8a16_gemm(x, w.qweight.contiguous(), scales, split_k, WeightOnlyLaunch(128, 32, 8, 4))
    assert_close(wide, int8_weight_only_mm_ref(x, w.qweight, scales), dtype)


def test_split_k_fills_the_sms_without_tiny_splits():
    assert split_k_for(num_tiles=200, k=4096, block_k=32, num_sms=132) == 1  # already full
    assert split_k_for(num_tiles=9, k=576, block_k=32, num_sms=132) == 4  # 18 K tiles: 4.5 a split
    assert split_k_for(num_tiles=9, k=8192, block_k=32, num_sms=132) == 16  # <= 264 programs
    assert split_k_for(num_tiles=1, k=4096, block_k=32, num_sms=1) == 1  # CPU: no split


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_layers_call_the_triton_kernels_below_the_row_threshold(kind, monkeypatch):
    """What a quantized layer does on CUDA (weight_only_kernel "triton"), here under the
    interpreter: few rows take the Triton kernel, many rows dequantize; both match W."""
    import kernels.w4a16_gemm as w4
    import kernels.w8a16_gemm as w8

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=gen)
    scratch = DequantScratch(128 * 256, torch.float32, "cpu")
    if kind == "int8":
        layer = Int8Linear(quantize_int8(w), None, torch.float32, scratch, 4)
        module, name = w8, "w8a16_gemm"
    else:
        layer = Int4Linear(quantize_int4(w, 64), None, torch.float32, scratch, 4)
        module, name = w4, "w4a16_gemm"
    assert layer.weight_only_kernel == "cpu"  # chosen from the scratch's device
    layer.weight_only_kernel = "triton"
    calls = []
    kernel = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    ref_w = layer.dequantized_weight()
    for rows, kernel_calls in ((3, 1), (6, 1)):  # 3 < 4: the kernel; 6: dequantize + GEMM
        x = torch.randn(rows, 256, generator=gen)
        assert_close(layer(x), x @ ref_w.t(), torch.float32)
        assert len(calls) == kernel_calls


def test_int4_layer_with_a_packed_tail_dequantizes_on_the_triton_path():
    layer = Int4Linear(quantize_int4(torch.randn(80, 64), 32), None, torch.float32,
                       DequantScratch(80 * 64, torch.float32, "cpu"), 8)  # fmt: skip
    layer.weight_only_kernel = "triton"  # 80 rows: 64 + a tail of 16, which the kernel lacks
    x = torch.randn(2, 64)
    assert_close(layer(x), x @ layer.dequantized_weight().t(), torch.float32)


def test_w4a16_gemm_checks_its_inputs():
    layer = Int4Linear(quantize_int4(torch.randn(80, 64), 32), None, torch.float32,
                       DequantScratch(1, torch.float32, "cpu"), 0)  # fmt: skip
    with pytest.raises(AssertionError, match="multiple of 64"):  # 80 rows: a packed tail
        w4a16_gemm(torch.randn(2, 64), layer.packed, layer.scale_and_zero, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_rows", [1, 64, 300])
def test_w4a16_gemm_on_cuda_matches_reference(num_rows):
    """bfloat16 on the GPU (tensor-core tl.dot): 2e-2 of the largest |output|."""
    gen = torch.Generator().manual_seed(num_rows)
    w = torch.randn(960, 576, generator=gen)
    dtype = torch.bfloat16
    layer = Int4Linear(quantize_int4(w, 64), None, dtype, DequantScratch(1, dtype, "cpu"), 0)
    x = torch.randn(num_rows, 576, generator=gen).to(dtype)
    args = (layer.packed.cuda(), layer.scale_and_zero.cuda(), 64)
    y = w4a16_gemm(x.cuda(), *args).cpu()  # split-K from the SM count at few rows
    ref = int4_weight_only_mm_ref(x, layer.packed, layer.scale_and_zero, 64)
    assert (y.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_rows", [1, 64, 300])
def test_w8a16_gemm_on_cuda_matches_reference(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    w = quantize_int8(torch.randn(960, 576, generator=gen))
    x = torch.randn(num_rows, 576, generator=gen).to(torch.bfloat16)
    scales = w.scales.to(torch.bfloat16)
    y = w8a16_gemm(x.cuda(), w.qweight.cuda(), scales.cuda()).cpu()
    ref = int8_weight_only_mm_ref(x, w.qweight, scales)
    assert (y.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
