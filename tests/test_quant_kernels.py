"""Weight-only int8/int4 on CPU: the packed int4 layout, the quantizers' error bound, the stock
torch kernels against float32 references, and both paths of a quantized layer (kernel for few
rows, dequantize + GEMM for many, in row chunks for a matrix larger than the scratch)."""

from __future__ import annotations

import pytest
import torch

from engine.runner.quant.formats import (
    check_int4_shape,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)
from engine.runner.quant.linear import (
    DequantScratch,
    Int4Linear,
    Int8Linear,
    cpu_int4_layout_matches,
)
from kernels.int4_pack import pack_int4, unpack_int4
from kernels.weight_only_cpu import (
    int4_weight_only_mm,
    int4_weight_only_mm_ref,
    int8_weight_only_mm,
    int8_weight_only_mm_ref,
)

# Tolerances, relative to the largest |reference| output: float32 kernels differ from the
# reference only in summation order (~1e-6 measured); bfloat16 outputs are rounded to 8
# mantissa bits (0.4% of the value) after bf16 products.
RTOL_OF_MAX = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _assert_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (y.float() - ref).abs().max().item()
    assert err <= RTOL_OF_MAX[dtype] * ref.abs().max().item(), err


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(64, 32), (128, 64), (80, 64), (112, 64), (960, 576)])
def test_pack_unpack_round_trip(shape):
    q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("shape", [(64, 32), (80, 64), (112, 64), (960, 576)])
def test_pack_matches_aten_cpu_layout(shape):
    if not cpu_int4_layout_matches():
        pytest.skip("this CPU's aten int4 packing is not the AVX-512 layout")
    q = torch.randint(0, 16, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(aten.view(shape[0], shape[1] // 2), pack_int4(q.to(torch.uint8)))


def test_int8_round_to_nearest_error_bound():
    w = _weight(96, 128)
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    err = (dequantize_int8(q) - w).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-6).all()  # half a step, per row


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_to_nearest_error_bound(group_size):
    w = _weight(64, 128)
    q = quantize_int4(w, group_size)
    assert q.qweight.max() <= 15 and q.zeros.max() <= 15
    err = (dequantize_int4(q) - w).abs().view(64, 128 // group_size, group_size)
    assert (err <= q.scales[..., None] / 2 + 1e-6).all()  # half a step, per group
    zero_row = quantize_int4(torch.zeros(16, 64), group_size)
    assert torch.equal(dequantize_int4(zero_row), torch.zeros(16, 64))  # 0.0 is exact


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match=r"quantization_group_size.*576"):
        check_int4_shape(1536, 576, 128, "layers.0.gate_up_proj")
    check_int4_shape(1536, 576, 64, "layers.0.gate_up_proj")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_int8_kernel_matches_reference(dtype, num_rows):
    q = quantize_int8(_weight(96, 128))
    x = torch.randn(num_rows, 128).to(dtype)
    scales = q.scales.to(dtype)
    y = int8_weight_only_mm(x, q.qweight, scales)
    _assert_close(y, int8_weight_only_mm_ref(x, q.qweight, scales), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 5, 64])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_kernel_matches_reference(dtype, num_rows, group_size):
    if not cpu_int4_layout_matches():
        pytest.skip("this CPU's aten int4 packing is not the AVX-512 layout")
    layer = Int4Linear(
        quantize_int4(_weight(80, 128), group_size), None, dtype, DequantScratch(1, dtype, "cpu"), 0
    )
    x = torch.randn(num_rows, 128).to(dtype)
    args = (layer.packed, layer.scale_and_zero, group_size)
    y = int4_weight_only_mm(x, *args)
    _assert_close(y, int4_weight_only_mm_ref(x, *args), dtype)
    # The layer's own float32 view of its weight is the same matrix.
    _assert_close(y, x.float() @ layer.dequantized_weight().t(), dtype)


def _layers(dtype: torch.dtype, scratch_elements: int):
    """An int8 and an int4 layer (with bias) sharing a scratch, with both thresholds at 8 rows."""
    w, bias = _weight(336, 128, seed=3), torch.randn(336).to(dtype)
    scratch = DequantScratch(scratch_elements, dtype, torch.device("cpu"))
    return [
        Int8Linear(quantize_int8(w), bias, dtype, scratch, 8),
        Int4Linear(quantize_int4(w, 32), bias, dtype, scratch, 8),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 8, 40])
@pytest.mark.parametrize("scratch_elements", [336 * 128, 100 * 128])
def test_layer_paths_match_dequantized_reference(dtype, num_rows, scratch_elements):
    """Below 8 rows the kernel runs, from 8 the dequantize path (in 64-row chunks when the
    scratch holds only 100 of the 336 rows; 336 = 5 x 64 + a 16-row packed tail); both equal
    x @ W_deq.T + b."""
    for layer in _layers(dtype, scratch_elements):
        if isinstance(layer, Int4Linear) and not cpu_int4_layout_matches():
            continue
        expected_chunk = 336 if scratch_elements == 336 * 128 else 64
        assert layer.chunk_rows == expected_chunk
        x = torch.randn(2, num_rows, 128).to(dtype)  # leading dims are kept
        y = layer(x)
        assert y.shape == (2, num_rows, 336) and y.dtype == dtype
        ref = x.float() @ layer.dequantized_weight().t() + layer.bias.float()
        _assert_close(y, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scratch_rows", [384, 128])  # the whole weight, or 64-row chunks
def test_cpu_one_pass_dequantization_matches_the_reference(dtype, scratch_rows):
    """The C++ dequantization (kernels/cpu_fused_ops.cpp, fused_ops=True) on the many-rows
    path: int8 rows, int4 written transposed and multiplied as x @ W.T, also in chunks."""
    from kernels import cpu_fused_ops

    if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
        pytest.skip(f"CPU fused ops unavailable: {why}")
    w, bias = _weight(384, 128, seed=5), torch.randn(384).to(dtype)
    scratch = DequantScratch(scratch_rows * 128, dtype, torch.device("cpu"))
    layers = [Int8Linear(quantize_int8(w), bias, dtype, scratch, 0),
              Int4Linear(quantize_int4(w, 32), bias, dtype, scratch, 0)]  # fmt: skip
    x = torch.randn(3, 20, 128, generator=torch.Generator().manual_seed(7)).to(dtype)
    for layer in layers:
        ref = x.float() @ layer.dequantized_weight().t() + layer.bias.float()
        for kernels in (None, cpu_fused_ops):  # the torch dequantization, then the C++ one
            layer.use_cpu_kernels(kernels)
            _assert_close(layer(x), ref, dtype)
    int4 = layers[1]
    wt = torch.empty(128, 384, dtype=dtype)
    cpu_fused_ops.dequant_int4(wt, int4.packed, int4.scale_and_zero, 32, 0, 384)
    _assert_close(wt.t(), int4.dequantized_weight(), dtype)
    with pytest.raises(ValueError, match="rows: whole 64-row blocks"):
        cpu_fused_ops.dequant_int4(wt, int4.packed, int4.scale_and_zero, 32, 0, 100)


def test_layers_keep_the_torch_ops_for_shapes_the_cpp_ops_do_not_take():
    """use_cpu_kernels decides once per layer: int8 needs K % 16 == 0, int4 whole 64-row blocks
    and groups of whole vectors; other layers keep the torch dequantization (and aten)."""
    from kernels import cpu_fused_ops

    scratch = DequantScratch(96 * 72, torch.float32, torch.device("cpu"))
    fits = Int8Linear(quantize_int8(_weight(96, 64)), None, torch.float32, scratch, 0)
    odd_k = Int8Linear(quantize_int8(_weight(96, 72)), None, torch.float32, scratch, 0)
    tail_rows = Int4Linear(quantize_int4(_weight(80, 64), 32), None, torch.float32, scratch, 0)
    for layer in (fits, odd_k, tail_rows):
        layer.use_cpu_kernels(cpu_fused_ops)
    assert fits.cpu_kernels is cpu_fused_ops
    assert odd_k.cpu_kernels is None and tail_rows.cpu_kernels is None


def test_weight_bytes_count_scales_and_zeros():
    int8, int4 = _layers(torch.bfloat16, 336 * 128)
    assert int8.weight_bytes == 336 * 128 + 336 * 2  # int8 values + a bf16 scale per row
    # Two values per byte + a bf16 (scale, zero) pair per group of 32.
    assert int4.weight_bytes == 336 * 128 // 2 + (128 // 32) * 336 * 2 * 2
