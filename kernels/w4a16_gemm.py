"""w4a16_gemm: y = x @ W.T with W int4 in the packed layout of kernels/int4_pack.py, dequantized
tile by tile in registers and accumulated in float32 (a GPU's answer to the CPU weight-only
kernel: the weight crosses memory at 0.5 byte per value plus its group scales).

One program computes a [BLOCK_M, BLOCK_N] tile of y: BLOCK_N / 64 packed blocks of 64 output
rows. Per K tile (BLOCK_K inputs, inside one quantization group) it loads each block's bytes
[BLOCK_K, 32] twice, as the low nibbles (rows 0..31) and the high nibbles (rows 32..63),
applies w = (q - 8) * s + zf with the group's (s, zf) per row, and feeds tl.dot.
Requires N % 64 == 0 (no packed tail; a last partial BLOCK_N tile is masked) and BLOCK_K
dividing the group size. The tile and pipeline sizes are a WeightOnlyLaunch (weight_only_launch
picks one); the bytes a program keeps in flight are what a memory-bound GEMM at few rows needs.

Split-K: a decode step has few rows, so (M / 16) x (N / 64) programs can leave most of a GPU's
SMs idle (SmolLM2's o_proj at M = 1: 9 programs for 132 SMs). With split_k > 1 each program
covers K / split_k inputs and adds its partial tile into a float32 output with atomic adds;
the caller casts it to x's dtype. split_k_for() picks it from the SM count.

Tested under TRITON_INTERPRET=1; on CUDA the engine calls it for quantized layers below
CUDA_DEQUANT_MIN_ROWS rows (engine/runner/quant/apply.py), the dequantize + GEMM path above.
"""

import torch
import triton
import triton.language as tl

from kernels.int4_pack import INT4_BLOCK_ROWS
from kernels.weight_only_launch import BLOCK_M, WeightOnlyLaunch, weight_only_launch


# M is not specialized: decode steps of 1 row and of many share one compiled kernel.
@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr,  # [M, K], row-major
    packed_ptr,  # uint8, N * K / 2 bytes: [N / 64, K, 32]
    sz_ptr,  # [K / G, N, 2]: (scale, float zero)
    y_ptr,  # [M, N], row-major
    M,
    N,
    K,
    K_PER_SPLIT,  # inputs per split-K program: a multiple of BLOCK_K
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of 64: whole packed blocks
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    rows_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows
    k_start = tl.program_id(2) * K_PER_SPLIT
    n_ok = n < N  # a last tile may pass N by whole blocks
    block = (n // 64).to(tl.int64)  # each output row's packed block
    byte = n % 32
    shift = ((n % 64) // 32) * 4  # low nibble for rows 0..31 of a block, high for 32..63
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows_m[:, None].to(tl.int64) * K + ks[None, :],
            mask=rows_m[:, None] < M,
            other=0.0,
        )
        offsets = (block[None, :] * K + ks[:, None]) * 32 + byte[None, :]
        packed = tl.load(packed_ptr + offsets, mask=n_ok[None, :], other=0).to(tl.int32)
        q = (packed >> shift[None, :]) & 15  # [BLOCK_K, BLOCK_N]
        group = k0 // GROUP_SIZE
        s = tl.load(sz_ptr + (group * N + n) * 2, mask=n_ok, other=0.0).to(tl.float32)
        zf = tl.load(sz_ptr + (group * N + n) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - 8.0) * s[None, :] + zf[None, :]  # [BLOCK_K, BLOCK_N]
        # 16-bit operands (tensor cores), float32 accumulation; float32 operands stay float32
        # (no TF32 rounding: a float32 model is the parity reference).
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    y_offsets = rows_m[:, None].to(tl.int64) * N + n[None, :]
    mask = (rows_m[:, None] < M) & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # y is float32, zeroed: the splits' partial sums meet there
        tl.atomic_add(y_ptr + y_offsets, acc, mask=mask)


def w4a16_supports(n: int, group_size: int) -> bool:
    """Whether the kernel takes a weight of N rows in groups of group_size: whole packed blocks
    (no tail) and K tiles that never straddle a group (the smallest K tile, 32, divides it)."""
    return n % INT4_BLOCK_ROWS == 0 and group_size % 32 == 0


def split_k_for(num_tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """Splits of K (a power of two): doubled while the programs stay within twice the SM count
    and each split keeps at least 4 K tiles (shorter splits spend more on atomic adds and the
    float32 output than they gain in parallelism)."""
    split = 1
    if num_sms <= 1:  # not a GPU (the interpreter): nothing to fill
        return split
    while num_tiles * split * 2 <= 2 * num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


def w4a16_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_and_zero: torch.Tensor,
    group_size: int,
    split_k: int | None = None,
    launch: WeightOnlyLaunch | None = None,
) -> torch.Tensor:
    """x [M, K] @ packed int4 W [N, K/2] with scale_and_zero [K/G, N, 2] -> [M, N] in x's
    dtype (the CPU kernel's signature: kernels/weight_only_cpu.int4_weight_only_mm).
    split_k: None = split_k_for() on a GPU's SM count (1 on CPU, the interpreter).
    launch: None = weight_only_launch("w4a16", ...) for this shape."""
    assert x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [M, K], got {tuple(x.shape)}"
    m, k = x.shape
    n = packed.shape[0]
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2), (
        f"packed must be uint8 [N, K/2] = [{n}, {k // 2}], got {tuple(packed.shape)}"
    )
    assert packed.is_contiguous() and packed.device == x.device
    assert n % INT4_BLOCK_ROWS == 0, f"N must be a multiple of 64 (no packed tail), got {n}"
    assert group_size % 32 == 0 and k % group_size == 0, (
        f"group size {group_size} must be a multiple of 32 and divide K = {k}"
    )
    assert scale_and_zero.shape == (k // group_size, n, 2) and scale_and_zero.is_contiguous()
    if launch is None:
        launch = weight_only_launch("w4a16", m, n, k, group_size)
    assert launch.block_n % INT4_BLOCK_ROWS == 0 and group_size % launch.block_k == 0, (
        f"{launch}: BLOCK_N must be whole packed blocks and BLOCK_K divide group {group_size}"
    )
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, launch.block_n)
    # A K tile never straddles a group: BLOCK_K divides G, and splits are whole K tiles.
    split_k, k_per_split, y = plan_split_k(x, n, tiles, launch.block_k, split_k)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, launch.block_n), split_k)
    _w4a16_kernel[grid](
        x, packed, scale_and_zero, y, m, n, k, k_per_split,
        GROUP_SIZE=group_size, BLOCK_M=BLOCK_M, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        SPLIT_K=split_k, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return y if split_k == 1 else y.to(x.dtype)


def plan_split_k(
    x: torch.Tensor, n: int, num_tiles: int, block_k: int, split_k: int | None
) -> tuple[int, int, torch.Tensor]:
    """(splits, inputs per split (whole K tiles), the output [M, N]) for a weight-only GEMM of
    x [M, K]: x's dtype with one split, float32 zeros that the splits add into otherwise."""
    m, k = x.shape
    if split_k is None:
        split_k = split_k_for(num_tiles, k, block_k, num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k == 1:
        return split_k, k_per_split, torch.empty(m, n, dtype=x.dtype, device=x.device)
    return split_k, k_per_split, torch.zeros(m, n, dtype=torch.float32, device=x.device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (no split-K on CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
