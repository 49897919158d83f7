"""CUDA graphs for decode steps: at small batch a decode step is hundreds of tiny kernel
launches, and replaying a captured graph removes the CPU launch overhead between them.

One graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs), captured
at start-up (which also compiles the Triton kernels, so the first request is not slow). A
step with B decodes replays the smallest bucket >= B with its inputs copied into static
buffers and the padding rows made inert: slot -1 (stores nothing) and seq_len 0 (attends to
nothing). The attention backend says whether it can be captured and builds its metadata over
those buffers (AttentionBackend.graph_metadata). Only pure-decode steps use graphs; prefills
run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.core.block_manager import cdiv
from engine.runner.attention.base import AttentionBackend, DecodeGraphBuffers
from engine.runner.attention.kv_quant import LayerKVCache
from engine.runner.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs + 16, 8)]
    return sorted({min(s, max_num_seqs) for s in sizes})


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attn_backend: AttentionBackend,
        kv_caches: list[LayerKVCache],
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        if not attn_backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {attn_backend.name!r} cannot be graph-captured")
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.buckets = batch_size_buckets(max_num_seqs)
        self.max_blocks_per_seq = cdiv(max_model_len, attn_backend.block_size)
        device = model.embed_tokens.weight.device
        n = self.buckets[-1]
        # Static input buffers shared by every bucket's graph (a bucket uses the first B rows).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.attn_buffers = DecodeGraphBuffers.allocate(n, self.max_blocks_per_seq, device)
        self.graphs: dict[int, Callable[[], None]] = {}  # bucket -> replay
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse the big one's memory pool.
        for batch in reversed(self.buckets):
            meta = self.attn_backend.graph_metadata(self.attn_buffers, batch)
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
            self.outputs[batch] = self._capture_bucket(batch, args)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def _capture_bucket(self, batch: int, args: tuple) -> torch.Tensor:
        """Warm up, then record one forward pass into a graph; returns its static output.

        (The one CUDA-only part: tests on CPU swap it for a re-run of the forward pass, so the
        static buffers, padding and bucket choice around it are tested without a GPU.)
        """
        self.model(*args)  # warm-up: Triton compiles and autotunes outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.model(*args)
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize()
        self.graphs[batch] = graph.replay
        return output

    def can_run(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.buckets[-1]

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """Replay the bucket's graph; returns hidden states [B, hidden] for the real rows."""
        batch = len(input_ids)
        bucket = next(b for b in self.buckets if b >= batch)
        # Host-side staging then one copy per buffer (pinned-free: these are tiny).
        self.input_ids[:batch].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions), non_blocking=True)
        self.attn_buffers.stage(bucket, slots, block_tables, seq_lens)
        self.graphs[bucket]()
        return self.outputs[bucket][:batch]
