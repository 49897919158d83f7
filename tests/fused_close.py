"""The tolerance of the fused per-layer ops (C++ on CPU, Triton) against layer_ops.TorchOps,
shared by their tests: float32 differs by summation order only; 16-bit results round to the
same value or a neighbour (sums of squares added in another order, RoPE tables in float32).
Also the random int4 weight that the int4 kernels' tests share."""

from __future__ import annotations

import torch

from kernels.int4_pack import pack_int4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= TOLERANCE[dtype] * max(scale, 1.0), f"max error {err}, scale {scale}"


def int4_weight(n: int, k: int, group: int, gen: torch.Generator):
    """A random int4 weight in kernels/int4_pack.py's layout: (packed, scale_and_zero
    [K/G, N, 2] bfloat16 (s, zf), w float32 [N, K] = (q - 8) s + zf from those bfloat16 values)."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    s = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    zf = torch.randn(k // group, n, generator=gen) * 0.05
    scale_and_zero = torch.stack([s, zf], dim=-1).bfloat16().contiguous()
    params = scale_and_zero.float()
    w = (q.float().view(n, k // group, group) - 8) * params[..., 0].t()[..., None]
    w = (w + params[..., 1].t()[..., None]).view(n, k)  # (q - 8) * s + zf, in float32
    return pack_int4(q), scale_and_zero, w
