"""CUDA graphs for decode steps: at small batch a decode step is hundreds of tiny kernel
launches, and replaying a captured graph removes the CPU launch overhead between them.

One graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs), captured
at start-up (which also compiles the Triton kernels, so the first request is not slow). A
step with B decodes replays the smallest bucket >= B with its inputs copied into static
buffers and the padding rows made inert: slot -1 (kv_store skips it) and seq_len 0 (the
decode kernel writes zeros). Only pure-decode steps use graphs; prefills run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.core.block_manager import cdiv
from engine.runner.attention.base import AttentionMetadata
from engine.runner.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs + 16, 8)]
    return sorted({min(s, max_num_seqs) for s in sizes})


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = batch_size_buckets(max_num_seqs)
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        device = model.embed_tokens.weight.device
        n = self.buckets[-1]
        # Static input buffers shared by every bucket's graph (a bucket uses the first B rows).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32,
                                        device=device)  # fmt: skip
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, Callable[[], None]] = {}  # bucket -> replay
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            backend="triton",
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_seq_lens=self.seq_lens[:batch],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse the big one's memory pool.
        for batch in reversed(self.buckets):
            meta = self._metadata(batch)
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
        width = max(len(t) for t in block_tables)
        # Host-side staging then one copy per buffer (pinned-free: these are tiny).
        self.input_ids[:batch].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:batch].copy_(torch.tensor(slots), non_blocking=True)
        self.slot_mapping[batch:bucket].fill_(-1)
        self.seq_lens[:batch].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.seq_lens[batch:bucket].fill_(0)
        rows = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        self.block_tables[:batch, :width].copy_(rows, non_blocking=True)
        self.graphs[bucket]()
        return self.outputs[bucket][:batch]
