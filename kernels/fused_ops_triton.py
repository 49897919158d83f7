"""Fused per-layer ops of a Llama decoder on GPUs (Triton): what kernels/cpu_fused_ops.py is
on CPUs, with the same signatures.

    rms_norm(x, w, eps)                  -> w * dtype(x * rsqrt(mean(x^2) + eps))
    add_rms_norm(x, residual, w, eps)    -> residual = dtype(residual + x) (in place), then
                                            rms_norm(residual, w, eps)
    rope_(x, positions, cos, sin, heads, head_dim)
                                         rotate-half RoPE in place on the first `heads` heads
    silu_mul(gate_up)                    -> dtype(silu(gate)) * up, gate_up = [gate | up]

Why: CUDA graphs remove the launch costs of torch's small ops but not the kernels themselves.
The first H200 profile of a batch-1 SmolLM2 token with graphs (scripts/gpu_tune.py,
2026-12-04) spent ~1.1 of its ~1.9 ms of GPU time in ~860 tiny elementwise and reduction
kernels (RMSNorm in float32 with its casts, RoPE's slices and cat, SiLU, the adds), ~1.3 us
each: each op here is one kernel instead of 3-12.

Arithmetic: each kernel rounds where torch's op sequence (layer_ops.TorchOps, the reference)
rounds, in the same order (a 16-bit product is computed in float32 and rounded, as torch's
CUDA and CPU elementwise kernels do), so outputs match the torch path to the last bit except
where a reduction's summation order or exp's last float32 bit differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, H] rows, stride x_stride
    residual_ptr,  # [T, H], updated in place when HAS_RESIDUAL
    weight_ptr,  # [H]
    out_ptr,  # [T, H], contiguous
    x_stride,
    residual_stride,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * residual_stride + cols
        total = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32) + x
        total = total.to(residual_ptr.dtype.element_ty)  # residual + x, rounded as torch does
        tl.store(r_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / H
    normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (weight * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * H + cols, out, mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, >= HEADS * HEAD_DIM], row stride x_stride
    positions_ptr,  # int64 [T]
    cos_ptr,  # float32 [max_positions, HEAD_DIM / 2]
    sin_ptr,
    x_stride,
    HEADS: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM / 2, a power of two
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_POW2)[:, None]
    i = tl.arange(0, HALF)[None, :]
    mask = heads < HEADS
    position = tl.load(positions_ptr + token)
    # torch's reference casts the float32 tables to the model dtype first.
    dtype = x_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * HALF + i).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + position * HALF + i).to(dtype).to(tl.float32)
    first = x_ptr + token * x_stride + heads * (2 * HALF) + i
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # x1 * cos - x2 * sin, each product and the difference rounded (torch's op sequence).
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * inter] rows: gate then up
    out_ptr,  # [T, inter], contiguous
    gate_up_stride,
    inter,  # the MLP's intermediate size
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * gate_up_stride + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu, rounded
    tl.store(out_ptr + row * inter + cols, (silu * up.to(tl.float32)).to(dtype), mask=mask)


def _check_rows(name: str, x: torch.Tensor, width: int) -> None:
    assert x.dim() == 2 and x.shape[1] >= width and x.stride(1) == 1, (
        f"{name} must be [T, >= {width}] with contiguous rows, got {tuple(x.shape)} "
        f"strides {x.stride()}"
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Adds x into `residual` in place and returns the normalized sum."""
    assert residual.shape == x.shape and residual.dtype == x.dtype, (
        f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
    )
    return _norm(x, residual, weight, eps)


def _norm(x, residual, weight, eps: float) -> torch.Tensor:
    hidden = weight.shape[0]
    _check_rows("x", x, hidden)
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    if residual is not None:
        _check_rows("residual", residual, hidden)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, x if residual is None else residual, weight, out,
        x.stride(0), 0 if residual is None else residual.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_H=block, num_warps=4 if block <= 2048 else 8,
    )  # fmt: skip
    return out


def rope_supports(head_dim: int) -> bool:
    """Whether rope_ takes heads of head_dim: one program rotates head_dim / 2 pairs, a power
    of two (tl.arange)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


def rope_(
    x: torch.Tensor,  # [T, >= num_heads * head_dim], rows of heads; rotated in place
    positions: torch.Tensor,  # int64 [T]
    cos: torch.Tensor,  # float32 [max_positions, head_dim / 2]
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> torch.Tensor:
    half = head_dim // 2
    _check_rows("x", x, num_heads * head_dim)
    assert rope_supports(head_dim), f"head_dim / 2 must be a power of two, got head_dim {head_dim}"
    assert positions.shape == (x.shape[0],) and positions.dtype == torch.int64
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[1] == half
    assert cos.is_contiguous() and sin.is_contiguous()
    if x.shape[0]:
        _rope_kernel[(x.shape[0],)](
            x, positions, cos, sin, x.stride(0),
            HEADS=num_heads, HEADS_POW2=triton.next_power_of_2(num_heads), HALF=half,
            # No multiply-add contraction: with it, x1 * cos - x2 * sin became one FMA across
            # the bf16 rounding of the products (23% of elements off by a rounding on an H200,
            # 2026-12-04); without it, bit-exact against torch.
            enable_fp_fusion=False,
        )  # fmt: skip
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    _check_rows("gate_up", gate_up, 2 * inter)
    out = gate_up.new_empty(gate_up.shape[0], inter)
    block = min(1024, triton.next_power_of_2(inter))
    if gate_up.shape[0]:
        grid = (gate_up.shape[0], triton.cdiv(inter, block))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), inter, BLOCK=block)
    return out
