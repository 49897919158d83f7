"""Weight formats: quantize at load, pack, unpack, and the float32 reference dequantization.

int8 (W8A16): one symmetric scale per output channel, w ~= q * s, q in [-127, 127].
int4: one scale and one integer zero point per group of G input features, asymmetric
round-to-nearest (no calibration), w ~= (q - z) * s, q and z in [0, 15].

The modules that hold these weights at run time are in linear.py; the packed int4 layout is
kernels/int4_pack.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127  # symmetric: -128 is left out so that q and -q are both representable


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]: w[n, :] ~= qweight[n, :] * scales[n]


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor  # uint8 [N, K] in [0, 15] (unpacked)
    scales: torch.Tensor  # float32 [N, K / G]
    zeros: torch.Tensor  # uint8 [N, K / G] in [0, 15]: w ~= (q - zero) * scale
    group_size: int  # G: input features per scale/zero pair


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Per-output-channel symmetric: s = max|w[n, :]| / 127 (in float32)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX  # an all-zero row keeps s > 0
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scales)


def dequantize_int8(w: Int8Weight) -> torch.Tensor:
    """The float32 reference: q * s."""
    return w.qweight.float() * w.scales[:, None]


def check_int4_shape(out_features: int, in_features: int, group_size: int, name: str) -> None:
    """ValueError naming the field when a layer cannot take int4 at this group size."""
    if in_features % group_size:
        raise ValueError(
            f"quantization_group_size: {group_size} does not divide {name}'s in_features "
            f"{in_features}; choose a group size that does (32 or 64 for SmolLM2's 576)"
        )
    if out_features % 16:  # the CPU kernel's rule; the packed tail needs pairs of rows anyway
        raise ValueError(
            f"quantization: {name}'s out_features {out_features} is not a multiple of 16"
        )


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Group-wise asymmetric round-to-nearest: per group, s = (max - min) / 15 and the integer
    zero z = round(-min / s), so the group's range maps onto [0, 15] with 0.0 exactly
    representable (q = z)."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    w_min = w.amin(dim=-1).clamp(max=0.0)  # the range includes 0: zero padding stays exact
    w_max = w.amax(dim=-1).clamp(min=0.0)
    scales = ((w_max - w_min) / 15).clamp(min=1e-12)
    zeros = torch.round(-w_min / scales).clamp(0, 15)
    q = torch.round(w / scales[..., None]) + zeros[..., None]
    q = q.clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Weight(q, scales, zeros.to(torch.uint8), group_size)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The float32 reference: (q - z) * s per group."""
    n, k = w.qweight.shape
    g = w.group_size
    q = w.qweight.float().view(n, k // g, g)
    return ((q - w.zeros.float()[..., None]) * w.scales[..., None]).view(n, k)
