"""The attention backend interface, and what every backend's metadata holds in common.

A token at position p of a request lives in slot block_table[p // block_size] * block_size
+ p % block_size. Each backend chooses its per-layer cache layout (`kv_cache_shape`), turns
the step's `AttentionInputs` into its own `AttentionMetadata` subclass once per step, and runs
store + attention per layer (`forward`). Backends never see scheduler types: the model runner
hands them plain lists, so a new backend (quantized KV, a fast CPU path) needs no runner change.

Tokens of a step are packed decode-first: the first `num_decode_tokens` tokens belong to
requests with exactly one new token (decodes), the rest to requests with several (prefills,
whole or chunked, and decodes verifying drafts), in request order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass(frozen=True)
class AttentionInputs:
    """One step's requests as attention sees them (host lists, decode-first order)."""

    slot_mapping: torch.Tensor  # [T] int64 on the device: where each new token's K/V goes
    decode_seq_lens: list[int]  # per decode request: context including its new token
    decode_block_tables: list[list[int]]  # per decode request: its KV blocks
    prefill_q_lens: list[int]  # per prefill request: new tokens this step
    prefill_ctx_lens: list[int]  # per prefill request: context after this step
    prefill_block_tables: list[list[int]]


@dataclass
class AttentionMetadata:
    """What every backend's metadata carries; backends subclass it with their own indices."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (-1 = padding)
    num_decode_tokens: int  # decode requests come first, one token each
    prefill_q_lens: list[int] = field(default_factory=list)  # new tokens per prefill request
    prefill_ctx_lens: list[int] = field(default_factory=list)  # context after this step


@dataclass(frozen=True)
class DecodeGraphBuffers:
    """Static inputs a captured decode graph reads; a bucket of B decodes uses the first B rows.

    Padding rows must be inert in every backend that captures graphs: slot -1 stores nothing
    and seq_len 0 attends to nothing (its output row is ignored).
    """

    slot_mapping: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [n, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [n] int32

    @classmethod
    def allocate(cls, n: int, max_blocks_per_seq: int, device) -> DecodeGraphBuffers:
        return cls(
            torch.full((n,), -1, dtype=torch.long, device=device),
            torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device),
            torch.zeros(n, dtype=torch.int32, device=device),
        )

    def stage(
        self, bucket: int, slots: list[int], block_tables: list[list[int]], seq_lens: list[int]
    ) -> None:
        """Copy a step's B decodes into rows [0, B) and make rows [B, bucket) inert."""
        batch = len(slots)
        width = max(len(t) for t in block_tables)
        # Host-side staging then one copy per buffer (pinned-free: these are tiny).
        self.slot_mapping[:batch].copy_(torch.tensor(slots), non_blocking=True)
        self.slot_mapping[batch:bucket].fill_(-1)
        self.seq_lens[:batch].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.seq_lens[batch:bucket].fill_(0)
        rows = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        self.block_tables[:batch, :width].copy_(rows, non_blocking=True)


class AttentionBackend(ABC):
    """Stores a step's K/V in the paged cache and attends, for one cache layout."""

    name: ClassVar[str]
    # Whether decode steps may be captured in CUDA graphs over `DecodeGraphBuffers` (the
    # backend's decode path must then have shapes fixed by the batch size alone).
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether the runner should order decode requests by context length (shortest first).
    sort_decodes_by_length: ClassVar[bool] = False

    def __init__(
        self, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size  # tokens per KV block
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and of its V) cache holding `num_blocks` blocks."""

    @abstractmethod
    def build_metadata(
        self, inputs: AttentionInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> AttentionMetadata:
        """Once per step, before the forward pass: everything the layers share."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's K/V in the cache, then attend. Returns [T, Hq, D]."""

    def graph_metadata(self, buffers: DecodeGraphBuffers, batch: int) -> AttentionMetadata:
        """Metadata over the first `batch` rows of the static buffers (CUDA-graph capture)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not capture graphs")


def pad_block_tables(
    tables: list[list[int]], width: int, device: torch.device
) -> torch.Tensor:  # [len(tables), width] int32, rows cut or padded with block 0
    rows = [t[:width] + [0] * (width - min(len(t), width)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)
