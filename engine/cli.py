"""Engine flags for every command line (app.py, the server, the benchmarks), derived from
EngineConfig's fields so that no CLI lags the config: one --flag per field, its type from the
annotation, choices from the Literal, and one help text per field here.

    p = argparse.ArgumentParser()
    add_engine_args(p, defaults={"enable_prefix_caching": True})   # this CLI's own default
    config = config_from_args(p.parse_args())
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

from engine.config import (
    DEFAULT_MAX_MODEL_LEN,
    INT8_ACTIVATIONS_MIN_ROWS,
    INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS,
    EngineConfig,
    literal_choices,
)

# One help line per EngineConfig field (a test checks that none is missing).
FLAG_HELP: dict[str, str] = {
    "model": "smollm2-135m (embedded), a local Hugging Face folder, a .gguf file, or "
    "random:<preset>[,key=value...]",
    "device": "auto = CUDA when available, else CPU",
    "dtype": "weights and KV cache; auto = bfloat16 (float32 is for parity tests)",
    "seed": "seeds unseeded requests' sampling and random:<preset> weights",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV pool size in blocks (default: sized from memory)",
    "kv_cache_memory_bytes": "CPU: bytes of the KV cache budget",
    "gpu_memory_utilization": "CUDA: fraction of device memory for weights + KV (leave room "
    "for the Compare tab's engines with big models)",
    "kv_layout": "paged, or contiguous: each request reserves max_model_len tokens up front "
    "(the pre-PagedAttention baseline)",
    "kv_cache_dtype": "K/V storage: auto = the model dtype; int8 (a scale per token and KV "
    "head) or fp8 (e4m3, per-layer K/V scales) hold ~2x the tokens of a 16-bit pool",
    "calculate_kv_scales": "fp8 KV: each layer's K and V scales = amax / 448 of the first batch "
    "it stores, then frozen (--no-calculate-kv-scales: every scale 1.0)",
    "kv_scale_granularity": "fp8 KV with calculated scales: one K and V scale per layer "
    "(tensor) or per layer and KV head (head)",
    "enable_prefix_caching": "share the KV blocks of prompt prefixes seen before (a chat's "
    "earlier turns)",
    "enable_prompt_sharing": "n > 1: the n samples of a prompt share its KV blocks (copy-on-"
    "write); --no-enable-prompt-sharing computes the prompt once per sample (the baseline)",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes)",
    "max_model_len": "context cap in tokens (default: the model's context length, at most "
    f"{DEFAULT_MAX_MODEL_LEN})",
    "batching": "continuous, or static: a batch is admitted when the previous one has finished",
    "enable_chunked_prefill": "split long prompts into chunks under the step's token budget",
    "speculative_method": "ngram: prompt-lookup drafts; draft: a draft model's proposals; "
    "either verified k at a time (greedy output unchanged, sampling's distribution exact)",
    "num_speculative_tokens": "draft tokens proposed per request and step",
    "speculative_model": "--speculative-method draft: the draft model's spec (as --model; "
    "default: the target's own)",
    "speculative_quantization": "the draft model's weights: none, int8 or int4 (a 4-bit copy "
    "of the target is a draft that needs no other weights)",
    "prompt_lookup_max": "ngram drafts: longest suffix looked up (tokens)",
    "prompt_lookup_min": "ngram drafts: shortest suffix looked up (tokens)",
    "quantization": "weight-only: int8 per output channel (W8A16) or int4 round-to-nearest per "
    "group, every linear layer and the LM head (embeddings and norms stay 16-bit); awq: load "
    "an AutoAWQ GEMM checkpoint folder",
    "int8_activations": "quantized weights on CPUs with AVX512-VNNI: quantize each layer's "
    f"input to int8 per group from a few rows (int8: {INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS}, int4/awq: "
    f"{INT8_ACTIVATIONS_MIN_ROWS}; batched decode, prefill) and multiply with integer dot products "
    "(W8A8 / W4A8); batch-1 decode keeps the weight-only kernel",
    "quantization_group_size": "int4: input features per scale/zero pair (must divide every "
    "layer's input size: SmolLM2's 576 takes 32 or 64)",
    "quantize_lm_head": "quantized weights: the LM head too (awq: int4 round-to-nearest at the "
    "checkpoint's group size, since AutoAWQ leaves it 16-bit); --no-quantize-lm-head keeps it "
    "16-bit",
    "attention_backend": (
        "auto = Triton kernels on CUDA, cpu on CPU; cpu = the C++ paged kernel (reads KV "
        "blocks in place; the torch path, with a warning, without a C++ compiler); torch = "
        "the reference path (gather + batched matmuls)"
    ),
    "enforce_eager": "run the model's modules as written: no CUDA graphs (GPU), no direct "
    "few-row kernel calls from the decoder layers and no one-call C++ decode step (CPU)",
    "prepack_weights": "CPU, bfloat16: reorder linear weights for oneDNN once at load instead "
    "of on every matmul (bit-identical outputs); --no-prepack-weights for the before",
    "fused_ops": "RMSNorm with its residual add, RoPE and SiLU-and-mul as one kernel each "
    "instead of 3-12 torch ops: C++ on CPU (the torch ops, with a warning, without a C++ "
    "compiler), Triton on CUDA; "
    "--no-fused-ops for the before",
    "huge_pages": "CPU on Linux: the weights and the KV pool in 2 MiB transparent huge pages "
    "(fewer TLB misses when a step streams them); --no-huge-pages for the before",
    "num_threads": "CPU torch threads (default: all cores)",
    "step_history_len": "engine steps kept for the live charts",
    "request_history_len": "finished requests kept for the latency charts",
}


def add_engine_args(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, Any] | None = None,
    exclude: Collection[str] = (),
) -> None:
    """One --flag per EngineConfig field, except those in `exclude` (fields the CLI sets itself).

    `defaults` are this CLI's own defaults where they differ from EngineConfig's. A flag with
    neither given on the command line nor in `defaults` stays out of the parsed namespace
    (argparse.SUPPRESS), so config_from_args leaves EngineConfig's default in force.
    """
    defaults = dict(defaults or {})
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    unknown = (set(defaults) | set(exclude)) - set(fields)
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: not an EngineConfig field")
    hints = typing.get_type_hints(EngineConfig)
    choices = literal_choices()
    group = parser.add_argument_group("engine", "EngineConfig fields (engine/config.py)")
    for name, f in fields.items():
        if name in exclude:
            continue
        default = defaults.get(name, f.default)
        # None defaults are explained by the help line itself ("default: sized from memory").
        shown = "" if default is None else f" (default: {default})"
        kwargs: dict[str, Any] = {
            "default": defaults.get(name, argparse.SUPPRESS),
            "help": FLAG_HELP[name] + shown,
        }
        kind = _without_none(hints[name])
        if name in choices:
            kwargs["choices"] = choices[name]
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind in (int, float):
            kwargs["type"] = kind
        group.add_argument("--" + name.replace("_", "-"), **kwargs)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig of the parsed engine flags (plus `overrides`, fields the CLI sets).
    Raises ValueError naming the field when a value is invalid."""
    names = EngineConfig.field_names()
    given = {k: v for k, v in vars(args).items() if k in names}
    return EngineConfig(**{**given, **overrides})


def _without_none(hint: Any) -> Any:
    """X from `X | None`; any other hint unchanged."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
