"""Build a LlamaForCausalLM from a ModelSource: meta-device construction, weights (a Hugging
Face folder, an AutoAWQ checkpoint or random), then optional weight-only quantization, and
the load's last steps (finish_weights: prepacking, huge pages, bound kernel calls).

Shared by the target model (ModelRunner) and the speculative draft model (DraftModel), so
both load any spec the loader takes in the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from engine.config import (
    ANY_ROWS,
    INT8_ACTIVATIONS_MIN_ROWS,
    INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS,
    EngineConfig,
)
from engine.runner.attention.base import AttentionBackend
from engine.runner.host_memory import keep_freed_memory, place_weights_in_huge_pages, trim_heap
from engine.runner.model_loader import ModelSource, iter_safetensors
from engine.runner.models.layer_ops import CpuFusedOps, TorchOps
from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.models.prepack import (
    PrepackedLinear,
    can_prepack,
    cpu_has_amx,
    cpu_has_bf16_dot,
    prepack_linears,
)
from engine.runner.quant import QuantSummary, load_awq, quantize_model
from engine.runner.quant.apply import (
    CPU_AMX_DEQUANT_MIN_ROWS,
    CPU_FUSED_DEQUANT_MIN_ROWS,
    CPU_INT4_KERNEL_DEQUANT_MIN_ROWS,
    CPU_INT8_ROWS_KERNEL_DEQUANT_MIN_ROWS,
)
from engine.runner.quant.awq import check_awq_config
from engine.runner.quant.linear import Int4Linear, Int8Linear, QuantLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightFormat:
    """How to store a model's weights: the EngineConfig fields that say it."""

    quantization: str  # "none" | "int8" | "int4" | "awq"
    group_size: int  # int4: input features per scale/zero pair
    seed: int  # random:<preset> weights
    quantize_lm_head: bool = True  # quantized formats: the LM head too (awq: RTN int4)
    int8_activations: bool = False  # W8A8 / W4A8 from a few rows (engine/config.py), CPU


def build_model(
    source: ModelSource,
    max_model_len: int,
    attn_backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    fmt: WeightFormat,
    ops: TorchOps,
    field: str = "quantization",
) -> tuple[LlamaForCausalLM, QuantSummary | None]:
    """The model in eval mode without grads, and its QuantSummary when quantized. `ops` runs
    the small per-layer ops (layer_ops.py); `field` names the config field a format error is
    about (the draft has its own)."""
    # Built on the meta device, then materialized: no time spent on throw-away init.
    with torch.device("meta"):
        model = LlamaForCausalLM(source.arch, max_model_len, attn_backend, ops)
    model = model.to_empty(device=device).to(dtype)
    is_awq = bool(source.quant_config) and source.quant_config.get("quant_method") == "awq"
    if fmt.quantization == "awq" or is_awq:
        if fmt.quantization != "awq":
            raise ValueError(
                f"{field}: {source.name} is an AutoAWQ checkpoint; load it with quantization='awq'"
            )
        group_size = check_awq_config(source.quant_config, source.name)
        summary = load_awq(
            model, iter_safetensors(source.weights_dir), group_size, dtype, fmt.quantize_lm_head
        )
        model.init_rope()
        summary = _share_cpu_kernels(model, ops, summary, fmt.int8_activations)
        return model.eval().requires_grad_(False), summary
    if source.weights_dir is None:
        init_random_weights(model, seed=fmt.seed)
    else:
        model.load_hf_weights(iter_safetensors(source.weights_dir))
    model.init_rope()
    model = model.eval().requires_grad_(False)
    summary = None
    if fmt.quantization != "none":
        summary = quantize_model(
            model, fmt.quantization, fmt.group_size, dtype, fmt.quantize_lm_head
        )
        summary = _share_cpu_kernels(model, ops, summary, fmt.int8_activations)
    return model, summary


@dataclass(frozen=True)
class FinishedWeights:
    num_prepacked_linears: int  # 16-bit linears packed for oneDNN (0: off or not possible)
    huge_page_bytes: int  # weight bytes moved into huge pages (0: off, GPU, or not offered)


def finish_weights(
    model: LlamaForCausalLM,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    kernels: ModuleType | None,
) -> FinishedWeights:
    """A load's last steps, the same for the target and the draft model, in this order: the
    16-bit linears packed for oneDNN (prepack.py; prepack_weights), the CPU weights moved into
    huge pages (host_memory.py; huge_pages), the C heap's freed pages returned to the OS (and
    from then on a step's freed temporaries kept for the next step),
    then, the tensors final, the quantized layers' few-row calls re-bound and the decoder's
    direct kernel calls bound (not with enforce_eager). `kernels`: the C++ ops module when the
    model runs it."""
    packed = 0
    if config.prepack_weights and can_prepack(device, dtype, kernels):
        packed = prepack_linears(model, kernels)
    moved = 0
    if config.huge_pages and device.type == "cpu":
        # The bound calls hold the old tensors (or their addresses): unbound first, each old
        # copy is freed once it has moved (and trim_heap below hands its pages back).
        layers = [m for m in model.modules() if isinstance(m, (QuantLinear, PrepackedLinear))]
        bound = [m for m in layers if m.unbind_few_rows()]
        moved = place_weights_in_huge_pages(model)
        for module in bound:
            module.rebind_few_rows()
    if device.type == "cpu":
        trim_heap()  # the freed source weights and moved copies, back to the OS
        keep_freed_memory()  # but each step's temporaries stay for the next step
    if not config.enforce_eager:
        model.bind_few_row_calls()
    return FinishedWeights(packed, moved)


def _share_cpu_kernels(
    model: LlamaForCausalLM, ops: TorchOps, summary: QuantSummary, int8_activations: bool
):
    """Quantized linears dequantize (many-rows path) with the fused ops' C++ extension when
    the model runs it (fused_ops=False stays the whole torch "before"). One pass instead of
    ~8 moves the crossover from the weight-only kernel down to CPU_FUSED_DEQUANT_MIN_ROWS.
    `int8_activations`: int8 and int4 layers take every row count in their C++ kernel, with
    int8 activations from INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS / INT8_ACTIVATIONS_MIN_ROWS rows,
    where this CPU has the W8A8 / W4A8 kernels (else a warning)."""
    if not isinstance(ops, CpuFusedOps):
        if int8_activations:
            logger.warning(
                "int8_activations: runs with the C++ CPU kernels only (fused_ops on a CPU); "
                "the weights stay weight-only here"
            )
        return summary
    # 0 stays 0: no weight-only kernel here (aten's int4 layout differs), always dequantize.
    rows = CPU_FUSED_DEQUANT_MIN_ROWS if summary.dequant_min_rows else 0
    # Where the C++ kernels also take a batch-64 step: AMX tiles on CPUs that have them (else
    # oneDNN's AMX GEMM from `rows`), vdpbf16ps on the others.
    int4_kernel_rows = int8_kernel_rows = rows
    if rows and cpu_has_amx():
        if ops.kernels.has_amx_linear():
            int4_kernel_rows = int8_kernel_rows = CPU_AMX_DEQUANT_MIN_ROWS
    elif rows and cpu_has_bf16_dot():
        int4_kernel_rows = CPU_INT4_KERNEL_DEQUANT_MIN_ROWS
        int8_kernel_rows = CPU_INT8_ROWS_KERNEL_DEQUANT_MIN_ROWS
    elif rows:
        # No bfloat16 arithmetic in hardware: oneDNN's bf16 GEMM after a dequantize is
        # emulated, ~4x slower than these kernels at every row count (prepack.py's docstring),
        # so they take every row count.
        int4_kernel_rows = int8_kernel_rows = ANY_ROWS
    # With AMX the weight-only kernels multiply many rows with tiles, ahead of vpdpbusd.
    a8 = int8_activations and not cpu_has_amx() and ops.kernels.has_int8_act_linear()
    if int8_activations and not a8:
        logger.warning(
            "int8_activations: not used on this CPU (it has AMX tiles, or lacks AVX512-VNNI); "
            "the weights stay weight-only"
        )
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.use_cpu_kernels(ops.kernels)
            module.dequant_min_rows = rows
            if isinstance(module, Int4Linear) and module.bf16_kernel:
                module.dequant_min_rows = int4_kernel_rows
                if a8:
                    module.use_int8_activations(INT8_ACTIVATIONS_MIN_ROWS)
            if isinstance(module, Int8Linear) and module.rows_kernel:
                module.dequant_min_rows = int8_kernel_rows
                if a8:
                    module.use_int8_activations(INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS)
    # The summary reports the decoder layers' switch (the first quantized layer's).
    first = next((m for m in model.modules() if isinstance(m, QuantLinear)), None)
    return replace(
        summary,
        dequant_min_rows=first.dequant_min_rows if first else rows,
        int8_activations_min_rows=first.int8_activations_min_rows if first else 0,
    )


def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    device = model.embed_tokens.weight.device
    # Drawn on the model's device (an 8B model on a GPU would take minutes on the CPU), in
    # row blocks so it never needs a float32 copy of itself.
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                for chunk in param.split(4096, dim=0):
                    noise = torch.randn(chunk.shape, generator=gen, device=device)
                    chunk.copy_(noise * 0.02)
