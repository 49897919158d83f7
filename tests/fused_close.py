"""The tolerance of the fused per-layer ops (C++ on CPU, Triton) against layer_ops.TorchOps,
shared by their tests: float32 differs by summation order only; 16-bit results round to the
same value or a neighbour (sums of squares added in another order, RoPE tables in float32)."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= TOLERANCE[dtype] * max(scale, 1.0), f"max error {err}, scale {scale}"
