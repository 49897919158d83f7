"""kv_store: scatter the new tokens' K and V into their paged-cache slots.

One program per token copies that token's [num_kv_heads, head_dim] K and V rows (a few KB) to
slot_mapping[token]. The flat slot index already folds in the block table, so this kernel knows
nothing about blocks. A slot of -1 marks a padding token (e.g. a CUDA-graph batch padded to a
captured size) and writes nothing.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_ELEMENTS: tl.constexpr,  # next power of two >= NUM_KV_HEADS * HEAD_DIM
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offsets = tl.arange(0, BLOCK_ELEMENTS)
    head = offsets // HEAD_DIM
    dim = offsets % HEAD_DIM
    mask = (offsets < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
    token64 = token.to(tl.int64)
    key = tl.load(key_ptr + token64 * stride_key_token + head * stride_key_head + dim, mask=mask)
    value = tl.load(
        value_ptr + token64 * stride_value_token + head * stride_value_head + dim, mask=mask
    )
    # The cache is contiguous, so a slot's heads and dims are one run of elements.
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + offsets
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Asserts the fixed cache layout: two equal contiguous [blocks, block_size, heads, dim]."""
    assert k_cache.dim() == 4, (
        f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
    )
    assert v_cache.shape == k_cache.shape, (
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
    )
    assert v_cache.dtype == k_cache.dtype, f"v_cache {v_cache.dtype} != k_cache {k_cache.dtype}"
    assert v_cache.device == k_cache.device, (
        f"v_cache on {v_cache.device}, k_cache on {k_cache.device}"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache/v_cache must be contiguous"


def check_tokens(name: str, tensor: torch.Tensor, cache: torch.Tensor) -> None:
    """Asserts a [tokens, heads, head_dim] tensor matches the cache in dtype, device, last dims."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    assert tensor.dim() == 3 and tuple(tensor.shape[1:]) == (num_kv_heads, head_dim), (
        f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
        f"got {tuple(tensor.shape)}"
    )
    assert tensor.dtype == cache.dtype, f"{name} dtype {tensor.dtype} != cache dtype {cache.dtype}"
    assert tensor.device == cache.device, f"{name} on {tensor.device}, cache on {cache.device}"
    assert tensor.stride(2) == 1, (
        f"{name} must be contiguous in head_dim, strides {tensor.stride()}"
    )


def kv_store(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; -1 = padding, skip
) -> None:
    """Write each token's K/V into its cache slot, in place; slot -1 is skipped."""
    check_kv_cache(k_cache, v_cache)
    check_tokens("key", key, k_cache)
    check_tokens("value", value, k_cache)
    num_tokens = key.shape[0]
    assert value.shape[0] == num_tokens, f"key has {num_tokens} tokens, value {value.shape[0]}"
    assert slot_mapping.shape == (num_tokens,), (
        f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}"
    )
    assert slot_mapping.dtype == torch.int64, (
        f"slot_mapping must be int64, got {slot_mapping.dtype}"
    )
    assert slot_mapping.device == k_cache.device, (
        f"slot_mapping on {slot_mapping.device}, cache on {k_cache.device}"
    )
    assert slot_mapping.is_contiguous(), "slot_mapping must be contiguous"
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _kv_store_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_ELEMENTS=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4,
    )
