"""The packed int4 weight layout: two 4-bit values per byte, as aten's
`_convert_weight_to_int4pack_for_cpu` lays them out on AVX-512 CPUs.

The CPU weight-only kernel reads these bytes directly; every other path (dequantization into a
16-bit scratch, a GPU) unpacks the same bytes, so a model holds one copy of its int4 weights.
Layout of a weight [N, K]: blocks of 64 output rows, one after the other; inside a block, for
each input feature k, 32 bytes whose low nibbles are the block's rows 0..31 and whose high
nibbles are rows 32..63. A tail of N % 64 rows (a multiple of 16) follows: per k, rows
(2i, 2i + 1) are the (low, high) nibbles of one byte. Other CPUs (AVX2) pack differently: the
engine checks aten's packing against pack_int4 before it uses the kernel.
"""

import torch

INT4_BLOCK_ROWS = 64  # output rows per block of the packed layout


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in [0, 15] -> uint8 [N, K / 2] in the CPU kernel's layout (module doc)."""
    n, k = q.shape
    full = n // INT4_BLOCK_ROWS * INT4_BLOCK_ROWS
    parts = []
    if full:
        # [blocks, 64, K] -> [blocks, K, 64]: rows 0..31 low nibbles, rows 32..63 high.
        b = q[:full].view(full // INT4_BLOCK_ROWS, INT4_BLOCK_ROWS, k).transpose(1, 2)
        parts.append((b[..., :32] | (b[..., 32:] << 4)).reshape(-1))
    if n > full:
        t = q[full:].t()  # [K, tail]: rows (2i, 2i+1) share a byte
        parts.append((t[:, 0::2] | (t[:, 1::2] << 4)).reshape(-1))
    return torch.cat(parts).view(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, K / 2] -> uint8 [N, K] in [0, 15]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    full = n // INT4_BLOCK_ROWS * INT4_BLOCK_ROWS
    parts = []
    if full:
        b = flat[: full * k // 2].view(full // INT4_BLOCK_ROWS, k, 32)
        q = torch.cat([b & 15, b >> 4], dim=-1)  # [blocks, K, 64]
        parts.append(q.transpose(1, 2).reshape(full, k))
    if n > full:
        b = flat[full * k // 2 :].view(k, (n - full) // 2)
        parts.append(torch.stack([b & 15, b >> 4], dim=-1).view(k, n - full).t())
    return torch.cat(parts)
