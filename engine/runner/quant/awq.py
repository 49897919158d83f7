"""AutoAWQ checkpoints (GEMM version): read their packed int4 tensors into our Int4Weight.

Per linear layer with in_features K, out_features N and group size G, AutoAWQ stores
    qweight  int32 [K, N / 8]     eight 4-bit values per int32, columns in AWQ's order
    qzeros   int32 [K / G, N / 8] the integer zero points, packed the same way
    scales   fp16  [K / G, N]
with w[n, k] = (q - z) * s, the convention of formats.quantize_int4. Inside an int32, nibble i
(bits 4i..4i+3) holds column 8c + AWQ_ORDER[i] (AutoAWQ's WQLinear_GEMM.from_linear packs
columns 0, 2, 4, 6, 1, 3, 5, 7). AWQ folds its activation scales into the preceding RMSNorm
weights, so those come from the checkpoint like any other tensor; embeddings and the LM head
are not quantized by AutoAWQ and load as 16-bit.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runner.quant.formats import Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its group of 8
AWQ_GROUP_SIZES = (32, 64, 128)


def check_awq_config(quant_config: dict[str, Any] | None, folder: str) -> int:
    """The group size of an AutoAWQ GEMM checkpoint's quantization_config; ValueError naming
    the field otherwise."""
    if not quant_config or quant_config.get("quant_method") != "awq":
        raise ValueError(
            f"quantization: 'awq' needs an AutoAWQ checkpoint folder (config.json with "
            f"quantization_config.quant_method = 'awq'); {folder} has none"
        )
    expected = {"bits": 4, "version": "gemm", "zero_point": True}
    for field, want in expected.items():
        got = quant_config.get(field)
        if field == "version" and isinstance(got, str):
            got = got.lower()
        if got != want:
            raise ValueError(f"quantization_config.{field}: must be {want!r} for AWQ, got {got!r}")
    group_size = quant_config.get("group_size")
    if group_size not in AWQ_GROUP_SIZES:
        raise ValueError(
            f"quantization_config.group_size: must be one of {AWQ_GROUP_SIZES}, got {group_size!r}"
        )
    return group_size


def unpack_awq_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> uint8 [R, C] in column order (AWQ_ORDER undone)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed[..., None] >> shifts) & 15  # [R, C/8, 8] in nibble order
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles  # nibble i -> column AWQ_ORDER[i]
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_awq_int32(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] in [0, 15] -> int32 [R, C / 8], as AutoAWQ packs (tests, tools)."""
    rows, cols = values.shape
    grouped = values.to(torch.int32).view(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int32, device=values.device)
    for i, column in enumerate(AWQ_ORDER):
        packed |= grouped[..., column] << (4 * i)
    return packed


def awq_to_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, name: str
) -> Int4Weight:
    """One AutoAWQ linear -> Int4Weight (q [N, K], scales and zeros [N, K / G])."""
    k = qweight.shape[0]
    n = qweight.shape[1] * 8
    shapes = {"qweight": (qweight, (k, n // 8)), "qzeros": (qzeros, (k // group_size, n // 8)),
              "scales": (scales, (k // group_size, n))}  # fmt: skip
    for tensor_name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"model: {name}.{tensor_name} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(group size {group_size})"
            )
    q = unpack_awq_int32(qweight).t().contiguous()  # [N, K]
    zeros = unpack_awq_int32(qzeros).t().contiguous()  # [N, K/G]
    return Int4Weight(q, scales.float().t().contiguous(), zeros, group_size)
