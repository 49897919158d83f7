"""The KV block pool: free list, per-request block tables, ref counts, and the block map.

Never touches tensors: it hands out block ids; the model runner owns the memory behind them.
Ref counts are kept per block so that shared (prefix-cached) blocks fit the same design: a
block returns to the free list only when its last owner lets go.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Literal

KVLayout = Literal["paged", "contiguous"]


@dataclass(frozen=True)
class BlockSnapshot:
    """The block map at one instant: one entry per block id (index = block id)."""

    num_blocks: int
    block_size: int  # tokens per block
    layout: str
    states: list[str]  # "free" | "used" | "reserved" (contiguous: held but not yet filled)
    owners: list[str | None]  # request id holding the block (first owner when shared)
    tokens_filled: list[int]  # tokens of the block holding K/V
    ref_counts: list[int]

    @property
    def num_free(self) -> int:
        return self.states.count("free")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVLayout = "paged",
        max_model_len: int | None = None,
    ) -> None:
        if layout == "contiguous" and max_model_len is None:
            raise ValueError("max_model_len: the contiguous layout reserves it per request")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout
        # Contiguous: every request reserves its worst case (max_model_len tokens) up front.
        self.reserved_blocks_per_request = cdiv(max_model_len, block_size) if max_model_len else 0
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._owner: list[str | None] = [None] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # tokens each request's table must cover

    # --- queries ---
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks that covering `num_tokens` tokens of this request would take."""
        held = len(self._tables.get(request_id, ()))
        if self.layout == "contiguous":
            return (
                0
                if held
                else max(self.reserved_blocks_per_request, cdiv(num_tokens, self.block_size))
            )
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens holds at most (to reject never-fitting ones)."""
        if self.layout == "contiguous":
            return max(self.reserved_blocks_per_request, cdiv(num_tokens, self.block_size))
        return cdiv(num_tokens, self.block_size)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    # --- changes ---
    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover `num_tokens` tokens; returns the new block ids."""
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: {request_id} needs {needed}, {len(self._free)} free"
            )
        table = self._tables.setdefault(request_id, [])
        new_blocks = [self._free.popleft() for _ in range(needed)]
        for block_id in new_blocks:
            assert self._ref_counts[block_id] == 0, f"block {block_id} handed out twice"
            self._ref_counts[block_id] = 1
            self._owner[block_id] = request_id
        table.extend(new_blocks)
        self._num_tokens[request_id] = max(self._num_tokens.get(request_id, 0), num_tokens)
        return new_blocks

    def free(self, request_id: str) -> int:
        """Release every block of the request; returns how many went back to the free list."""
        table = self._tables.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        if table is None:
            return 0
        released = 0
        # Tail first, so the blocks most recently written are handed out last.
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self._ref_counts[block_id] == 0:
                self._owner[block_id] = None
                self._free.append(block_id)
                released += 1
        return released

    # --- the block map ---
    def snapshot(self) -> BlockSnapshot:
        states = ["free"] * self.num_blocks
        filled = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            remaining = self._num_tokens.get(request_id, 0)
            for block_id in table:
                n = min(self.block_size, max(0, remaining))
                filled[block_id] = n
                states[block_id] = "used" if n else "reserved"
                remaining -= self.block_size
        return BlockSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            layout=self.layout,
            states=states,
            owners=list(self._owner),
            tokens_filled=filled,
            ref_counts=list(self._ref_counts),
        )

    def check_invariants(self) -> None:
        """Every block is either free (ref 0) or referenced by exactly its ref count of tables."""
        refs = collections.Counter(b for table in self._tables.values() for b in table)
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id in range(self.num_blocks):
            assert self._ref_counts[block_id] == refs.get(block_id, 0), f"ref count of {block_id}"
            assert (block_id in free) == (self._ref_counts[block_id] == 0), f"block {block_id}"
