"""quantize_model: swap a loaded model's linear layers for quantized ones (gpt-fast style: a
handler per scheme, run once at load), and give a tied LM head its own quantized copy.

What stays 16-bit: the embedding table (a step gathers a few rows of it, so its size costs
memory but no time), the RMSNorm weights and any biases. With tied embeddings the LM head is
the embedding table; it is read in full every step (~21% of SmolLM2-135M's weights), so it gets
a quantized copy and the embedding stays as it was. An AutoAWQ checkpoint leaves the LM head
16-bit; it gets the same round-to-nearest int4 copy as `int4` at the checkpoint's group size
(AWQ's activation-aware scales fold into the previous op, and the head has none it could take).
`quantize_lm_head=False` keeps the head 16-bit in every format.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.quant.awq import awq_to_int4
from engine.runner.quant.formats import Int4Weight, check_int4_shape, quantize_int4, quantize_int8
from engine.runner.quant.linear import (
    DequantScratch,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    cpu_int4_layout_matches,
)

# Rows (tokens) at and above which a layer dequantizes into the scratch and runs the 16-bit
# GEMM instead of the weight-only kernel, per format, on CPU: the smallest M from which the
# dequantize path was faster over SmolLM2-135M's decoder layer in `python -m
# benchmarks.quant_crossover` (2-core AMD EPYC with AVX-512 BF16, no AMX;
# docs/measurements/quantization.md). Per layer at M = 64: int8 kernel 3.2 ms vs dequantize
# 3.1 ms; int4 at M = 128: kernel 6.8 ms vs dequantize 6.7 ms (bf16 alone: 1.7 and 2.9 ms). The int4
# dequantization costs more (unpacking nibbles), so its crossover is higher.
CPU_DEQUANT_MIN_ROWS = {"int8": 64, "int4": 128}
# The same with the one-pass C++ dequantization (fused_ops, kernels/cpu_fused_ops.cpp):
# measured per layer on the 2-core EPYC (gate_up 3072 x 576 / down 576 x 1536, bf16), kernel
# vs dequantize + matmul in us: int4 M=16 394 vs 424 and 165 vs 190, M=32 781 vs 556 and
# 326 vs 259; int8 M=16 435 vs 447 and 181 vs 179, M=32 877 vs 562. `python -m
# benchmarks.quant_crossover` (whole layers, 8/16/32/64 rows): 32 for both formats.
CPU_FUSED_DEQUANT_MIN_ROWS = 32
# int4 layers that run kernels/cpu_int4_linear.h (bfloat16 on AVX512-BF16 + VBMI CPUs without
# AMX; without AVX512-BF16 they take every row count, model_build._share_cpu_kernels): it turns each 64-row block's nibbles into 16-bit pairs once and reuses them for every 4
# x rows, so it keeps up with the prepacked bf16 kernel up to a batch-64 decode step. Measured
# over SmolLM2's layers on the 2-core EPYC, one run: 32 rows 13.4 ms (bf16 13.5), 64 rows 25.2
# (bf16 23.7), where dequantize + GEMM had made batch-64 decode 0.51x bf16 (benchmarks.quant).
# With AMX: CPU_AMX_DEQUANT_MIN_ROWS below (AMX kernels), else 32 (oneDNN's AMX GEMM).
CPU_INT4_KERNEL_DEQUANT_MIN_ROWS = 65
# int8 layers whose int8_linear takes many bfloat16 rows (kernels/cpu_int8_rows.h: AVX512-BF16,
# no AMX; without AVX512-BF16 every row count): weight rows widened to bf16 once per call, then vdpbf16ps. Measured over SmolLM2's
# decoder layers at 64 rows on the 2-core EPYC (benchmarks.packed_linear --quantized,
# 2026-12-06): 34.0 ms against 34.9 for the prepacked bf16 kernel; dequantize + oneDNN took ~48
# on another day (docs/measurements/quantization.md).
CPU_INT8_ROWS_KERNEL_DEQUANT_MIN_ROWS = 65
# int8_activations' switches (INT8_ACTIVATIONS_MIN_ROWS, INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS) live in
# engine/config.py, which the UI reads without torch.
# Quantized bfloat16 layers on CPUs with AMX (kernels/cpu_amx_linear.h): the weight-only kernels
# multiply many rows with AMX tiles, converting the weight to 16-bit once per call in L2, where
# dequantize + GEMM wrote the whole 16-bit weight and oneDNN reordered it on every call.
# Measured per SmolLM2 layer shape on a 2-core Xeon (AMX), us, AMX kernel vs dequantize +
# oneDNN: 64 rows gate_up 180-265 vs 390-480, LM head 3100-5500 vs 6700-7600; 100 rows gate_up
# 267 vs 434; 512 rows level (gate_up 1017 vs 985, down 453 vs 497). Unmeasured between 100 and
# 512: the switch sits in between.
CPU_AMX_DEQUANT_MIN_ROWS = 256
# CUDA: the Triton weight-only kernels (kernels/w4a16_gemm.py, w8a16_gemm.py) below this many
# rows, dequantize + cuBLAS above (vLLM's AWQ path switches at 256 tokens too). Measured on an
# H200 (scripts/gpu_check.py, kernels/README.md): int8's kernel beat dequantize + cuBLAS at every
# row count up to 256; int4's, on Llama-3-8B's largest layers, at 64 rows (4x) but not at 256,
# so its crossover lies in between, unmeasured; the switch stays at 256.
CUDA_DEQUANT_MIN_ROWS = 256


@dataclass(frozen=True)
class QuantSummary:
    """What quantization did to a model's weights (shown in the UI, fed to the cost model)."""

    method: str  # "int8", "int4", "awq"
    group_size: int | None  # int4 and awq
    linear_params: int  # weights of the quantized layers (decoder linears + LM head)
    linear_bytes: int  # their bytes as stored: values + scales + zeros
    other_bytes: int  # everything else (embedding, norms, biases) in the model dtype
    dequant_min_rows: int  # see CPU_DEQUANT_MIN_ROWS; 0 = always dequantize
    int8_activations_min_rows: int = 0  # W8A8 / W4A8 from this many rows (0: weight-only)

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.other_bytes

    @property
    def linear_bytes_per_param(self) -> float:
        return self.linear_bytes / self.linear_params


def quantize_model(
    model: LlamaForCausalLM,
    method: str,
    group_size: int,
    dtype: torch.dtype,
    quantize_lm_head: bool = True,
) -> QuantSummary:
    """Replace every decoder linear and (`quantize_lm_head`) the LM head in place; ValueError
    naming the field if a layer's shape does not fit the format (e.g. group 128 with
    in_features 576)."""
    device = model.embed_tokens.weight.device
    linears = [(module, attr, f"layers.{i}.{attr}") for i, layer in enumerate(model.layers)
               for module, attr in _layer_linears(layer)]  # fmt: skip
    if method == "int4":
        for module, attr, name in linears:
            lin = getattr(module, attr)
            check_int4_shape(lin.out_features, lin.in_features, group_size, name)
        if quantize_lm_head:
            check_int4_shape(*model.lm_head_weight.shape, group_size, "lm_head")
    largest = max(getattr(m, a).weight.numel() for m, a, _ in linears)
    min_rows = _dequant_min_rows(method, device)
    make = _maker(method, group_size, dtype, DequantScratch(largest, dtype, device), min_rows)
    for module, attr, _ in linears:
        lin = getattr(module, attr)
        setattr(module, attr, make(lin.weight, lin.bias))
    if quantize_lm_head:
        model.lm_head = make(model.lm_head_weight, None)  # a copy: a tied embedding stays 16-bit
    return _summary(model, method, group_size, min_rows)


def load_awq(
    model: LlamaForCausalLM,
    tensors: Iterable[tuple[str, torch.Tensor]],
    group_size: int,
    dtype: torch.dtype,
    quantize_lm_head: bool = True,
) -> QuantSummary:
    """Load an AutoAWQ GEMM checkpoint (engine/runner/quant/awq.py): each decoder linear
    becomes an Int4Linear from its qweight/qzeros/scales (q/k/v and gate/up concatenated
    along N), everything else (embedding, norms with AWQ's folded scales, biases, an untied
    LM head) loads as 16-bit tensors; then, with `quantize_lm_head`, the LM head gets a
    round-to-nearest int4 copy at the checkpoint's group size. ValueError names a missing or
    misshapen tensor."""
    device = model.embed_tokens.weight.device
    packed: dict[str, dict[str, torch.Tensor]] = {}
    plain = []
    for name, tensor in tensors:
        prefix, _, kind = name.removeprefix("model.").rpartition(".")
        if kind in _AWQ_TENSORS:
            packed.setdefault(prefix, {})[kind] = tensor
        else:
            plain.append((name, tensor))
    min_rows = _dequant_min_rows("int4", device)
    linears = [(i, module, attr) for i, layer in enumerate(model.layers)
               for module, attr in _layer_linears(layer)]  # fmt: skip
    largest = max(getattr(m, a).weight.numel() for _, m, a in linears)
    scratch = DequantScratch(largest, dtype, device)
    for i, module, attr in linears:
        where = "self_attn" if attr in ("qkv_proj", "o_proj") else "mlp"
        parts = [_awq_part(packed, f"layers.{i}.{where}.{p}", group_size, device)
                 for p in _AWQ_PARTS.get(attr, (attr,))]  # fmt: skip
        weight = Int4Weight(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
            group_size,
        )
        check_int4_shape(*weight.qweight.shape, group_size, f"layers.{i}.{where}.{attr}")
        old = getattr(module, attr)
        bias = None if old.bias is None else torch.zeros_like(old.bias)  # loaded below
        setattr(module, attr, Int4Linear(weight, bias, dtype, scratch, min_rows))
    model.load_hf_weights(plain)
    if quantize_lm_head:
        head = model.lm_head_weight
        check_int4_shape(*head.shape, group_size, "lm_head")
        model.lm_head = _maker("int4", group_size, dtype, scratch, min_rows)(head, None)
    return _summary(model, "awq", group_size, min_rows)


# AutoAWQ's per-projection names of our fused layers, in concatenation order.
_AWQ_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_AWQ_TENSORS = ("qweight", "qzeros", "scales")


def _awq_part(packed, prefix: str, group_size: int, device: torch.device) -> Int4Weight:
    found = packed.get(prefix, {})
    for kind in _AWQ_TENSORS:
        if kind not in found:
            raise ValueError(f"model: the AWQ checkpoint lacks tensor {prefix}.{kind}")
    return awq_to_int4(
        found["qweight"].to(device), found["qzeros"].to(device), found["scales"].to(device),
        group_size, prefix,
    )  # fmt: skip


def _summary(model: LlamaForCausalLM, method: str, group_size: int, min_rows: int) -> QuantSummary:
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return QuantSummary(
        method=method,
        group_size=None if method == "int8" else group_size,
        linear_params=sum(m.out_features * m.in_features for m in quantized),
        linear_bytes=sum(m.weight_bytes for m in quantized),
        other_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        dequant_min_rows=min_rows,
    )


def _dequant_min_rows(method: str, device: torch.device) -> int:
    if device.type == "cuda":
        return CUDA_DEQUANT_MIN_ROWS
    if device.type != "cpu":
        return 0  # no weight-only kernel for this device: always dequantize
    if method == "int4" and not cpu_int4_layout_matches():
        return 0
    return CPU_DEQUANT_MIN_ROWS[method]


def _maker(method, group_size, dtype, scratch, min_rows):
    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        if method == "int8":
            return Int8Linear(quantize_int8(weight), bias, dtype, scratch, min_rows)
        return Int4Linear(quantize_int4(weight, group_size), bias, dtype, scratch, min_rows)

    if method not in ("int8", "int4"):
        raise ValueError(f"quantization: unknown method {method!r}")
    return make


def _layer_linears(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of each linear of a decoder layer: q/k/v, o, gate/up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")]
