"""Speculative decoding: propose drafts (n-gram lookup here; a draft model in
engine/runner/draft_model.py), then verify them in one step of the target.

Propose: the last n tokens of a request (n from prompt_lookup_max down to prompt_lookup_min)
are looked up earlier in its own prompt + output; the k tokens that followed their latest
earlier occurrence are the draft. Text that copies from its context (code edits, quotes,
summaries, structured output) is where this guesses right. No draft model, no extra compute.

Verify: the step feeds [last token, d_1 .. d_k] through the model at once (like a short
prefill over the cached context) and gets k + 1 rows of logits; row i is the model's
distribution p_i for the token after d_1 .. d_i. Tokens are then accepted in order:
- greedy: d_i is kept while it equals argmax p_{i-1}; the first mismatch is replaced by the
  argmax, so the output is exactly what one-token decoding would have produced;
- sampling (rejection sampling, Leviathan et al., 2023): d_i, drawn from the draft's
  distribution q_{i-1}, is kept with probability min(1, p_{i-1}(d_i) / q_{i-1}(d_i)); on the
  first rejection a token is drawn from norm(max(0, p_{i-1} - q_{i-1})). Then every output
  token is distributed exactly as p. N-gram drafts are q = one-hot: keep with p(d_i), else
  draw from p with d_i removed;
- if all k are kept, one more token is taken from p_k (the bonus token).
So a step yields 1 to k + 1 tokens for the cost of one forward pass over k + 1 positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from engine.config import EngineConfig
from engine.request import Request, SamplingParams
from engine.runner.sampler import (
    NO_HISTORY,
    TokenHistory,
    apply_penalties,
    draw_token,
    logits_to_probs,
    mask_tokens,
    uniform,
)


class NgramProposer:
    """Drafts for the requests about to decode; the scheduler carries them to the runner in
    ScheduledRequest.draft_token_ids (cut to the step's token budget)."""

    def __init__(self, config: EngineConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, running: Iterable[Request]) -> dict[str, list[int]]:
        """Request id -> draft for every running request that is decoding (none for those
        still prefilling, or without a recurring suffix), capped so that even if all are
        accepted the request stays within max_tokens and max_model_len."""
        drafts = {}
        for request in running:
            if request.num_computed_tokens + 1 != request.num_tokens:
                continue  # still prefilling
            if not request.output_token_ids:
                # The first token comes from the prompt's last logits, without drafts: so
                # does a parallel-sampling sequence's (it computes the last prompt token on
                # its own), which keeps sample i equal to a lone request seeded seed + i.
                continue
            room = draft_room(request, self.num_speculative_tokens)
            draft = propose_ngram(request.all_token_ids, room, self.min_n, self.max_n)
            if draft:
                drafts[request.request_id] = draft
        return drafts


class DraftSlotProposer:
    """speculative_method="draft": how many tokens the runner's draft model proposes for each
    decoding request (the scheduler reserves that many slots after its last token; the model
    runner drafts them at the start of the step, batched, then the target verifies them)."""

    def __init__(self, config: EngineConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, running: Iterable[Request]) -> dict[str, int]:
        """Request id -> draft slots, for the same requests and limits as n-gram drafts."""
        slots = {}
        for request in running:
            if request.num_computed_tokens + 1 != request.num_tokens:
                continue  # still prefilling
            if not request.output_token_ids:
                continue  # the first token comes from the prompt alone (see NgramProposer)
            room = draft_room(request, self.num_speculative_tokens)
            if room > 0:
                slots[request.request_id] = room
        return slots


def draft_room(request: Request, num_speculative_tokens: int) -> int:
    """Draft tokens a decoding request may verify: capped so that even if all are accepted it
    stays within max_tokens and max_model_len."""
    return min(
        num_speculative_tokens,
        request.params.max_tokens - request.num_output_tokens - 1,
        request.max_total_tokens - request.num_tokens - 1,
    )


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` draft tokens: what followed the latest earlier occurrence of the
    longest suffix (max_n down to min_n tokens) of `token_ids`; [] when none recurs."""
    if num_tokens < 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Every window of n tokens except the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the most recent context
            return tokens[start : start + num_tokens].tolist()
    return []


def verify(
    logits: torch.Tensor,  # [k + 1, V], float32 or the head's dtype: [last token, d_1 .. d_k]
    draft: Sequence[int],  # d_1 .. d_k
    params: SamplingParams,
    generator: torch.Generator | None,
    history: TokenHistory = NO_HISTORY,  # prompt + output so far (for the penalties)
    draft_probs: torch.Tensor | None = None,  # [k, V] q_0 .. q_{k-1}; None = one-hot drafts
    masked_token_ids: Sequence[Sequence[int]] | None = None,  # per row (min_tokens' stops)
) -> list[int]:
    """The tokens this step produces for one request: accepted drafts plus one more. Masked
    tokens have no target mass, so a draft of one is rejected and never drawn again: the
    tokens keep the distribution one-token decoding with the same mask gives."""
    assert logits.shape[0] == len(draft) + 1, "one row of logits per draft token, plus one"
    logits = mask_tokens(logits, masked_token_ids)
    probs = _target_probs(logits, draft, params, history)
    if params.greedy:  # keep drafts while they are the argmax; then the argmax itself
        targets = probs.argmax(dim=-1).tolist()
        out = []
        for drafted, target in zip(draft, targets, strict=False):
            out.append(target)
            if drafted != target:
                return out
        return [*out, targets[len(draft)]]
    out = []
    for i, drafted in enumerate(draft):
        p = probs[i]
        if draft_probs is None:  # one-hot q: accept with p(d)
            accept = float(p[drafted])
        else:  # accept with min(1, p(d) / q(d)); q(d) > 0 as d was drawn from q
            accept = float(p[drafted] / draft_probs[i, drafted].clamp_min(1e-30))
        draw = uniform(generator)
        if accept >= 1.0 or draw < accept:
            out.append(int(drafted))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[drafted] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q (rounding): the rejection had p(d) < q(d)
            residual = p
        out.append(draw_token(residual, generator))
        return out
    return [*out, draw_token(probs[len(draft)], generator)]


def _target_probs(
    logits: torch.Tensor, draft: Sequence[int], params: SamplingParams, history: TokenHistory
) -> torch.Tensor:
    """p_0 .. p_k after the request's processing (for greedy requests the penalized logits,
    compared only by argmax). Row i's penalties also count the drafts before it, as one-token
    decoding would have seen them."""
    rows = logits.shape[0]
    if params.changes_logits:
        token_ids, start = history
        histories = [TokenHistory([*token_ids, *draft[:i]], start) for i in range(rows)]
        logits = apply_penalties(logits, [params] * rows, histories)
    if params.greedy:
        return logits
    device = logits.device

    def column(value: float | int) -> torch.Tensor:
        return torch.full((rows,), value, device=device)

    return logits_to_probs(
        logits,
        column(params.temperature),
        column(params.top_k).long(),
        column(params.top_p),
        column(params.min_p),
    )
