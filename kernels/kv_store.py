"""kv_store: scatter the new tokens' K and V into their paged-cache slots.

One program per token copies that token's [num_kv_heads, head_dim] K and V rows (a few KB) to
slot_mapping[token], quantizing them when the cache is int8 or float8_e4m3fn. The flat slot index already folds in the block table, so this kernel knows
nothing about blocks. A slot of -1 marks a padding token (e.g. a CUDA-graph batch padded to a
captured size) and writes nothing.
"""

import torch
import triton
import triton.language as tl

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*MODEL_DTYPES, torch.int8, torch.float8_e4m3fn)


# KV_QUANT modes, chosen by the cache dtype (kernels/README.md, "Quantized KV"):
NO_QUANT = 0  # K/V stored in the model dtype
INT8_PER_TOKEN = 1  # int8, one float16 scale per token and KV head: scales[slot, head]
FP8_PER_HEAD = 2  # float8_e4m3fn of x / scale[head], clamped to +-448
INT8_MAX = 127.0
FP8_MAX = 448.0
MIN_INT8_SCALE = 2.0**-14  # float16's smallest normal: a zero row would divide by zero


def kv_quant_mode(cache_dtype: torch.dtype) -> int:
    if cache_dtype == torch.int8:
        return INT8_PER_TOKEN
    if cache_dtype == torch.float8_e4m3fn:
        return FP8_PER_HEAD
    return NO_QUANT


@triton.jit
def float_to_e4m3_bits(y):
    """float32 y with |y| <= 448 -> the float8_e4m3fn bit pattern (uint8), rounded to nearest
    even, subnormals included. Done by hand because Triton 3.7's CPU interpreter converts
    float32 -> float8e4nv wrongly (ties away, subnormals flushed, (-128, -120) -> -64).

    With e = max(floor(log2|y|), -6), the spacing of e4m3 values near |y| is 2^(e-3); the code
    of m = round(|y| / 2^(e-3)) is 8e + m + 48 for normals (m in [8, 16], 16 carries into the
    exponent) and m itself for subnormals (e = -6), one formula for both."""
    a = tl.abs(y)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3), exact
    t = a / spacing  # exact: a power of two
    m = tl.floor(t + 0.5)
    m = tl.where((m - t == 0.5) & ((m.to(tl.int32) & 1) == 1), m - 1.0, m)  # ties to even
    code = exponent * 8 + m.to(tl.int32) + 48
    return (code | tl.where(y < 0, 128, 0)).to(tl.uint8)


@triton.jit
def store_rows(
    rows, cache_ptr, scale_ptr, cache_offsets, scale_offsets, heads, mask, head_mask,
    KV_QUANT: tl.constexpr,
):  # fmt: skip
    """Store one token's [HEADS, HEAD_DIM] K or V rows, quantized per KV_QUANT."""
    if KV_QUANT == 1:  # INT8_PER_TOKEN: scale = max|x| / 127 per head, stored as float16
        x = rows.to(tl.float32)
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
        scale = tl.maximum(amax / 127.0, 6.103515625e-05).to(tl.float16)  # 2^-14
        tl.store(scale_ptr + scale_offsets, scale, mask=head_mask)
        q = tl.floor(x / scale.to(tl.float32)[:, None] + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(cache_ptr + cache_offsets, q.to(tl.int8), mask=mask)
    elif KV_QUANT == 2:  # FP8_PER_HEAD: cache_ptr is the cache's uint8 view
        scale = tl.load(scale_ptr + heads, mask=head_mask, other=1.0)
        y = tl.minimum(tl.maximum(rows.to(tl.float32) / scale[:, None], -448.0), 448.0)
        tl.store(cache_ptr + cache_offsets, float_to_e4m3_bits(y), mask=mask)
    else:
        tl.store(cache_ptr + cache_offsets, rows, mask=mask)


@triton.jit
def _kv_store_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # int8: [num_slots, num_kv_heads] f16; fp8: [num_kv_heads] f32; else unused
    v_scale_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    KV_QUANT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_POW2)
    dims = tl.arange(0, HEAD_DIM)
    head_mask = (heads < NUM_KV_HEADS) & (slot >= 0)
    mask = head_mask[:, None]
    token64 = token.to(tl.int64)
    key_offsets = token64 * stride_key_token + heads[:, None] * stride_key_head + dims[None, :]
    value_offsets = (
        token64 * stride_value_token + heads[:, None] * stride_value_head + dims[None, :]
    )
    key = tl.load(key_ptr + key_offsets, mask=mask)
    value = tl.load(value_ptr + value_offsets, mask=mask)
    # The cache is contiguous, so a slot's heads and dims are one run of elements; int8's
    # scales are [slots, heads], the cache's layout without head_dim.
    cache_offsets = (slot * NUM_KV_HEADS + heads[:, None]) * HEAD_DIM + dims[None, :]
    scale_offsets = slot * NUM_KV_HEADS + heads
    store_rows(key, k_cache_ptr, k_scale_ptr, cache_offsets, scale_offsets, heads, mask,
               head_mask, KV_QUANT)  # fmt: skip
    store_rows(value, v_cache_ptr, v_scale_ptr, cache_offsets, scale_offsets, heads, mask,
               head_mask, KV_QUANT)  # fmt: skip


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
    assert k_cache.dtype in CACHE_DTYPES, f"k_cache dtype must be one of {CACHE_DTYPES}"


def check_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """Asserts the scales a quantized cache needs: int8 [num_blocks, block_size, num_kv_heads]
    float16 (per token and head), fp8 [num_kv_heads] float32 (per head); none otherwise."""
    mode = kv_quant_mode(k_cache.dtype)
    if mode == NO_QUANT:
        assert k_scale is None and v_scale is None, f"a {k_cache.dtype} cache takes no scales"
        return
    shape, dtype = (
        (k_cache.shape[:3], torch.float16) if mode == INT8_PER_TOKEN
        else ((k_cache.shape[2],), torch.float32)
    )  # fmt: skip
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert scale is not None, f"a {k_cache.dtype} cache needs {name}"
        assert scale.shape == shape and scale.dtype == dtype, (
            f"{name} must be {tuple(shape)} {dtype}, got {tuple(scale.shape)} {scale.dtype}"
        )
        assert scale.is_contiguous(), f"{name} must be contiguous"
        assert scale.device == k_cache.device, (
            f"{name} on {scale.device}, cache on {k_cache.device}"
        )


def check_tokens(name: str, tensor: torch.Tensor, cache: torch.Tensor) -> None:
    """Asserts a [tokens, heads, head_dim] tensor matches the cache in dtype, device, last dims."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    assert tensor.dim() == 3 and tuple(tensor.shape[1:]) == (num_kv_heads, head_dim), (
        f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
        f"got {tuple(tensor.shape)}"
    )
    if kv_quant_mode(cache.dtype) == NO_QUANT:
        assert tensor.dtype == cache.dtype, (
            f"{name} dtype {tensor.dtype} != cache dtype {cache.dtype}"
        )
    else:
        assert tensor.dtype in MODEL_DTYPES, f"{name} dtype must be one of {MODEL_DTYPES}"
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
    k_scale: torch.Tensor | None = None,  # int8: [num_blocks, block_size, heads] f16, written
    v_scale: torch.Tensor | None = None,  # fp8: [num_kv_heads] f32, read
) -> None:
    """Write each token's K/V into its cache slot, in place; slot -1 is skipped. An int8 or
    float8_e4m3fn cache stores them quantized (and int8 writes each token's scales)."""
    check_kv_cache(k_cache, v_cache)
    check_kv_scales(k_cache, k_scale, v_scale)
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
    mode = kv_quant_mode(k_cache.dtype)
    if mode == FP8_PER_HEAD:  # the kernel writes e4m3 bit patterns (see float_to_e4m3_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _kv_store_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # unused without quantization
        v_cache if v_scale is None else v_scale,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_POW2=triton.next_power_of_2(num_kv_heads),
        KV_QUANT=mode,
        num_warps=4,
    )
