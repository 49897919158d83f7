"""The cost model: FLOPs and bytes moved per engine step, and KV-cache sizing.

Pure Python (no torch). FLOPs and bytes are model-based estimates from the shapes (the usual
2 x params x tokens accounting), not hardware counters; the engine records them per step in a
StepStats (engine.telemetry.stats) and the roofline plots them against measured ceilings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the cost model stays pure Python: it only reads an arch's numbers
    from engine.runner.models.arch import ModelArch

# --------------------------------------------------------------------------------------------
# Model shape and FLOP/byte accounting
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The cost model's view of a ModelArch: the numbers that set its FLOPs and bytes (no
    biases), plus the element sizes of the weights and the KV cache. Build it with from_arch."""

    num_layers: int
    hidden_size: int
    intermediate_size: int  # MLP width (gate/up output, down input)
    num_heads: int  # query heads
    num_kv_heads: int  # K/V heads (GQA: fewer than num_heads)
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    weight_bytes_per_param: float = 2.0  # 2 bf16/fp16, 4 fp32: embeddings and norms
    kv_bytes_per_element: float = 2.0  # bytes of one K or V element in the cache
    # Bytes per weight of the matmul layers (decoder linears + LM head) as stored, scales and
    # zeros included: int8 ~1.003, int4 g64 0.5625 (0.5 + a bf16 scale and zero per 64).
    # None = weight_bytes_per_param (not quantized).
    linear_bytes_per_param: float | None = None

    @classmethod
    def from_arch(
        cls,
        arch: ModelArch,
        weight_bytes_per_param: float = 2.0,
        kv_bytes_per_element: float = 2.0,
        linear_bytes_per_param: float | None = None,
    ) -> ModelShape:
        """The one place a ModelArch becomes a ModelShape."""
        return cls(
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            vocab_size=arch.vocab_size,
            tie_word_embeddings=arch.tie_word_embeddings,
            weight_bytes_per_param=weight_bytes_per_param,
            kv_bytes_per_element=kv_bytes_per_element,
            linear_bytes_per_param=linear_bytes_per_param,
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output projection (the embedding table itself when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def layer_linear_params(self) -> int:
        """Matmul parameters of one decoder layer: q, k, v, o + gate, up, down."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attn + mlp

    @property
    def norm_params(self) -> int:
        """RMSNorm weights: two per layer plus the final norm."""
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def num_params(self) -> int:
        """All stored parameters (Llama-2-7B: 6,738,415,616)."""
        untied_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return (
            self.embedding_params
            + self.num_layers * self.layer_linear_params
            + self.norm_params
            + untied_head
        )

    @property
    def num_linear_params_per_token(self) -> int:
        """Parameters one sampled token passes through in matmuls: every layer linear + lm_head.

        Tokens that produce no logit (all but the last of a prefill chunk) skip the lm_head;
        step_cost() accounts for that with num_logit_tokens.
        """
        return self.num_layers * self.layer_linear_params + self.lm_head_params

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights read in one forward step, whatever the batch (each read once).

        The embedding table is NOT counted as read in full: a step gathers only the rows of its
        tokens (tokens x hidden, negligible and left out). The lm_head is read in full; when the
        embeddings are tied that read is the embedding table itself (quantized: its quantized
        copy), so it is counted once. Quantized matmul layers count their stored bytes.
        """
        linear_params = self.num_layers * self.layer_linear_params + self.lm_head_params
        linear_bytes_per_param = self.linear_bytes_per_param
        if linear_bytes_per_param is None:
            linear_bytes_per_param = self.weight_bytes_per_param
        return (
            linear_params * linear_bytes_per_param + self.norm_params * self.weight_bytes_per_param
        )

    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return kv_cache_bytes(
            self.num_layers, self.num_kv_heads, self.head_dim, 1, 1, self.kv_bytes_per_element
        )


@dataclass(frozen=True)
class StepCost:
    flops: float  # floating-point operations (a multiply-add counts 2)
    bytes_moved: float  # bytes read + written from device memory (weights + KV cache)

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte; 0 for an empty step."""
        return self.flops / self.bytes_moved if self.bytes_moved > 0 else 0.0


def linear_flops(shape: ModelShape, num_tokens: int, num_logit_tokens: int) -> float:
    """Matmul FLOPs: 2 x layer linear params x tokens + 2 x lm_head params x logit tokens."""
    layers = 2.0 * shape.num_layers * shape.layer_linear_params * num_tokens
    return layers + 2.0 * shape.lm_head_params * num_logit_tokens


def attended_positions(num_new_tokens: int, context_len: int) -> int:
    """Sum over the new tokens of how many tokens each attends to (causal).

    The new tokens sit at positions context_len - n ... context_len - 1; the token at position
    p attends p + 1 tokens, so the sum is n * (2 * context_len - n + 1) / 2.
    """
    n = num_new_tokens
    return n * (2 * context_len - n + 1) // 2


def attention_flops(
    shape: ModelShape, num_new_tokens: Sequence[int], context_lens: Sequence[int]
) -> float:
    """QK^T and PV, all layers: 2 matmuls x 2 FLOP x heads x head_dim x attended positions."""
    attended = sum(
        attended_positions(n, c) for n, c in zip(num_new_tokens, context_lens, strict=True)
    )
    return 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * attended


def kv_bytes_moved(
    shape: ModelShape, num_new_tokens: Sequence[int], context_lens: Sequence[int]
) -> float:
    """KV-cache traffic: each request reads K and V of its whole context (after the step) and
    writes K and V of its new tokens, in every layer."""
    tokens = sum(context_lens) + sum(num_new_tokens)
    return tokens * shape.kv_bytes_per_token()


def step_cost(
    shape: ModelShape,
    num_new_tokens: Sequence[int],
    context_lens: Sequence[int],
    num_logit_tokens: int,
) -> StepCost:
    """FLOPs and bytes of one engine step.

    Request i computes num_new_tokens[i] tokens and holds context_lens[i] tokens after the step
    (so a decode is n=1, context=prompt+generated; a prefill chunk is n=chunk, context=end of
    the chunk). num_logit_tokens is how many tokens go through the lm_head (usually one per
    request that samples). FLOPs = linears + lm_head + attention; bytes = weights read once +
    KV read + KV written. Activations (hidden states, logits) are ignored in both.
    An empty step runs no model and costs nothing.
    """
    if len(num_new_tokens) != len(context_lens):
        raise ValueError(
            f"num_new_tokens and context_lens differ in length "
            f"({len(num_new_tokens)} != {len(context_lens)})"
        )
    for n, c in zip(num_new_tokens, context_lens, strict=True):
        if n < 0 or c < n:
            raise ValueError(f"need 0 <= num_new_tokens <= context_len, got {n} and {c}")
    if num_logit_tokens < 0:
        raise ValueError(f"num_logit_tokens: must be >= 0, got {num_logit_tokens}")
    total_new = sum(num_new_tokens)
    if total_new == 0:
        return StepCost(flops=0.0, bytes_moved=0.0)
    flops = linear_flops(shape, total_new, num_logit_tokens) + attention_flops(
        shape, num_new_tokens, context_lens
    )
    bytes_moved = shape.weight_bytes + kv_bytes_moved(shape, num_new_tokens, context_lens)
    return StepCost(flops=flops, bytes_moved=bytes_moved)


# --------------------------------------------------------------------------------------------
# KV-cache sizing
# --------------------------------------------------------------------------------------------


def kv_cache_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    batch_size: int,
    bytes_per_element: float,
) -> int:
    """Bytes of K and V for batch_size requests of num_tokens tokens:
    2 (K, V) x layers x kv_heads x head_dim x tokens x batch x bytes.
    The model-level KV-size formula: the cost model and the KV calculator call it. The model
    runner sizes its pool from the attention backend's own cache layout instead (a backend may
    pad or, with a quantized KV cache, store scales beside the blocks);
    tests/test_ui_handlers.py::test_engine_pool_matches_the_formula checks the two agree for
    the 16-bit layouts."""
    return int(
        2 * num_layers * num_kv_heads * head_dim * num_tokens * batch_size * bytes_per_element
    )


# Bytes of one stored K or V element by EngineConfig.kv_cache_dtype (None = the model dtype).
KV_STORAGE_BYTES = {"auto": None, "int8": 1, "fp8": 1}
INT8_KV_SCALE_BYTES = 2  # int8 KV: one float16 scale per token and KV head, for K and for V


def kv_bytes_per_element(
    kv_cache_dtype: str, model_bytes_per_element: float, head_dim: int
) -> float:
    """Bytes one K or V element costs in the cache, scales included: the model dtype's size for
    "auto"; 1 for fp8 (its per-layer scales do not grow with tokens); 1 + 2 / head_dim for
    int8 (a float16 scale per head_dim elements: 1.03125 at head_dim 64). Multiplied into
    kv_cache_bytes it gives the pool's real bytes, so the KV plan, the bytes-moved model and
    the KV calculator agree."""
    storage = KV_STORAGE_BYTES[kv_cache_dtype]
    if storage is None:
        return model_bytes_per_element
    if kv_cache_dtype == "int8":
        return storage + INT8_KV_SCALE_BYTES / head_dim
    return storage


def max_concurrency(
    memory_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tokens_per_request: int,
    bytes_per_element: float,
) -> int:
    """How many requests of tokens_per_request tokens fit their whole KV in memory_bytes."""
    per_request = kv_cache_bytes(
        num_layers, num_kv_heads, head_dim, tokens_per_request, 1, bytes_per_element
    )
    if per_request <= 0:
        raise ValueError("one request must need a positive number of KV bytes")
    return int(memory_bytes // per_request)
