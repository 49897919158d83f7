"""Log-probabilities as a pure function of logits: what SamplingParams.logprobs and
prompt_logprobs return.

They come from the raw model logits, log_softmax(logits) in float32, before the repetition
penalty, temperature, top-k/top-p/min-p (vLLM's default, "raw_logprobs"): a token's logprob
is then a property of the model and the text, the same whatever sampling settings drew it,
which is what scoring (lm-evaluation-harness, perplexity) needs. docs/logprobs.md says more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import TokenLogprob


def token_logprobs(
    logits: torch.Tensor,  # [N, V] float32 raw logits, one row per position
    token_ids: Sequence[int],  # [N] the token that follows each position
    num_top: int,  # k most likely tokens to list per position (0 = none)
) -> list[TokenLogprob]:
    """Each token's logprob and rank at its position, plus the position's top-k."""
    assert logits.shape[0] == len(token_ids), "one row of logits per token"
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1))  # [N, 1]
    # Rank 1 = the most likely; ties share the better rank (as vLLM counts).
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top, dim=-1)  # [N, k], most likely first
        tops = [
            tuple(zip(row_ids, row_vals, strict=True))
            for row_ids, row_vals in zip(top_ids.tolist(), top_vals.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(token_ids)
    return [
        TokenLogprob(int(t), float(lp), int(rank), top)
        for t, lp, rank, top in zip(token_ids, chosen_list, ranks, tops, strict=True)
    ]
