"""What the UI needs to know about the loaded engine, gathered from EngineService's public
attributes in one place (model shape, resolved device and dtype, KV pool, scheduling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.telemetry.cost import ModelShape


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    device: str  # "cpu" or "cuda" (resolved, never "auto")
    dtype: str  # "bfloat16", "float32", ...
    shape: ModelShape
    max_model_len: int  # tokens
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    kv_cache_bytes: int  # bytes of the allocated K and V tensors
    batching: str  # "continuous" | "static"
    kv_layout: str  # "paged" | "contiguous"
    enable_prefix_caching: bool
    speculative_method: str  # "off" | "ngram"
    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int


def engine_info(service: Any) -> EngineInfo:
    stats = service.stats()
    config = service.config
    return EngineInfo(
        model_name=service.model_name,
        device=service.device,
        dtype=service.dtype,
        shape=service.model_shape,
        max_model_len=service.max_model_len,
        block_size=stats.block_size,
        num_kv_blocks=stats.num_kv_blocks,
        kv_cache_bytes=stats.kv_cache_bytes,
        batching=config.batching,
        kv_layout=config.kv_layout,
        enable_prefix_caching=config.enable_prefix_caching,
        speculative_method=config.speculative_method,
        num_speculative_tokens=config.num_speculative_tokens,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )


def describe(info: EngineInfo) -> str:
    """One line for page headers: model, device, dtype, KV pool, scheduling."""
    return (
        f"**{info.model_name}** on {info.device} ({info.dtype}) · KV pool "
        f"{info.num_kv_blocks} blocks x {info.block_size} tokens ({info.kv_layout}, prefix "
        f"caching {'on' if info.enable_prefix_caching else 'off'}) · "
        f"{info.batching} batching, {_speculative(info)}max_num_seqs {info.max_num_seqs}, "
        f"max_num_batched_tokens {info.max_num_batched_tokens}, max_model_len "
        f"{info.max_model_len}"
    )


def _speculative(info: EngineInfo) -> str:
    if info.speculative_method == "off":
        return ""
    return f"speculative {info.speculative_method} ({info.num_speculative_tokens} drafts), "
