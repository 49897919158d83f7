"""Sampling as pure functions over a batch of logits [B, V] (float32 or the head's dtype).

Order (as in vLLM): stop tokens masked (min_tokens) -> logit bias -> repetition penalty ->
frequency and presence penalties -> temperature -> min-p -> top-k -> top-p -> draw.
Each request draws from its own torch.Generator, so a seeded request gets the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from engine.request import SamplingParams


class TokenHistory(NamedTuple):
    """What a row's penalties look at: its request's tokens so far, prompt then output
    (Request.all_token_ids), and where the output starts. The repetition penalty counts every
    token; frequency and presence penalties only the output (as OpenAI and vLLM)."""

    token_ids: Sequence[int]
    output_start: int


NO_HISTORY = TokenHistory((), 0)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None = None,
) -> torch.Tensor:
    """Each row's logit bias, repetition penalty, then frequency and presence penalties, in
    float32 (SamplingParams.changes_logits says which rows have any). Rows without any are
    left as they are; no row with any: logits itself, no copy."""
    if not any(p.changes_logits for p in params):
        return logits
    logits = logits.to(torch.float32, copy=True)  # one copy, whatever the dtype
    device = logits.device
    for row, p in enumerate(params):
        if not p.changes_logits:
            continue
        history = histories[row] if histories is not None else NO_HISTORY
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            index = torch.tensor(ids, dtype=torch.long, device=device)
            logits[row, index] += torch.tensor(biases, dtype=torch.float32, device=device)
        if p.repetition_penalty != 1.0 and history.token_ids:
            ids = torch.tensor(sorted(set(history.token_ids)), dtype=torch.long, device=device)
            vals = logits[row, ids]
            penalty = p.repetition_penalty
            logits[row, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
        output = history.token_ids[history.output_start :]
        if (p.frequency_penalty or p.presence_penalty) and output:
            ids, counts = torch.tensor(list(output), dtype=torch.long).unique(return_counts=True)
            ids = ids.to(device)
            logits[row, ids] -= (p.frequency_penalty * counts + p.presence_penalty).to(device)
    return logits


def mask_tokens(logits: torch.Tensor, masked: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """A copy of logits with each row's `masked` token ids at -inf (no mass, never the argmax):
    the stop tokens of a request below its min_tokens. The copy keeps the dtype (-inf is a
    bfloat16 and float16 value too). Nothing masked (None, or only empty rows): logits
    itself, no copy."""
    if masked is None or not any(masked):
        return logits
    logits = logits.clone()
    for row, ids in enumerate(masked):
        if ids:
            index = torch.tensor(sorted(set(ids)), dtype=torch.long, device=logits.device)
            logits[row, index] = float("-inf")
    return logits


# Candidates that top-k / top-p filtering looks at first (torch.topk), before sorting the whole
# vocabulary: sorting [64, 49152] float32 rows took 93 ms on a 2-core Xeon, topk(256) 5 ms. A
# row whose top-p prefix is not inside them (a flat distribution) falls back to the full sort.
TOP_CANDIDATES = 256


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,  # [B] > 0
    top_k: torch.Tensor,  # [B] int, -1 = off
    top_p: torch.Tensor,  # [B] in (0, 1]
    min_p: torch.Tensor,  # [B] in [0, 1]
) -> torch.Tensor:
    """Filtered, renormalized probabilities [B, V] (float32, whatever the logits' dtype).
    Divides in place where the tensor is its own (a [64, 49152] quotient is 12.6 MB to write
    to fresh memory): the same values as out of place."""
    widened = logits.float()  # 16-bit logits: a copy; float32 ones: the caller's tensor
    if widened is logits:
        scaled = widened / temperature.unsqueeze(1)
    else:
        scaled = widened.div_(temperature.unsqueeze(1))
    probs = torch.softmax(scaled, dim=-1)
    if bool((min_p > 0).any()):
        # min-p: drop tokens less likely than min_p x the most likely one.
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    filtered = (top_k > 0) | (top_p < 1.0)
    if bool(filtered.any()):
        if bool(filtered.all()):
            probs = _top_k_top_p(probs, top_k, top_p)
        else:  # rows without top-k / top-p keep every token
            rows = filtered.nonzero().squeeze(1)
            probs = probs.index_copy(0, rows, _top_k_top_p(probs[rows], top_k[rows], top_p[rows]))
    return probs.div_(probs.sum(dim=-1, keepdim=True))  # every probs above is a new tensor


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows that each have a top-k or a top-p, with every token outside that set zeroed (not
    renormalized). A row's ranks come from its largest max(TOP_CANDIDATES, top_k)
    probabilities when its set lies inside them, else from a sort of the whole row: the same
    set either way, up to the order of exactly tied tokens."""
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab)
    # Rows with only a top-k need just their k; a top-p needs room to reach its mass.
    top_p_rows = bool((top_p < 1.0).any()) or bool((top_k <= 0).any())
    width = min(vocab, max(TOP_CANDIDATES if top_p_rows else 1, int(top_k.max())))
    if width == vocab:
        return _sorted_top_k_top_p(probs, k, top_p)
    values, ids = probs.topk(width, dim=-1)  # sorted, largest first
    kept = _first_k(values, k)
    # The mass top-p's prefix is measured against: what top-k keeps of the whole row.
    total = torch.where(k < vocab, kept.sum(dim=-1), probs.sum(dim=-1))
    # A row with a top-k lies inside its candidates (k <= width); one with only a top-p does
    # if the candidates' mass reaches top_p of its total.
    inside = (k < vocab) | (values.sum(dim=-1) >= top_p * total)
    out = torch.zeros_like(probs).scatter_(-1, ids, _top_p_prefix(kept, top_p, total))
    if not bool(inside.all()):  # flat rows: their prefix is longer than the candidates
        rows = (~inside).nonzero().squeeze(1)
        out.index_copy_(0, rows, _sorted_top_k_top_p(probs[rows], k[rows], top_p[rows]))
    return out


def _sorted_top_k_top_p(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    values, ids = probs.sort(dim=-1, descending=True)
    kept = _first_k(values, k)
    return torch.zeros_like(probs).scatter_(-1, ids, _top_p_prefix(kept, top_p, kept.sum(dim=-1)))


def _first_k(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Sorted rows with ranks >= k[row] zeroed."""
    ranks = torch.arange(values.shape[-1], device=values.device).unsqueeze(0)
    return values.masked_fill(ranks >= k.unsqueeze(1), 0.0)


def _top_p_prefix(kept: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Sorted rows (largest first, top-k applied) with the tokens past the smallest prefix
    whose mass reaches top_p x total dropped (the token that crosses stays)."""
    if bool((top_p < 1.0).any()):
        mass_before = kept.cumsum(dim=-1) - kept
        kept = kept.masked_fill(mass_before >= (top_p * total).unsqueeze(1), 0.0)
    return kept


Argmax = Callable[[torch.Tensor], torch.Tensor]
# A fused op taking (logits, temperature, top_k, top_p, min_p, uniforms) to one token per row:
# logits_to_probs + draw_tokens in one call (the model's layer ops: a C++ one on CPU).
SampleRows = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


def greedy_tokens(logits: torch.Tensor, argmax: Argmax | None = None) -> list[int]:
    """Each row's argmax (the first index of the max, as torch.argmax; NaN counts as the max),
    through `argmax` (the model's layer ops: a C++ one on CPU) or max(dim)."""
    if argmax is not None:
        return argmax(logits).tolist()
    return logits.max(dim=-1).indices.tolist()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None,
    argmax: Argmax | None = None,
    sample_rows: SampleRows | None = None,
    masked_token_ids: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Pick one token per row of logits [B, V] (float32, or the head's 16-bit output: greedy
    rows compare them as they are, everything else works in float32). Greedy rows take the
    argmax (through `argmax`, see greedy_tokens); others draw with their generator, one uniform
    each, through `sample_rows` where given (CPU logits) or logits_to_probs + draw_tokens: the
    same distribution either way. `histories`: per row, what its penalties look at (see
    apply_penalties; None: no history, a logit bias still applies). `masked_token_ids`: per
    row, tokens that may not be picked (see mask_tokens); a row's empty sequence masks
    nothing."""
    logits = apply_penalties(mask_tokens(logits, masked_token_ids), params, histories)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    some_greedy = len(random_rows) < len(params)  # else no argmax over the whole batch
    tokens = greedy_tokens(logits, argmax) if some_greedy else [0] * len(params)
    if not random_rows:
        return tokens
    device = logits.device
    sub = [params[i] for i in random_rows]
    rows_logits = logits  # every row samples: no copy of the batch's logits
    if some_greedy:
        rows_logits = logits[torch.tensor(random_rows, device=device)]
    filters = (
        torch.tensor([p.temperature for p in sub], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in sub], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in sub], dtype=torch.float32, device=device),
        torch.tensor([p.min_p for p in sub], dtype=torch.float32, device=device),
    )
    if sample_rows is not None and device.type == "cpu":
        # The uniforms in row order, as draw_tokens takes them: the same stream per generator.
        uniforms = torch.tensor([uniform(generators[i]) for i in random_rows], dtype=torch.float64)
        drawn = sample_rows(rows_logits, *filters, uniforms).tolist()
    else:
        probs = logits_to_probs(rows_logits, *filters)
        drawn = draw_tokens(probs, [generators[i] for i in random_rows])
    for i, token in zip(random_rows, drawn, strict=True):
        tokens[i] = token
    return tokens


def uniform(generator: torch.Generator | None) -> float:
    """One float64 draw in [0, 1) from the request's generator (torch's default one when
    None): the only randomness a sampled token consumes."""
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


# Tokens per block of draw_tokens' two-level search (the vocabulary is padded to whole blocks).
DRAW_BLOCK = 512


def draw_tokens(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of probs [R, V] (non-negative, any positive sum), row r with
    generators[r]: inverse transform sampling, the first token whose cumulative mass exceeds
    u x the row's total for one uniform u per row. So a request's token depends only on its
    row and its generator, whatever shares the batch; and it costs one random number, where
    torch.multinomial drew an exponential per vocabulary entry (~1 ms a row of 49152 on CPU,
    74 ms for 64 rows). Two levels, so that no sum runs long in float32: the block of
    DRAW_BLOCK tokens from the blocks' masses (float64 prefix sums), then the token inside it
    (float64 prefix sums of its DRAW_BLOCK values): a token's chance is its mass over the
    total to ~1e-7 relative, even for a 1e-9 token."""
    rows, vocab = probs.shape
    pad = (-vocab) % DRAW_BLOCK
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs  # no copy when whole
    blocks = padded.reshape(rows, -1, DRAW_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [R, blocks]
    total = block_cdf[:, -1:]
    u = torch.tensor([[uniform(g)] for g in generators], dtype=torch.float64, device=probs.device)
    # Strictly below the total (u x total can round up to it when u is within 2^-53 of 1), so
    # the first block whose prefix sum exceeds it exists and has mass of its own.
    target = torch.minimum(u * total, _below(total))
    block = torch.searchsorted(block_cdf, target, right=True)  # [R, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)]
    inside_cdf = inside.double().cumsum(dim=-1)  # [R, DRAW_BLOCK]
    rest = torch.minimum(target - before, _below(inside_cdf[:, -1:]))
    token = block * DRAW_BLOCK + torch.searchsorted(inside_cdf, rest, right=True)
    return token.squeeze(1).tolist()


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest float64 below each (positive) entry of x."""
    return torch.nextafter(x, torch.zeros_like(x))


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """draw_tokens for one row of probabilities [V]."""
    return draw_tokens(probs.unsqueeze(0), [generator])[0]
