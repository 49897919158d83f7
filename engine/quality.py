"""Held-out text and the negative log-likelihood of a model on it: the quality measure that
benchmarks.perplexity and the playground's Compare share (what a quantized weight or KV format
costs). Pure Python: the engine computes the log-probabilities (SamplingParams.prompt_logprobs,
docs/logprobs.md); this module picks the text and averages.

The text is local and fixed: the CPython documentation topics that ship with Python
(`pydoc_data.topics`, ~465k characters, sorted by topic name), so nothing is downloaded and
every run scores the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from engine.request import RequestOutput, SamplingParams

HELD_OUT_TEXT_NAME = "pydoc_data.topics (CPython documentation, sorted by topic)"
# One forward over the window, scoring every token after the first; no token generated.
SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)


def held_out_text(max_chars: int | None = None) -> str:
    """The CPython documentation topics shipped with Python, in a fixed order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return text if max_chars is None else text[:max_chars]


def windows_of(token_ids: Sequence[int], context_len: int, num_windows: int) -> list[list[int]]:
    """The first num_windows non-overlapping windows of context_len tokens (ValueError)."""
    if context_len < 2:
        raise ValueError(
            f"context_len: must be >= 2 (a window scores tokens 1..), got {context_len}"
        )
    windows = [
        list(token_ids[i : i + context_len])
        for i in range(0, len(token_ids) - context_len + 1, context_len)
    ][:num_windows]
    if len(windows) < num_windows:
        raise ValueError(
            f"num_windows: the text has {len(token_ids)} tokens, only {len(windows)} windows of "
            f"{context_len}"
        )
    return windows


def mean_nll(outputs: Iterable[RequestOutput], windows: Sequence[Sequence[int]]) -> float:
    """Mean negative log-likelihood over every scored prompt token of the windows' outputs
    (RuntimeError if the engine scored another number of tokens)."""
    logprobs = [lp.logprob for out in outputs for lp in out.prompt_logprobs or [] if lp]
    expected = sum(len(w) - 1 for w in windows)
    if len(logprobs) != expected:
        raise RuntimeError(f"scored {len(logprobs)} prompt tokens, expected {expected}")
    return -sum(logprobs) / len(logprobs)


def perplexity(nll: float) -> float:
    return math.exp(nll)
