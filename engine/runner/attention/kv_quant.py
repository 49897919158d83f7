"""KV-cache quantization (EngineConfig.kv_cache_dtype): storage formats, scales, and the torch
quantize / dequantize the torch backend uses (the Triton kernels do the same math in kernels/).

- "int8": symmetric, one scale per token and KV head: scale = max|x| / 127 over the head's
  head_dim elements, rounded to float16 first (the stored value), q = round(x / scale) in
  [-127, 127]. The scales live in a tensor laid out like the cache without head_dim, indexed by
  the same slot, so a block's scales belong to the block: prefix-cache sharing and preemption
  move block ids, never data, and the scales go with them. 2 bytes of scale per 64 int8 values
  (head_dim 64) cost 3% of the pool.
- "fp8": float8_e4m3fn storing clamp(x / scale, -448, 448) with one K and one V scale per
  layer (EngineConfig.calculate_kv_scales, kv_scale_granularity):
  - fixed (the default): every scale 1.0. e4m3 is a float, so its relative precision (3
    mantissa bits) is the same from 2^-6 to 448 and a scale only matters for values outside
    that range. SmolLM2's K/V stay inside it (max |K| 25.5, |V| 15.3 over a 3k-token prompt
    and two short ones, bf16), so 1.0 clamps nothing.
  - calculated: each layer's scale is max(amax / 448, 2^-14) over the K (or V) of the first
    batch the layer stores (padding slots excluded), as vLLM's calculate_kv_scales. "tensor"
    takes one amax per layer, "head" one per KV head. Then frozen: the blocks already written
    with a scale are read with it forever (prefix hits, preemption's recompute), so it can
    never change. A later value beyond the first batch's amax clamps to +-448 x scale; for a
    model whose K/V exceed 448 (where 1.0 would clamp) that is the price of not clamping all.
  The scale tensors are per KV head either way ("tensor" fills every head with the one
  value): each kernel program handles one KV head and folds its scale in exactly. A new
  pool's scales are 0 ("not calculated"); the model runner marks the pool's first step
  (run eagerly, never from a CUDA graph), each layer sets its scales there with device ops
  and no host read, and later steps skip the work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Smallest int8 scale: a zero row would divide by zero; float16's smallest normal keeps the
# stored scale exact (values that small quantize to 0 with an error < 2^-14).
MIN_INT8_SCALE = 2.0**-14
# Smallest calculated fp8 scale: an all-zero first batch would give 0 (x / 0); any positive
# floor works, this one mirrors int8's.
MIN_FP8_SCALE = 2.0**-14
SCALE_DTYPES = {"int8": torch.float16, "fp8": torch.float32}
STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


class LayerKVCache(NamedTuple):
    """One layer's K and V cache, and their scales when the cache is quantized."""

    key: torch.Tensor  # the backend's layout, storage dtype
    value: torch.Tensor
    # int8: [*cache layout without head_dim] float16, per token and KV head (same slots);
    # fp8: [num_kv_heads] float32 per layer (per-tensor scales: every head the same; 0 = not
    # calculated yet); None for kv_cache_dtype="auto".
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the K/V cache tensors."""
    return STORAGE_DTYPES.get(kv_cache_dtype, model_dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] int8, scale [...] float16) with x ~= q * scale per row."""
    amax = x.float().abs().amax(dim=-1)
    scale = (amax / INT8_MAX).clamp(min=MIN_INT8_SCALE).to(torch.float16)
    # floor(y + 0.5): the rounding the Triton store kernel uses too (ties away from -inf).
    q = torch.floor(x.float() / scale.float()[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] -> float8_e4m3fn of clamp(x / scale[head], +-448)."""
    y = x.float() / scale.float()[None, :, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def calculate_fp8_scale_(
    x: torch.Tensor,  # [T, Hkv, D] this step's K or V, model dtype
    valid: torch.Tensor,  # [T] bool: False for padding tokens (slot -1)
    scale: torch.Tensor,  # [Hkv] float32, updated in place where it is still 0
    per_head: bool,
) -> None:
    """Set a layer's not-yet-calculated scale (0) to max(amax / 448, 2^-14) of this batch's
    valid tokens, per KV head or one value for all heads; a calculated scale stays as it is,
    and a batch of padding only leaves it 0. Device ops only: no host sync."""
    if x.shape[0] == 0:
        return
    amax = x.detach().abs().amax(dim=-1).float().masked_fill(~valid[:, None], 0.0)  # [T, Hkv]
    amax = amax.amax(dim=0)  # [Hkv]
    if not per_head:
        amax = amax.amax().expand_as(amax)
    new = (amax / FP8_MAX).clamp(min=MIN_FP8_SCALE)
    new = torch.where(valid.any(), new, 0.0)  # padding only: still not calculated
    scale.copy_(torch.where(scale > 0, scale, new))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in `dtype`; `scale` broadcasts against q's leading dims (int8: one per row)."""
    return (q.float() * scale.float()[..., None]).to(dtype)
