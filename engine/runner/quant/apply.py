"""quantize_model: swap a loaded model's linear layers for quantized ones (gpt-fast style: a
handler per scheme, run once at load), and give a tied LM head its own quantized copy.

What stays 16-bit: the embedding table (a step gathers a few rows of it, so its size costs
memory but no time), the RMSNorm weights and any biases. With tied embeddings the LM head is
the embedding table; it is read in full every step (~21% of SmolLM2-135M's weights), so it gets
a quantized copy and the embedding stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.quant.formats import check_int4_shape, quantize_int4, quantize_int8
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
# benchmarks.quant_crossover` (2-core AMD EPYC with AVX-512 BF16, no AMX; README,
# "Quantization"). Per layer at M = 64: int8 kernel 3.2 ms vs dequantize 3.1 ms; int4 at
# M = 128: kernel 6.8 ms vs dequantize 6.7 ms (bf16 alone: 1.7 and 2.9 ms). The int4
# dequantization costs more (unpacking nibbles), so its crossover is higher.
CPU_DEQUANT_MIN_ROWS = {"int8": 64, "int4": 128}


@dataclass(frozen=True)
class QuantSummary:
    """What quantization did to a model's weights (shown in the UI, fed to the cost model)."""

    method: str  # "none", "int8", "int4"
    group_size: int | None  # int4 only
    linear_params: int  # weights of the quantized layers (decoder linears + LM head)
    linear_bytes: int  # their bytes as stored: values + scales + zeros
    other_bytes: int  # everything else (embedding, norms, biases) in the model dtype
    dequant_min_rows: int  # see CPU_DEQUANT_MIN_ROWS; 0 = always dequantize

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.other_bytes

    @property
    def linear_bytes_per_param(self) -> float:
        return self.linear_bytes / self.linear_params


def quantize_model(
    model: LlamaForCausalLM, method: str, group_size: int, dtype: torch.dtype
) -> QuantSummary:
    """Replace every decoder linear and the LM head in place; ValueError naming the field if a
    layer's shape does not fit the format (e.g. group 128 with in_features 576)."""
    device = model.embed_tokens.weight.device
    linears = [(module, attr, f"layers.{i}.{attr}") for i, layer in enumerate(model.layers)
               for module, attr in _layer_linears(layer)]  # fmt: skip
    if method == "int4":
        for module, attr, name in linears:
            lin = getattr(module, attr)
            check_int4_shape(lin.out_features, lin.in_features, group_size, name)
        check_int4_shape(*model.lm_head_weight.shape, group_size, "lm_head")
    largest = max(getattr(m, a).weight.numel() for m, a, _ in linears)
    min_rows = _dequant_min_rows(method, device)
    make = _maker(method, group_size, dtype, DequantScratch(largest, dtype, device), min_rows)
    for module, attr, _ in linears:
        lin = getattr(module, attr)
        setattr(module, attr, make(lin.weight, lin.bias))
    head = make(model.lm_head_weight, None)  # a copy: a tied embedding stays 16-bit
    model.lm_head = head
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    linear_bytes = sum(m.weight_bytes for m in quantized)
    other = sum(p.numel() * p.element_size() for p in model.parameters())
    return QuantSummary(
        method=method,
        group_size=group_size if method == "int4" else None,
        linear_params=sum(m.out_features * m.in_features for m in quantized),
        linear_bytes=linear_bytes,
        other_bytes=other,
        dequant_min_rows=min_rows,
    )


def _dequant_min_rows(method: str, device: torch.device) -> int:
    if device.type != "cpu":
        return 0  # no weight-only kernel off CPU here: always dequantize
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
