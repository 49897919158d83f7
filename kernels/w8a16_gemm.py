"""w8a16_gemm: y = (x @ Q.T) * s with Q int8 [N, K] and one scale per output row (the int8
weight-only format of engine/runner/quant: per-output-channel symmetric), for CUDA.

One program computes a [BLOCK_M, BLOCK_N] tile of y. Per K tile it loads Q's [BLOCK_N, BLOCK_K]
int8 bytes (1 byte per weight crosses memory instead of 2), converts them to x's dtype in
registers (exact: |q| <= 127) and feeds tl.dot with float32 accumulation; the row scales
multiply the tile once at the end, since they are constant along K. Split-K as in
kernels/w4a16_gemm.py: few rows leave SMs idle, so partial tiles add into a float32 output.

Tested under TRITON_INTERPRET=1; on CUDA the engine calls it below CUDA_DEQUANT_MIN_ROWS rows.
"""

import torch
import triton
import triton.language as tl

from kernels.w4a16_gemm import plan_split_k
from kernels.weight_only_launch import BLOCK_M, WeightOnlyLaunch, weight_only_launch


# M is not specialized: decode steps of 1 row and of many share one compiled kernel.
@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr,  # [M, K], row-major
    q_ptr,  # int8 [N, K], row-major
    s_ptr,  # [N]
    y_ptr,  # [M, N], row-major (float32 and zeroed when SPLIT_K > 1)
    M,
    N,
    K,
    K_PER_SPLIT,  # inputs per split-K program: a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows_m[:, None].to(tl.int64) * K + ks[None, :],
            mask=(rows_m[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        q = tl.load(
            q_ptr + cols_n[None, :].to(tl.int64) * K + ks[:, None],  # [BLOCK_K, BLOCK_N]
            mask=(cols_n[None, :] < N) & (ks[:, None] < K),
            other=0,
        )
        acc += tl.dot(x, q.to(x.dtype), input_precision="ieee")  # float32 x: no TF32
    acc *= tl.load(s_ptr + cols_n, mask=cols_n < N, other=0.0).to(tl.float32)[None, :]
    y_offsets = rows_m[:, None].to(tl.int64) * N + cols_n[None, :]
    mask = (rows_m[:, None] < M) & (cols_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptr + y_offsets, acc, mask=mask)


def w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    split_k: int | None = None,
    launch: WeightOnlyLaunch | None = None,
) -> torch.Tensor:
    """x [M, K] @ int8 weight [N, K] with per-row scales [N] -> [M, N] in x's dtype (the CPU
    kernel's signature: kernels/weight_only_cpu.int8_weight_only_mm). split_k: None = from the
    GPU's SM count (1 on CPU, the interpreter). launch: None = weight_only_launch("w8a16")."""
    assert x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [M, K], got {tuple(x.shape)}"
    m, k = x.shape
    assert qweight.dtype == torch.int8 and qweight.dim() == 2 and qweight.is_contiguous(), (
        "qweight must be contiguous int8 [N, K]"
    )
    n = qweight.shape[0]
    assert qweight.shape[1] == k, f"K differs: x {k}, qweight {qweight.shape[1]}"
    assert scales.shape == (n,), f"scales must be [N], got {tuple(scales.shape)}"
    assert qweight.device == x.device == scales.device
    if launch is None:
        launch = weight_only_launch("w8a16", m, n, k)
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, launch.block_n)
    split_k, k_per_split, y = plan_split_k(x, n, tiles, launch.block_k, split_k)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, launch.block_n), split_k)
    _w8a16_kernel[grid](
        x, qweight, scales, y, m, n, k, k_per_split,
        BLOCK_M=BLOCK_M, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SPLIT_K=split_k,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return y if split_k == 1 else y.to(x.dtype)
