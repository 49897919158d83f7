"""Checks a Compare (and a load test) makes before any engine starts, so that a form that
cannot run gets a sentence: an absurd KV budget instead of the allocator's "can't allocate
memory: you tried to allocate 512000000000000 bytes" as each side's error, an n above
max_num_seqs instead of a run whose every request failed."""

from __future__ import annotations

import os

from playground.figures.style import fmt_bytes


def available_memory_bytes(device: str) -> int | None:
    """Memory a side's KV pool can take: a CUDA device's free memory, the host's MemAvailable
    on Linux (else its physical memory); None where neither can be read."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_kv_budget(
    kv_budget_tokens: int, kv_bytes_per_token: int, memory_bytes: int | None
) -> None:
    """ValueError when the budget's K/V alone cannot fit the memory there is: said before a side
    starts, instead of the allocator's "can't allocate memory: you tried to allocate ..."."""
    need = kv_budget_tokens * kv_bytes_per_token
    if memory_bytes is not None and need > memory_bytes:
        raise ValueError(
            f"KV budget: {kv_budget_tokens:,} tokens are {fmt_bytes(need)} of K/V "
            f"({kv_bytes_per_token:,} B a token at the model dtype), more than the "
            f"{fmt_bytes(memory_bytes)} of memory available"
        )


def check_samples_fit(n: int, max_num_seqs: dict[str, int]) -> None:
    """ValueError when the workload's n (samples per prompt) exceeds an engine's max_num_seqs:
    all n sequences of a request run at once, so every request would fail with the engine's
    "n: ... exceed max_num_seqs" and the run report only failures. max_num_seqs: by engine
    ("side A", "the engine")."""
    for where, limit in max_num_seqs.items():
        if n > limit:
            raise ValueError(
                f"n (samples per prompt): {n} is more than {where}'s max_num_seqs of {limit} "
                "(all n samples of a request run at once)"
            )
