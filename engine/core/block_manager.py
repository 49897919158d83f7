"""The KV block pool: free list, per-request block tables, ref counts, and the block map.

Never touches tensors: it hands out block ids; the model runner owns the memory behind them.
A block returns to the free list only when its last owner lets go (ref count 0).

Prefix caching (`enable_prefix_caching`, paged layout only), in the vLLM v1 style:
- Once a block is full of computed tokens it gets a key chained over everything before it,
  hash((parent key, its block_size token ids)); the map key -> block finds it again.
- A new request looks up its longest run of cached full blocks (`lookup_prefix`), shares
  them (ref count + 1) and computes only the rest. At least one prompt token is always
  left to compute, since the model must produce logits for the next token.
- A freed block keeps its key and sits on the free list as "cached": reusable until it is
  handed out for new tokens, which evicts it (least recently freed first; a request's tail
  blocks are freed first, so the shared heads of prompts outlive them).
A cached prefix is only ever full blocks, and a request writes K/V only past its cached
prefix, so prefix sharing never writes a shared block.

Parallel sampling (SamplingParams.n > 1) shares more: `fork` gives a new sequence the whole
table of the one it forks from, the last, partly filled block included (ref count + 1 each).
The first sequence that writes into a block others still hold gets a private copy first
(`copy_on_write`: a fresh block and a (source, destination) pair the model runner copies
before the step's forward pass); the last holder writes in place.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import KVLayout


@dataclass(frozen=True)
class BlockSnapshot:
    """The block map at one instant: one entry per block id (index = block id)."""

    num_blocks: int
    block_size: int  # tokens per block
    layout: str
    # "free" | "cached" (free, but holds a prefix-cache hit) | "used" | "reserved" (contiguous:
    # held but not yet filled)
    states: list[str]
    owners: list[str | None]  # request id holding the block (first owner when shared)
    tokens_filled: list[int]  # tokens of the block holding K/V
    ref_counts: list[int]

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take (cached ones included: taking one evicts it)."""
        return self.states.count("free") + self.states.count("cached")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVLayout = "paged",
        max_model_len: int | None = None,
        enable_prefix_caching: bool = False,
    ) -> None:
        if layout == "contiguous" and max_model_len is None:
            raise ValueError("max_model_len: the contiguous layout reserves it per request")
        if layout == "contiguous" and enable_prefix_caching:
            raise ValueError("enable_prefix_caching: needs kv_layout='paged'")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout
        # Contiguous: every request reserves its worst case (max_model_len tokens) up front.
        self.reserved_blocks_per_request = cdiv(max_model_len, block_size) if max_model_len else 0
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks in eviction order (oldest first); an OrderedDict so that a cached block
        # a new request shares can leave the middle of the list in O(1).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_blocks)
        )
        self._ref_counts = [0] * num_blocks
        self._owner: list[str | None] = [None] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # tokens each request's table must cover
        # --- prefix cache ---
        self._key_of_block: list[int | None] = [None] * num_blocks
        self._block_of_key: dict[int, int] = {}
        self._tokens_of_block: list[tuple[int, ...] | None] = [None] * num_blocks
        # Per request: (leading blocks already keyed, key of the last of them). The key is kept
        # here because a block whose key was cached elsewhere first carries none itself.
        self._chain: dict[str, tuple[int, int | None]] = {}
        self.num_evictions_total = 0  # cached blocks handed out for new tokens
        self.num_block_copies_total = 0  # copy-on-write copies of shared blocks
        self._num_cached_free = 0  # free blocks with a key (counted, not scanned, per step)

    # --- queries ---
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (the block map's "cached")."""
        return self._num_cached_free

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks_needed(
        self, request_id: str, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> int:
        """Free-list blocks that covering `num_tokens` tokens of this request would take
        (shared prefix blocks that are free right now count: sharing takes them off the list)."""
        held = len(self._tables.get(request_id, ()))
        if prefix_blocks:
            revived = sum(self._ref_counts[b] == 0 for b in prefix_blocks)
            return max(0, cdiv(num_tokens, self.block_size) - len(prefix_blocks)) + revived
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

    def can_allocate(
        self, request_id: str, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> bool:
        return self.blocks_needed(request_id, num_tokens, prefix_blocks) <= len(self._free)

    def lookup_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest run of `token_ids`' leading full blocks,
        leaving at least the last token to compute. Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        parent = None
        bs = self.block_size
        for index in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            key = hash((parent, tokens))
            block_id = self._block_of_key.get(key)
            if block_id is None or self._tokens_of_block[block_id] != tokens:
                break  # a miss (the token comparison guards against a hash collision)
            blocks.append(block_id)
            parent = key
        return blocks

    def num_shared_blocks(self, request_id: str, start: int, end: int) -> int:
        """Blocks of the request holding token positions [start, end) that other sequences
        also hold: writing there needs a private copy first (copy_on_write)."""
        return len(self._shared_indices(request_id, start, end))

    def _shared_indices(self, request_id: str, start: int, end: int) -> list[int]:
        table = self._tables.get(request_id, ())
        last = min(len(table), -(-end // self.block_size))  # blocks past the table are new
        return [i for i in range(start // self.block_size, last) if self._ref_counts[table[i]] > 1]

    # --- changes ---
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref count + 1), the partly filled
        last one included: parallel sampling's shared prompt."""
        assert child_id not in self._tables, f"{child_id} already holds blocks"
        table = list(self._tables.get(parent_id, ()))
        for block_id in table:
            self._ref_counts[block_id] += 1
        self._tables[child_id] = table
        self._num_tokens[child_id] = self._num_tokens.get(parent_id, 0)
        if parent_id in self._chain:
            self._chain[child_id] = self._chain[parent_id]

    def copy_on_write(self, request_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """Before the request writes token positions [start, end): swap a private copy in
        for each block there that others still hold. Returns (source, destination) pairs for
        the runner to copy. The caller made sure enough blocks are free (num_shared_blocks).
        In the paged layout only the first block can be shared (the blocks after it are new);
        the contiguous layout's reservation is shared whole, so any can be."""
        table = self._tables.get(request_id, [])
        copies = []
        for index in self._shared_indices(request_id, start, end):
            source = table[index]
            destination = self._take_free_block()
            self._ref_counts[destination] = 1
            self._owner[destination] = request_id
            self._ref_counts[source] -= 1  # > 0: others still hold it
            table[index] = destination
            copies.append((source, destination))
        self.num_block_copies_total += len(copies)
        return copies

    def allocate(
        self, request_id: str, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> list[int]:
        """Grow the request's table to cover `num_tokens` tokens; returns the new block ids.

        `prefix_blocks` (from lookup_prefix, for a request with no blocks yet) start the table
        shared instead of fresh.
        """
        needed = self.blocks_needed(request_id, num_tokens, prefix_blocks)
        if needed > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: {request_id} needs {needed}, {len(self._free)} free"
            )
        table = self._tables.setdefault(request_id, [])
        if prefix_blocks:
            assert not table, f"{request_id}: prefix blocks for a request that holds blocks"
            for block_id in prefix_blocks:
                if self._ref_counts[block_id] == 0:
                    del self._free[block_id]  # cached and free: back in use
                    self._num_cached_free -= 1
                    self._owner[block_id] = request_id
                    needed -= 1
                self._ref_counts[block_id] += 1
            table.extend(prefix_blocks)
            self._chain[request_id] = (len(prefix_blocks), self._key_of_block[prefix_blocks[-1]])
        new_blocks = [self._take_free_block() for _ in range(needed)]
        for block_id in new_blocks:
            assert self._ref_counts[block_id] == 0, f"block {block_id} handed out twice"
            self._ref_counts[block_id] = 1
            self._owner[block_id] = request_id
        table.extend(new_blocks)
        self._num_tokens[request_id] = max(self._num_tokens.get(request_id, 0), num_tokens)
        return new_blocks

    def _take_free_block(self) -> int:
        """The oldest free block; a cached one loses its prefix (evicted)."""
        block_id, _ = self._free.popitem(last=False)
        key = self._key_of_block[block_id]
        if key is not None:
            del self._block_of_key[key]
            self._key_of_block[block_id] = None
            self._tokens_of_block[block_id] = None
            self.num_evictions_total += 1
            self._num_cached_free -= 1
        return block_id

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int
    ) -> None:
        """Key the request's blocks that are now full of computed tokens, so later requests
        with the same prefix find them. A block whose key is already cached elsewhere (two
        requests computed the same prefix at once) stays private."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        bs = self.block_size
        start, parent = self._chain.get(request_id, (0, None))
        end = min(num_computed // bs, len(table))
        for index in range(start, end):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            key = hash((parent, tokens))
            block_id = table[index]
            if key not in self._block_of_key and self._key_of_block[block_id] is None:
                self._block_of_key[key] = block_id
                self._key_of_block[block_id] = key
                self._tokens_of_block[block_id] = tokens
            parent = key
        if end > start:
            self._chain[request_id] = (end, parent)

    def free(self, request_id: str) -> int:
        """Release every block of the request; returns how many went back to the free list."""
        table = self._tables.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        self._chain.pop(request_id, None)
        if table is None:
            return 0
        released = 0
        # Tail first: the tail joins the eviction order before the head, so the heads of
        # prompts (the likeliest prefixes to come again) stay cached longest.
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self._ref_counts[block_id] == 0:
                self._owner[block_id] = None
                self._free[block_id] = None
                self._num_cached_free += self._key_of_block[block_id] is not None
                released += 1
        return released

    # --- the block map ---
    def snapshot(self) -> BlockSnapshot:
        states = ["free"] * self.num_blocks
        filled = [0] * self.num_blocks
        for block_id in self._free:
            if self._key_of_block[block_id] is not None:
                states[block_id] = "cached"
                filled[block_id] = self.block_size
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
        for key, block_id in self._block_of_key.items():
            assert self._key_of_block[block_id] == key, f"prefix key of block {block_id}"
        assert sum(k is not None for k in self._key_of_block) == len(self._block_of_key)
        cached_free = sum(self._key_of_block[b] is not None for b in self._free)
        assert self._num_cached_free == cached_free, "count of cached free blocks"
