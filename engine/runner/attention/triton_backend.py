"""The Triton attention backend: the paged kernels in kernels/ (CUDA, or CPU under
TRITON_INTERPRET=1).

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] (the kernels' layout).
Decodes go to the split-K decode kernel, prefills (and draft verification) to the varlen
prefill kernel; both read block tables and sequence lengths as int32 tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.core.block_manager import cdiv
from engine.runner.attention.base import (
    AttentionBackend,
    AttentionInputs,
    AttentionMetadata,
    DecodeGraphBuffers,
    pad_block_tables,
)
from engine.runner.attention.kv_quant import LayerKVCache


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    # --- decode group (one query token per request) ---
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32, context incl. new token
    # --- prefill group (varlen queries, causal over cached context + new tokens) ---
    prefill_block_tables: torch.Tensor | None = None  # [Bp, max_blocks] int32
    prefill_seq_lens: torch.Tensor | None = None  # [Bp] int32
    prefill_query_start_loc: torch.Tensor | None = None  # [Bp + 1] int32, from 0


class TritonBackend(AttentionBackend):
    name = "triton"
    # The decode kernel's grid and shapes depend on the batch size and the block-table
    # width only, and padding rows (slot -1, seq_len 0) write nothing: graph-safe.
    supports_cuda_graphs = True
    # int8 / fp8: the kernels quantize on store and dequantize after load (kernels/README.md).
    kv_cache_dtypes = ("auto", "int8", "fp8")

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def build_metadata(
        self, inputs: AttentionInputs, kv_caches: list[LayerKVCache]
    ) -> TritonAttentionMetadata:
        dev, bs = self.device, self.block_size
        meta = TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            num_decode_tokens=len(inputs.decode_seq_lens),
            prefill_q_lens=inputs.prefill_q_lens,
            prefill_ctx_lens=inputs.prefill_ctx_lens,
            calculate_kv_scales=inputs.calculate_kv_scales,
        )
        if seq_lens := inputs.decode_seq_lens:
            width = cdiv(max(seq_lens), bs)
            meta.decode_block_tables = pad_block_tables(inputs.decode_block_tables, width, dev)
            meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        if ctx_lens := inputs.prefill_ctx_lens:
            width = cdiv(max(ctx_lens), bs)
            meta.prefill_block_tables = pad_block_tables(inputs.prefill_block_tables, width, dev)
            meta.prefill_seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
            starts = [0, *itertools.accumulate(inputs.prefill_q_lens)]
            meta.prefill_query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        return meta

    def graph_metadata(self, buffers: DecodeGraphBuffers, batch: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=buffers.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=buffers.block_tables[:batch],
            decode_seq_lens=buffers.seq_lens[:batch],
        )

    def forward(self, q, k, v, kv_cache, meta: TritonAttentionMetadata, scale: float):
        import kernels  # imported lazily: the torch backend must not need a working Triton

        cache = LayerKVCache(*kv_cache)
        self.calculate_kv_scales_(k, v, cache, meta)
        k_cache, v_cache = cache.key, cache.value
        scales = {"k_scale": cache.key_scale, "v_scale": cache.value_scale}
        kernels.kv_store(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            kernels.paged_attention_decode(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                out=out[:nd], **scales,
            )  # fmt: skip
        if meta.prefill_q_lens:
            kernels.paged_attention_prefill(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
                meta.prefill_query_start_loc, scale, out=out[nd:], **scales,
            )  # fmt: skip
        return out
