"""Engine TokenLogprobs in the OpenAI API's two shapes.

Completions (the legacy shape lm-evaluation-harness reads): parallel lists per token,
    {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
     "text_offset": [int]}
where None marks the first prompt token under `echo` (no context to score it), and each
top_logprobs dict holds the k most likely tokens plus the chosen one (as vLLM returns it).
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]} with exactly top_logprobs alternatives, most likely first.

A token's text is the decode of that one token (a byte-level piece of a multi-byte character
decodes to U+FFFD; "bytes" then carries the replacement's bytes, as vLLM does). Logprobs that
underflow float32 to -inf are sent as -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MIN_LOGPROB = -9999.0  # what -inf becomes on the wire (vLLM's choice too)


class TokenTexts:
    """Token id -> its text as shown in logprobs; cached (a vocabulary's worth at most)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self.tokenizer is None:  # a model without a tokenizer: ids only
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Any],  # TokenLogprob | None per token id
    texts: TokenTexts,
    text_offset: int = 0,  # where the first token's text starts in the choice's text
) -> dict[str, list[Any]]:
    """The completions shape for these tokens; offsets continue from `text_offset`."""
    out: dict[str, list[Any]] = {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
    }  # fmt: skip
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = texts(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(lp.logprob))
        top = {texts(t): _finite(v) for t, v in lp.top}
        top.setdefault(text, _finite(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def next_text_offset(chunk_logprobs: dict[str, list[Any]], start: int) -> int:
    """Where the token after this chunk's last one starts (streaming continues from it)."""
    offsets, tokens = chunk_logprobs["text_offset"], chunk_logprobs["tokens"]
    return offsets[-1] + len(tokens[-1]) if offsets else start


def chat_logprobs(logprobs: Sequence[Any], texts: TokenTexts) -> dict[str, list[Any]]:
    """The chat shape: one entry per generated token with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }
