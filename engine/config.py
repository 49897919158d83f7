"""EngineConfig: every engine setting in one frozen dataclass, validated once at construction."""

from __future__ import annotations

import dataclasses
import functools
import sys
import typing
from dataclasses import dataclass
from typing import Literal

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Batching = Literal["continuous", "static"]
KVLayout = Literal["paged", "contiguous"]
# "auto" = the model dtype; "int8" = symmetric int8 with a scale per token and KV head;
# "fp8" = float8_e4m3fn with per-layer K and V scales (engine/runner/attention/kv_quant.py).
# Either halves the KV bytes of a 16-bit model.
KVCacheDType = Literal["auto", "int8", "fp8"]
# fp8's calculated scales: one K and one V scale per layer ("tensor", as vLLM's default) or one
# per layer and KV head ("head").
KVScaleGranularity = Literal["tensor", "head"]
# "cpu" = the C++ paged kernel reading KV blocks in place (the torch path, with a warning, when
# no C++ compiler is present; what "auto" picks on CPU); "torch" = gather + batched matmuls,
# the reference path.
AttentionBackend = Literal["auto", "triton", "torch", "cpu"]
# "ngram": prompt-lookup drafts; "draft": a draft model's proposals (engine/runner/draft_model.py).
SpeculativeMethod = Literal["off", "ngram", "draft"]
# The draft model's weights (speculative_method="draft"): a 4-bit copy of the target is a draft
# that needs nothing but the target's own weights.
SpeculativeQuantization = Literal["none", "int8", "int4"]
# Weight-only quantization of every linear layer (engine/runner/quant): int8 = per-output-channel
# symmetric (W8A16), int4 = group-wise asymmetric round-to-nearest with zero points, awq = an
# AutoAWQ GEMM checkpoint folder loaded as it is (its own group size).
Quantization = Literal["none", "int8", "int4", "awq"]

# int4 group sizes (input features per scale/zero pair) that the CPU kernel takes (32-256) and
# that divide the hidden sizes of the usual models; the layer's in_features is checked at load.
INT4_GROUP_SIZES = (32, 64, 128)

# int4 layers with int8_activations (kernels/cpu_int8_act_linear.h: AVX512-VNNI, no AMX): from
# this many rows x is quantized to int8 and multiplied with vpdpbusd; fewer rows keep the
# weight-only kernel. One pass over SmolLM2's decoder-layer linears, 2-core EPYC, 2026-12-06
# 21:40, two runs (benchmarks.packed_linear --quantized, min ms, W4A8 / W4A16 / bf16 kernel):
# 4 rows 4.35-4.44 / 3.53-3.58 / 7.86, 6 rows 4.52-4.54 / 5.19-5.41 / 8.23-8.26, 8 rows
# 5.18-5.30 / 6.29-7.04 / 8.37-9.51, 12 rows 6.17-6.83 / 9.69-11.74 / 9.60-11.14; 21:39: 64 rows
# 23.56-25.88 / 35.94-38.40 / 35.28-36.43, 128 rows 42.90-43.29 / 67.43-69.75 / 66.74-67.34.
INT8_ACTIVATIONS_MIN_ROWS = 6
# The same for int8 layers (W8A8: a 16 x 16 transpose per 64 inputs of 16 rows where int4
# unpacks nibbles). Their weight-only kernel is slower than int4's from 3 rows on (it widens
# bytes to bf16 with ~7 instructions per 32 weights), so the switch comes earlier. Same pass,
# 21:08, two runs, min ms, W8A8 / W8A16: 1 row 6.27-6.48 / 3.93-4.40, 2 rows 6.40-7.21 /
# 4.53-5.06, 3 rows 6.69-6.81 / 6.40-7.10, 4 rows 6.54-6.90 / 8.66-8.72, 8 rows 7.02-8.77 /
# 10.48-11.58, 64 rows 23.94-33.28 / 35.39-45.43 (bf16 34.79-37.93; the host's two modes).
INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS = 4
# A row limit that admits every step (not a count: compare with ==). With int8 activations a
# quantized layer multiplies any number of rows in its C++ kernel: its dequant_min_rows (never
# dequantize + GEMM) and its few-row call's limit, and then the C++ decode step's.
ANY_ROWS = sys.maxsize

# On CPU the KV cache is sized from a byte budget: 1 GiB holds ~45k tokens of SmolLM2-135M in
# bfloat16 (30 layers x 3 KV heads x 64 dims x 2 (K,V) x 2 bytes = 23 KiB per token).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

# max_model_len=None means the model's context length, capped here: the engine allocates RoPE
# tables and (contiguous layout) per-request KV for this many tokens.
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class EngineConfig:
    # Model spec: "smollm2-135m" (embedded), a local Hugging Face folder, a .gguf file,
    # or "random:<preset>[,key=value...]" for speed measurements with random weights.
    model: str = "smollm2-135m"
    device: Device = "auto"
    # "auto" = bfloat16 on CUDA and on CPUs, float32 is for parity tests.
    dtype: DType = "auto"
    seed: int = 0

    # --- KV cache ---
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = size from memory (budget below)
    kv_cache_memory_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES  # CPU budget for the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + KV
    kv_layout: KVLayout = "paged"
    kv_cache_dtype: KVCacheDType = "auto"  # storage of K/V in the cache (see KVCacheDType)
    # fp8 only: False = every K/V scale is 1.0; True = each layer's scales are amax / 448 of the
    # first batch it stores, then frozen (blocks written with a scale must keep it).
    calculate_kv_scales: bool = False
    kv_scale_granularity: KVScaleGranularity = "tensor"  # calculated scales: per layer or head
    # Share the KV blocks of prompt prefixes computed before (needs the paged layout).
    enable_prefix_caching: bool = False
    # n > 1: the n sequences of a request share the prompt's blocks (fork + copy-on-write).
    # False is the "before" for comparisons: each sequence computes the whole prompt into its
    # own blocks, as n separate requests would (same seeds, same tokens).
    enable_prompt_sharing: bool = True

    # --- scheduling ---
    max_num_seqs: int = 64  # most requests in one step
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None = the model's length, capped: DEFAULT_MAX_MODEL_LEN
    batching: Batching = "continuous"
    enable_chunked_prefill: bool = True

    # --- speculative decoding (engine/core/spec_decode.py) ---
    speculative_method: SpeculativeMethod = "off"  # "ngram": prompt lookup; "draft": a model
    num_speculative_tokens: int = 4  # draft tokens proposed per request and step
    # "draft": the draft model's spec (as `model`); None = the target's own spec.
    speculative_model: str | None = None
    speculative_quantization: SpeculativeQuantization = "none"  # the draft's weight format
    prompt_lookup_max: int = 4  # longest suffix looked up (tokens)
    prompt_lookup_min: int = 2  # shortest suffix looked up (tokens)

    # --- weights ---
    quantization: Quantization = "none"
    quantization_group_size: int = 64  # int4: input features per scale/zero (32, 64 or 128)
    # The LM head too (~21% of SmolLM2-135M's weights, read in full every step): int8/int4 in
    # their own format; awq as int4 round-to-nearest at the checkpoint's group size (AutoAWQ
    # leaves it 16-bit). False keeps it 16-bit, as vLLM loads AWQ checkpoints.
    quantize_lm_head: bool = True
    # Quantized weights on CPU: from a few rows (int8: 4, int4/awq: 6; batched decode, prefill)
    # quantize each layer's input to int8 per group and multiply with integer dot products
    # (W8A8 / W4A8, kernels/cpu_int8_act_linear.h, CPUs with AVX512-VNNI): past the tie with
    # bf16 that weight-only products reach at many rows, for a small rounding of the
    # activations. Batch-1 decode keeps the weight-only kernels either way.
    int8_activations: bool = False

    # --- execution ---
    attention_backend: AttentionBackend = "auto"
    # True: every step runs the model's modules as written: no CUDA graphs (GPU), no direct
    # few-row kernel calls from the decoder layers (CPU, llama.LayerCalls) and no whole pass in
    # one C++ call (CPU, models/decode_step.py).
    enforce_eager: bool = False
    # CPU, 16-bit: linear weights reordered once for oneDNN instead of on every call (same
    # outputs; engine/runner/models/prepack.py). False is the "before" for comparisons.
    prepack_weights: bool = True
    # RMSNorm with its residual add, RoPE and SiLU-and-mul as one kernel each instead of 3-12
    # torch ops: C++ on CPU, Triton on CUDA (engine/runner/models/layer_ops.py). False is the
    # "before".
    fused_ops: bool = True
    # CPU on Linux: the weights and the KV pool in 2 MiB transparent huge pages (fewer TLB
    # misses when a step streams them; engine/runner/host_memory.py). False is the "before".
    huge_pages: bool = True
    num_threads: int | None = None  # CPU torch threads; None = all cores

    # --- telemetry ---
    step_history_len: int = 2048  # StepStats kept in the ring buffer
    request_history_len: int = 1024  # finished requests kept for latency charts

    def __post_init__(self) -> None:
        for name, choices in literal_choices().items():
            _check_choice(name, getattr(self, name), choices)
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("prompt_lookup_max", self.prompt_lookup_max)
        _check_positive("prompt_lookup_min", self.prompt_lookup_min)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min: must be <= prompt_lookup_max ({self.prompt_lookup_min} > "
                f"{self.prompt_lookup_max})"
            )
        if self.enable_prefix_caching and self.kv_layout != "paged":
            raise ValueError("enable_prefix_caching: needs kv_layout='paged'")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model: must be a non-empty model spec")
        spec = self.speculative_model
        if spec is not None and (not isinstance(spec, str) or not spec.strip()):
            raise ValueError("speculative_model: must be a non-empty model spec or None")
        _check_positive("block_size", self.block_size)
        if self.quantization_group_size not in INT4_GROUP_SIZES or isinstance(
            self.quantization_group_size, bool
        ):
            raise ValueError(
                "quantization_group_size: must be one of "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}; got {self.quantization_group_size!r}"
            )
        if self.int8_activations and self.quantization == "none":
            raise ValueError(
                "int8_activations: needs quantized weights (quantization='int8', 'int4' or "
                "'awq': the W8A8 / W4A8 kernels)"
            )
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _check_positive("step_history_len", self.step_history_len)
        _check_positive("request_history_len", self.request_history_len)
        if self.num_kv_blocks is not None:
            _check_positive("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _check_positive("num_threads", self.num_threads)
        gpu_util = self.gpu_memory_utilization
        if isinstance(gpu_util, bool) or not isinstance(gpu_util, int | float):
            gpu_util = float("nan")  # a string or a bool: rejected below, naming the field
        if not 0.0 < gpu_util <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        # The seed feeds random.Random and torch.Generator.manual_seed (at most 64 bits).
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed: must be in [0, 2**64 - 1], got {self.seed}")
        for name in (
            "enable_prefix_caching",
            "enable_prompt_sharing",
            "enable_chunked_prefill",
            "enforce_eager",
            "calculate_kv_scales",
            "prepack_weights",
            "fused_ops",
            "huge_pages",
        ):
            if not isinstance(getattr(self, name), bool):  # "no" would read as True
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        _check_kv_scales(self)
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "max_num_batched_tokens: without chunked prefill it must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> EngineConfig:
        """A copy storing K/V as `kv_cache_dtype`, for callers that vary the format over a base
        config (Compare's sides, bench-kvq's runs): fp8 keeps the base's scale settings, any
        other format resets them (they are refused there)."""
        if kv_cache_dtype == "fp8":
            return self.replace(kv_cache_dtype="fp8")
        return self.replace(
            kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=False, kv_scale_granularity="tensor"
        )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


@functools.cache
def literal_choices() -> dict[str, tuple[str, ...]]:
    """Field name -> allowed values, for every field typed as a Literal (the one source of the
    choices: validation here and argparse's choices in engine/cli.py)."""
    hints = typing.get_type_hints(EngineConfig)
    return {
        name: typing.get_args(hint)
        for name, hint in hints.items()
        if typing.get_origin(hint) is Literal
    }


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {', '.join(choices)}; got {value!r}")


def _check_kv_scales(config: EngineConfig) -> None:
    """Scale settings only fp8 reads: refused elsewhere rather than silently ignored."""
    if config.calculate_kv_scales and config.kv_cache_dtype != "fp8":
        raise ValueError(
            "calculate_kv_scales: needs kv_cache_dtype='fp8' (int8 computes a scale per token "
            f"anyway, 16-bit K/V have none); got kv_cache_dtype={config.kv_cache_dtype!r}"
        )
    # Scales fixed at 1.0 are the same for every head: "head" would change nothing.
    if config.kv_scale_granularity == "head" and not config.calculate_kv_scales:
        raise ValueError("kv_scale_granularity: 'head' needs calculate_kv_scales=True")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
