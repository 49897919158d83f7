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

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.runner.attention.kv_quant import (
    SCALE_DTYPES,
    LayerKVCache,
    calculate_fp8_scale_,
    storage_dtype,
)
from engine.runner.host_memory import plain_zeros, zeros_in_huge_pages


def slots_of(block_table: list[int], positions: Iterable[int], block_size: int) -> list[int]:
    """The cache slots of a request's tokens at `positions` (the formula in the module doc)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


@dataclass(frozen=True)
class AttentionInputs:
    """One step's requests as attention sees them (host lists, decode-first order)."""

    slot_mapping: torch.Tensor  # [T] int64 on the device: where each new token's K/V goes
    decode_seq_lens: list[int]  # per decode request: context including its new token
    decode_block_tables: list[list[int]]  # per decode request: its KV blocks
    prefill_q_lens: list[int]  # per prefill request: new tokens this step
    prefill_ctx_lens: list[int]  # per prefill request: context after this step
    prefill_block_tables: list[list[int]]
    # fp8 with calculate_kv_scales: this step is the pool's first, so each layer sets its
    # scales from the step's K/V before storing them (the runner tracks it, once per pool).
    calculate_kv_scales: bool = False


@dataclass
class AttentionMetadata:
    """What every backend's metadata carries; backends subclass it with their own indices."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (-1 = padding)
    num_decode_tokens: int  # decode requests come first, one token each
    prefill_q_lens: list[int] = field(default_factory=list)  # new tokens per prefill request
    prefill_ctx_lens: list[int] = field(default_factory=list)  # context after this step
    calculate_kv_scales: bool = False  # AttentionInputs.calculate_kv_scales


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
    # The EngineConfig.kv_cache_dtype values this backend can store and read.
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)

    def __init__(
        self, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
        device: torch.device, kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False,
        kv_scale_granularity: str = "tensor",
    ) -> None:  # fmt: skip
        if kv_cache_dtype not in self.kv_cache_dtypes:
            raise ValueError(
                f"kv_cache_dtype: attention backend {self.name!r} supports "
                f"{', '.join(self.kv_cache_dtypes)}; got {kv_cache_dtype!r}"
            )
        if calculate_kv_scales and kv_cache_dtype != "fp8":
            raise ValueError("calculate_kv_scales: needs kv_cache_dtype='fp8'")
        if kv_scale_granularity not in ("tensor", "head"):
            raise ValueError(
                f"kv_scale_granularity: must be one of tensor, head; got {kv_scale_granularity!r}"
            )
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size  # tokens per KV block
        self.dtype = dtype  # the model's dtype: queries, outputs, dequantized K/V
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_storage_dtype = storage_dtype(kv_cache_dtype, dtype)
        # CPU: the pool in transparent huge pages (EngineConfig.huge_pages; the runner sets it).
        self.host_huge_pages = True
        # fp8: scales from each layer's first stored batch (kv_quant.py), per layer or head.
        self.calculate_kv_scales = calculate_kv_scales
        self.kv_scales_per_head = kv_scale_granularity == "head"

    @property
    def description(self) -> str:
        """What runs attention, for logs and the UI header (a fallback says so)."""
        return self.name

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and of its V) cache holding `num_blocks` blocks."""

    def kv_scale_shape(self, num_blocks: int) -> tuple[int, ...] | None:
        """Shape of one layer's K (and V) scales: int8 keeps one per token and KV head, laid
        out like the cache without head_dim (same slots, so scales move with their blocks);
        fp8 one per KV head; None when K/V are stored in the model dtype."""
        if self.kv_cache_dtype == "int8":
            return self.kv_cache_shape(num_blocks)[:-1]
        if self.kv_cache_dtype == "fp8":
            return (self.num_kv_heads,)
        return None

    def kv_bytes_per_block(self, num_layers: int) -> int:
        """Bytes one block takes in every layer: K and V, plus int8's per-token scales."""
        data = math.prod(self.kv_cache_shape(1)) * self.kv_storage_dtype.itemsize
        scales = 0
        if self.kv_cache_dtype == "int8":
            scales = math.prod(self.kv_scale_shape(1) or ()) * SCALE_DTYPES["int8"].itemsize
        return 2 * num_layers * (data + scales)

    def kv_fixed_bytes(self, num_layers: int) -> int:
        """Bytes of the pool that do not grow with blocks: fp8's per-layer K/V scales."""
        if self.kv_cache_dtype != "fp8":
            return 0
        return 2 * num_layers * self.num_kv_heads * SCALE_DTYPES["fp8"].itemsize

    def allocate_kv_caches(self, num_layers: int, num_blocks: int) -> list[LayerKVCache]:
        """Zeroed K/V (and scale) tensors for every layer: one [layers, 2, ...] tensor each,
        so the pool's bytes are two allocations whatever the layer count."""
        # Huge pages on CPU: attention reads the pool in scattered pieces (host_memory.py).
        zeros = zeros_in_huge_pages if self.host_huge_pages else plain_zeros
        data = zeros(
            (num_layers, 2, *self.kv_cache_shape(num_blocks)), self.kv_storage_dtype, self.device
        )
        scale_shape = self.kv_scale_shape(num_blocks)
        if scale_shape is None:
            return [LayerKVCache(data[i, 0], data[i, 1]) for i in range(num_layers)]
        # fp8's scales are 1.0, or 0 = "calculate from the first batch" (kv_quant.py says
        # why); int8's are written per token. A new pool (the profiling pass's scratch one
        # too) starts uncalculated, so no batch but the pool's own sets its scales.
        fill = 0.0 if self.calculate_kv_scales else 1.0
        scales = torch.full(
            (num_layers, 2, *scale_shape), fill,
            dtype=SCALE_DTYPES[self.kv_cache_dtype], device=self.device,
        )  # fmt: skip
        return [
            LayerKVCache(data[i, 0], data[i, 1], scales[i, 0], scales[i, 1])
            for i in range(num_layers)
        ]

    def calculate_kv_scales_(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata
    ) -> None:
        """Before a store: in the step that meta marks (the pool's first), fp8 with
        calculate_kv_scales sets the layer's scales from this batch where they are not set
        yet. Other steps skip it on the host: ~10 small ops per layer, measured ~0.25 ms each
        call on a loaded 2-core CPU, would cost more than a decode step's attention."""
        if not (meta.calculate_kv_scales and self.calculate_kv_scales):
            return
        valid = meta.slot_mapping >= 0  # padding tokens (CUDA-graph buckets) store nothing
        assert kv_cache.key_scale is not None and kv_cache.value_scale is not None
        calculate_fp8_scale_(k, valid, kv_cache.key_scale, self.kv_scales_per_head)
        calculate_fp8_scale_(v, valid, kv_cache.value_scale, self.kv_scales_per_head)

    @abstractmethod
    def build_metadata(
        self, inputs: AttentionInputs, kv_caches: list[LayerKVCache]
    ) -> AttentionMetadata:
        """Once per step, before the forward pass: everything the layers share."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: LayerKVCache,  # (or a plain (K, V) tuple when kv_cache_dtype is "auto")
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's K/V in the cache (quantized when kv_cache_dtype says so), then
        attend. Returns [T, Hq, D] in the query's dtype."""

    def graph_metadata(self, buffers: DecodeGraphBuffers, batch: int) -> AttentionMetadata:
        """Metadata over the first `batch` rows of the static buffers (CUDA-graph capture)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not capture graphs")


def pad_block_tables(
    tables: list[list[int]], width: int, device: torch.device
) -> torch.Tensor:  # [len(tables), width] int32, rows cut or padded with block 0
    rows = [t[:width] + [0] * (width - min(len(t), width)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)
