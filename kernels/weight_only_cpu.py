"""Weight-only matmuls on CPU from stock torch: checked wrappers and float32 references.

    int8:  y = x @ (q * s[:, None]).T               q int8 [N, K], s [N]          (W8A16)
    int4:  y = x @ ((q - 8) * s + zf).T per group   q in [0, 15], packed [N, K/2],
                                                    s and zf [K/G, N] (zf = (8 - z) * s)

The kernels (`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`) read the weight
in its small format and convert in registers, so a matrix-vector product moves 1 or 0.5 bytes
per weight instead of 2: much faster at a few rows, slower than a 16-bit GEMM at many rows (the
engine dispatches by rows: engine/runner/quant/linear.py).
"""

import torch

from kernels.int4_pack import unpack_int4

INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts


def int8_weight_only_mm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ int8 weight [N, K] with per-row scales [N] -> [M, N]."""
    assert x.device.type == "cpu", f"CPU kernel, x is on {x.device}"
    assert x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [M, K], got {tuple(x.shape)}"
    assert qweight.dtype == torch.int8 and qweight.dim() == 2, "qweight must be int8 [N, K]"
    assert qweight.shape[1] == x.shape[1], f"K differs: x {x.shape[1]}, qweight {qweight.shape[1]}"
    assert scales.shape == (qweight.shape[0],), f"scales must be [N], got {tuple(scales.shape)}"
    assert scales.dtype == x.dtype, f"scales {scales.dtype} must match x {x.dtype}"
    return torch._weight_int8pack_mm(x, qweight, scales)


def int8_weight_only_mm_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """float32 [M, N]."""
    return x.float() @ (qweight.float() * scales.float()[:, None]).t()


def int4_weight_only_mm(
    x: torch.Tensor, packed: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ packed int4 weight [N, K/2] (kernels/int4_pack.py layout) with per-group
    scale_and_zero [K/G, N, 2] = (s, zf) in x's dtype -> [M, N]."""
    assert x.device.type == "cpu", f"CPU kernel, x is on {x.device}"
    assert x.dim() == 2 and x.is_contiguous(), f"x must be contiguous [M, K], got {tuple(x.shape)}"
    n, k = packed.shape[0], packed.shape[1] * 2
    assert packed.dtype == torch.uint8 and packed.dim() == 2, "packed must be uint8 [N, K/2]"
    assert x.shape[1] == k, f"K differs: x {x.shape[1]}, packed weight {k}"
    assert n % 16 == 0, f"the kernel needs N % 16 == 0, got N = {n}"
    assert group_size in INT4_KERNEL_GROUP_SIZES and k % group_size == 0, (
        f"group size {group_size} must be in {INT4_KERNEL_GROUP_SIZES} and divide K = {k}"
    )
    assert scale_and_zero.shape == (k // group_size, n, 2), (
        f"scale_and_zero must be [K/G, N, 2] = {(k // group_size, n, 2)}, "
        f"got {tuple(scale_and_zero.shape)}"
    )
    assert scale_and_zero.dtype == x.dtype and scale_and_zero.is_contiguous()
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zero)


def int4_weight_only_mm_ref(
    x: torch.Tensor, packed: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 [M, N], from the unpacked nibbles."""
    q = unpack_int4(packed).float()  # [N, K]
    n, k = q.shape
    s = scale_and_zero[..., 0].float().t()  # [N, K/G]
    zf = scale_and_zero[..., 1].float().t()
    w = (q.view(n, k // group_size, group_size) - 8) * s[..., None] + zf[..., None]
    return x.float() @ w.view(n, k).t()
