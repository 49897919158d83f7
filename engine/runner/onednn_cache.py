"""Bound the native memory of oneDNN's per-shape caches (issue 11, item 5; docs/serving.md,
"Memory").

On CPU, torch runs bfloat16/float16 matmuls (every linear layer, the decode-attention bmm)
through oneDNN. Each distinct operand shape gets a JIT-compiled primitive that is kept twice:
in oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and in ideep's computation cache
(LRU_CACHE_CAPACITY). Both default to 1,024 entries, and a server sees ever-new shapes (the
step's token count and each decode group's batch and context width vary), so native memory
grows until both caches are full: measured ~0.27 MB per entry per cache, ~0.55 GB on top of
the model for random:tiny, reached only after thousands of requests (looks like a leak).
float32 matmuls go through MKL and cache nothing.

A smaller capacity bounds that growth. It must not be smaller than the shapes a few
consecutive steps use (~20 per step), or every matmul misses: a miss re-JITs the primitive,
measured at ~10 ms per matmul on a 2-core CPU. Both libraries read these variables once, at
their first use, so they must be set before the engine's first forward pass.
"""

from __future__ import annotations

import os

# Entries per cache. 256 covers the shapes of many consecutive steps (the hot set) while
# capping both caches at ~0.14 GB together (measured: docs/serving.md, "Memory").
DEFAULT_CACHE_CAPACITY = 256
CACHE_CAPACITY_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = DEFAULT_CACHE_CAPACITY) -> dict[str, str]:
    """Set both cache capacities unless the user already set them (their value wins).
    Returns the values in effect. ideep crashes with LRU_CACHE_CAPACITY=0, so at least 1."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 (ideep crashes on 0), got {capacity}")
    return {name: os.environ.setdefault(name, str(capacity)) for name in CACHE_CAPACITY_ENV_VARS}
