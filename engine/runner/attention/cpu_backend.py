"""The CPU attention backend: the C++ paged kernel (kernels/cpu_attention.py) reads each
request's K/V blocks in place, with no gather copy; decodes and prefills (whole prompts,
chunks, prefix hits, draft verification) go to one kernel call per layer.

Cache layout and store are the torch backend's (head-major [Hkv, blocks, bs, D], store_kv):
the kernel reads it through a [blocks, bs, Hkv, D] view. When the kernel cannot be built (no
C++ compiler), the backend says why (`fallback_reason`, a log warning, the UI header) and runs
the torch backend's path instead, so attention_backend="cpu" never stops an engine.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from engine.core.block_manager import cdiv
from engine.runner.attention.base import AttentionInputs, pad_block_tables
from engine.runner.attention.kv_quant import LayerKVCache
from engine.runner.attention.torch_backend import (
    TorchAttentionMetadata,
    TorchBackend,
    store_kv,
    torch_attention,
)

log = logging.getLogger(__name__)


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """Every request of the step in one kernel call: decodes (one query each), then prefills."""

    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [B] int32: context after this step
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32, from 0


class CpuBackend(TorchBackend):
    name = "cpu"
    kv_cache_dtypes = ("auto", "int8", "fp8")  # the kernel dequantizes on load

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fallback_reason: str | None = None  # why the torch path runs instead, if it does
        self._views: dict[int, tuple] = {}  # id(a layer's key cache) -> (key, kernel views)
        if self.device.type != "cpu":
            self.fallback_reason = f"the C++ kernel runs on CPU tensors, not {self.device.type}"
        else:
            # Imported here: `kernels` imports Triton, which the torch path must not need.
            from kernels import cpu_attention

            self.fallback_reason = cpu_attention.cpu_kernel_status()  # builds once (~30 s)
            if not self.fallback_reason:
                # The compiled module: its entry points check every input (ValueError).
                self.extension = cpu_attention.load_extension()
        if self.fallback_reason:
            log.warning("attention_backend='cpu' runs the torch path: %s", self.fallback_reason)

    @property
    def description(self) -> str:
        if self.fallback_reason:
            return f"torch (cpu kernel unavailable: {self.fallback_reason})"
        return "cpu (C++ paged kernel, reads KV blocks in place)"

    def build_metadata(
        self, inputs: AttentionInputs, kv_caches: list[LayerKVCache]
    ) -> TorchAttentionMetadata:
        if self.fallback_reason:
            return super().build_metadata(inputs, kv_caches)
        num_blocks = kv_caches[0][0].shape[1]  # head-major [Hkv, blocks, bs, D]
        seq_lens = inputs.decode_seq_lens + inputs.prefill_ctx_lens
        q_lens = [1] * len(inputs.decode_seq_lens) + inputs.prefill_q_lens
        tables = inputs.decode_block_tables + inputs.prefill_block_tables
        width = cdiv(max(seq_lens), self.block_size) if seq_lens else 0
        dev = self.device
        return CpuAttentionMetadata(
            **self.store_fields(inputs, num_blocks),
            block_tables=pad_block_tables(tables, width, dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(
                [0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev
            ),
        )

    def forward(self, q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float):
        # Called once per layer per step: at batch 1 the kernel is ~10 us, so this wrapper
        # calls the extension's checked entry points directly (no Python-side wrappers).
        cache = kv_cache if type(kv_cache) is LayerKVCache else LayerKVCache(*kv_cache)
        self.calculate_kv_scales_(k, v, cache, meta)  # fp8's first batch: before the store
        if not isinstance(meta, CpuAttentionMetadata):  # the fallback's metadata
            return torch_attention(q, k, v, cache, meta, scale)
        if cache.key_scale is None:  # 16/32-bit K/V: one C++ call stores both
            self.extension.store_kv(cache.key, cache.value, k, v, meta.slot_mapping)
        else:  # quantized on the way in: the torch path's store
            store_kv(cache, k, v, meta.store_index)
        out = torch.empty_like(q)
        if meta.seq_lens.numel() == 0:
            return out
        key, value, k_scale, v_scale = self._kernel_views(cache)
        self.extension.paged_attention(
            out, q, key, value, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            k_scale, v_scale,
        )  # fmt: skip
        return out

    def allocate_kv_caches(self, num_layers: int, num_blocks: int) -> list[LayerKVCache]:
        # Kept views of an earlier pool would keep its memory alive; the new one's are made
        # on first use.
        self._views.clear()
        return super().allocate_kv_caches(num_layers, num_blocks)

    def _kernel_views(self, cache: LayerKVCache) -> tuple:
        """(K, V, K scales, V scales) as the kernel reads them: head-major [Hkv, blocks, bs, ...]
        seen as [blocks, bs, Hkv, ...]. Made once per layer's cache and kept: 2-4 permutes a layer
        (1.5 us each) were ~0.1 ms of a batch-1 token's Python (measured, 2-core EPYC)."""
        views = self._views.get(id(cache.key))
        if views is None or views[0] is not cache.key:  # first use, or a new pool
            k_scale, v_scale = cache.key_scale, cache.value_scale
            if k_scale is not None and k_scale.dim() == 3:  # int8: per token
                k_scale, v_scale = k_scale.permute(1, 2, 0), v_scale.permute(1, 2, 0)
            kernel = (cache.key.permute(1, 2, 0, 3), cache.value.permute(1, 2, 0, 3))
            views = (cache.key, (*kernel, k_scale, v_scale))
            self._views[id(cache.key)] = views
        return views[1]
