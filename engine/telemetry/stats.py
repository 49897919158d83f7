"""What the engine records and hands to its callers (UI, server): the per-step record
(StepStats), bounded histories (RingBuffer), latency summaries and engine snapshots. Plain data,
no torch; only RingBuffer holds a lock, for the copy."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engine.request import RequestMetrics

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Per-step record
# --------------------------------------------------------------------------------------------


def step_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    """ "prefill", "decode", "mixed" (both in one step) or "idle" (neither)."""
    if num_prefill_tokens and num_decode_tokens:
        return "mixed"
    if num_prefill_tokens:
        return "prefill"
    if num_decode_tokens:
        return "decode"
    return "idle"


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one engine step did; the engine's StepRecorder (engine/telemetry/recorder.py)
    records one per step (keyword-only fields)."""

    step_index: int  # 0, 1, 2, ... since the engine started
    start_time: float  # time.perf_counter() seconds at the start of the step
    duration_s: float  # seconds from schedule to update, model included
    kind: str  # "prefill" | "decode" | "mixed" | "idle" (see step_kind)
    num_prefill_tokens: int  # tokens computed for requests still in prefill (chunks included)
    num_decode_tokens: int  # tokens computed for requests in decode (speculative ones included)
    num_prefill_reqs: int  # requests that prefilled (a chunk or all) this step
    num_decode_reqs: int  # requests that decoded this step
    batch_size: int  # requests in the step (prefill + decode)
    num_running: int  # requests in the running queue after the step
    num_waiting: int  # requests in the waiting queue after the step
    num_preemptions: int  # requests preempted during this step
    num_blocks_used: int  # KV blocks held by requests after the step
    num_blocks_free: int  # KV blocks on the free list after the step
    num_kv_blocks: int  # KV blocks in the pool
    flops: float  # estimated floating-point operations (step_cost)
    bytes_moved: float  # estimated device-memory bytes read + written (step_cost)
    num_blocks_cached: int = 0  # free blocks that still hold a reusable prefix-cache hash
    num_prefix_query_tokens: int = 0  # prompt tokens of requests admitted this step
    num_prefix_hit_tokens: int = 0  # of those, found in the prefix cache (not computed)
    num_draft_tokens: int = 0  # speculative tokens verified this step (in num_decode_tokens)
    num_accepted_tokens: int = 0  # of those, accepted
    # Copy-on-write (parallel sampling): shared KV blocks copied before this step wrote them.
    num_block_copies: int = 0
    # speculative_method="draft": seconds the draft model took (catch-up + k proposals), and
    # the target's verifying forward + verification after it (0 in steps without drafts).
    draft_duration_s: float = 0.0
    verify_duration_s: float = 0.0
    num_spec_proposals: int = 0  # requests that verified drafts this step
    # The draft model's passes this step, estimated like flops / bytes_moved (which are the
    # target's alone): the roofline plots them as points of their own.
    draft_flops: float = 0.0
    draft_bytes_moved: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte; 0 when nothing moved."""
        return self.flops / self.bytes_moved if self.bytes_moved > 0 else 0.0

    @property
    def achieved_flops_per_s(self) -> float:
        """The target's FLOPs over the step's time without the draft model's share."""
        seconds = self.target_duration_s
        return self.flops / seconds if seconds > 0 else 0.0

    @property
    def target_duration_s(self) -> float:
        """Seconds of the step not spent in the draft model (all of it without one)."""
        return self.duration_s - self.draft_duration_s

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes_moved / self.duration_s if self.duration_s > 0 else 0.0


# --------------------------------------------------------------------------------------------
# Bounded history and summaries
# --------------------------------------------------------------------------------------------


class RingBuffer(Generic[T]):
    """Keeps the last `capacity` items. The engine thread appends, UI threads snapshot;
    the lock is held only for the append or the copy."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._items: deque[T] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._total_appended = 0

    @property
    def capacity(self) -> int:
        return self._items.maxlen or 0

    @property
    def total_appended(self) -> int:
        """Items ever appended (including ones since dropped); survives clear()."""
        return self._total_appended

    def append(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            self._total_appended += 1

    def snapshot(self) -> list[T]:
        """A copy of the kept items, oldest first."""
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) of already sorted values, linear interpolation between the two
    nearest ranks (numpy.percentile's default "linear" method)."""
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def latency_summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """mean, median, p90, p99, min, max and count of values (None each when empty)."""
    if not values:
        return dict.fromkeys(("mean", "median", "p90", "p99", "min", "max"), None) | {"count": 0}
    xs = sorted(values)
    return {
        "mean": sum(xs) / len(xs),
        "median": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "min": xs[0],
        "max": xs[-1],
        "count": len(xs),
    }


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    metrics: RequestMetrics


@dataclass(frozen=True)
class RequestProgress:
    """One queued or running request, for the live queue view."""

    request_id: str
    status: str  # "waiting" | "running" | "preempted"
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_output_tokens: int
    max_tokens: int
    num_blocks: int  # KV blocks it holds


@dataclass(frozen=True)
class EngineStats:
    num_kv_blocks: int
    num_free_kv_blocks: int
    block_size: int  # tokens per block
    kv_cache_bytes: int  # bytes of the allocated K and V tensors
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    num_steps_total: int
    # Steps whose forward pass raised; each failed its requests, and is not in num_steps_total.
    num_step_failures_total: int = 0
    # Prefix cache (zero when it is off): prompt tokens looked up and found at admission,
    # free blocks still holding a prefix, cached blocks evicted for new tokens.
    num_prefix_query_tokens_total: int = 0
    num_prefix_hit_tokens_total: int = 0
    num_cached_kv_blocks: int = 0
    num_prefix_evictions_total: int = 0
    # Speculative decoding (zero when off): draft tokens verified, and accepted.
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    # Request-steps that verified drafts (vLLM's spec_decode_num_drafts), and per draft
    # position i (0 = the first draft token): drafts verified there / accepted there.
    num_spec_proposals_total: int = 0
    num_draft_tokens_by_position: tuple[int, ...] = ()
    num_accepted_tokens_by_position: tuple[int, ...] = ()
    # speculative_method="draft": bytes of the draft model's K/V tensors (same blocks).
    draft_kv_cache_bytes: int = 0
    # Parallel sampling: copy-on-write copies of shared KV blocks since start-up.
    num_block_copies_total: int = 0
    # Element type of the K/V in the pool: "bfloat16", "float32", "int8", "float8_e4m3fn"
    # (EngineConfig.kv_cache_dtype resolved); "" where not known (a remote server).
    kv_cache_dtype: str = ""
    # What runs attention: "torch", "cpu (C++ paged kernel, ...)", or a fallback saying why
    # (AttentionBackend.description); "" where not known (a remote server).
    attention_backend: str = ""
    # What runs RMSNorm, RoPE and SiLU-and-mul: "cpu (fused C++ ops)", "triton (fused Triton
    # ops)" (GPUs), "torch", or "torch
    # (fused ops unavailable: why)" (EngineConfig.fused_ops resolved); "" where not known.
    layer_ops: str = ""
    # What the linear layers' many-row products multiply: the model dtype, or "int8" with int8
    # activations (EngineConfig.int8_activations in effect); "" where not known. The roofline
    # takes its compute roof from this dtype's measured peak.
    matmul_dtype: str = ""
    steps: list[StepStats] = field(default_factory=list)  # most recent last
    finished: list[FinishedRequest] = field(default_factory=list)  # most recent last

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens found in the prefix cache (0 when none)."""
        queries = self.num_prefix_query_tokens_total
        return self.num_prefix_hit_tokens_total / queries if queries else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """Fraction of verified draft tokens that were accepted (0 when none)."""
        drafts = self.num_draft_tokens_total
        return self.num_accepted_tokens_total / drafts if drafts else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position: the fraction of drafts verified there that were accepted."""
        return [
            accepted / drafts if drafts else 0.0
            for drafts, accepted in zip(
                self.num_draft_tokens_by_position, self.num_accepted_tokens_by_position,
                strict=True,
            )
        ]  # fmt: skip

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request got per step: accepted drafts + the target's own one
        (vLLM's mean acceptance length; 0 when nothing was verified)."""
        proposals = self.num_spec_proposals_total
        return 1.0 + self.num_accepted_tokens_total / proposals if proposals else 0.0
