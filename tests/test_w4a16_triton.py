"""kernels/w4a16_gemm.py under TRITON_INTERPRET=1: the Triton W4A16 dequant-GEMM against the
float32 reference of the same packed weight (kernels/weight_only_cpu.int4_weight_only_mm_ref).
Tolerance: float32 accumulation in both, so only summation order and the output rounding
differ: 1e-4 of the largest |output| in float32, 1e-2 in float16."""

from __future__ import annotations

import pytest
import torch

from engine.runner.quant.formats import quantize_int4
from engine.runner.quant.linear import DequantScratch, Int4Linear
from kernels.w4a16_gemm import w4a16_gemm
from kernels.weight_only_cpu import int4_weight_only_mm_ref

RTOL_OF_MAX = {torch.float32: 1e-4, torch.float16: 1e-2}


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
    y = w4a16_gemm(x.cuda(), *args).cpu()
    ref = int4_weight_only_mm_ref(x, layer.packed, layer.scale_and_zero, 64)
    assert (y.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
