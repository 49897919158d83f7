"""Snapshots the engine hands to its callers (UI, server): plain data, no tensors, no locks."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics import StepStats
from engine.request import RequestMetrics


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
    # Prefix cache (zero when it is off): prompt tokens looked up and found at admission,
    # free blocks still holding a prefix, cached blocks evicted for new tokens.
    num_prefix_query_tokens_total: int = 0
    num_prefix_hit_tokens_total: int = 0
    num_cached_kv_blocks: int = 0
    num_prefix_evictions_total: int = 0
    # Speculative decoding (zero when off): draft tokens verified, and accepted.
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    steps: list[StepStats] = field(default_factory=list)  # most recent last
    finished: list[FinishedRequest] = field(default_factory=list)  # most recent last

    @property
    def num_used_kv_blocks(self) -> int:
        return self.num_kv_blocks - self.num_free_kv_blocks

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
    def kv_cache_usage(self) -> float:
        return self.num_used_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0
