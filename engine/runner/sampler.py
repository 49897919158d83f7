"""Sampling as pure functions over a batch of float32 logits [B, V].

Order (as in vLLM / HF): repetition penalty -> temperature -> min-p -> top-k -> top-p -> draw.
Each request draws from its own torch.Generator, so a seeded request gets the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import SamplingParams


def apply_repetition_penalty(
    logits: torch.Tensor, seen_token_ids: Sequence[Sequence[int]], penalties: Sequence[float]
) -> torch.Tensor:
    """CTRL-style penalty on tokens already seen: divide positive logits, multiply negative."""
    logits = logits.clone()
    for row, (seen, penalty) in enumerate(zip(seen_token_ids, penalties, strict=True)):
        if penalty == 1.0 or not seen:
            continue
        ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
        vals = logits[row, ids]
        logits[row, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,  # [B] > 0
    top_k: torch.Tensor,  # [B] int, -1 = off
    top_p: torch.Tensor,  # [B] in (0, 1]
    min_p: torch.Tensor,  # [B] in [0, 1]
) -> torch.Tensor:
    """Filtered, renormalized probabilities [B, V] (float32)."""
    logits = logits / temperature.unsqueeze(1)
    probs = torch.softmax(logits, dim=-1)
    if bool((min_p > 0).any()):
        # min-p: drop tokens less likely than min_p x the most likely one.
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if need_k:
            ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
            k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(1)
            drop |= ranks >= k
        if need_p:
            # Keep the smallest prefix whose mass reaches top_p (the token that crosses stays).
            kept = sorted_probs.masked_fill(drop, 0.0)
            mass_before = kept.cumsum(dim=-1) - kept
            drop |= mass_before >= top_p.unsqueeze(1) * kept.sum(dim=-1, keepdim=True)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index of the max, as torch.argmax; NaN counts as the max).
    Through max(dim) rather than argmax: on CPU torch's argmax of float32 [64, 49152] took
    2.7 ms against max's 0.9 (2-core Xeon), ~3 % of a batch-64 decode step."""
    return logits.max(dim=-1).indices.tolist()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen_token_ids: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Pick one token per row. Greedy rows take the argmax; others draw with their generator."""
    if seen_token_ids is not None and any(p.repetition_penalty != 1.0 for p in params):
        logits = apply_repetition_penalty(
            logits, seen_token_ids, [p.repetition_penalty for p in params]
        )
    tokens = greedy_tokens(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return tokens
    device = logits.device
    rows = torch.tensor(random_rows, device=device)
    sub = [params[i] for i in random_rows]
    probs = logits_to_probs(
        logits[rows],
        torch.tensor([p.temperature for p in sub], device=device),
        torch.tensor([p.top_k for p in sub], device=device),
        torch.tensor([p.top_p for p in sub], device=device),
        torch.tensor([p.min_p for p in sub], device=device),
    )
    for j, i in enumerate(random_rows):
        # One draw per request from its own generator: independent of the batch around it.
        tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return tokens
