"""Incremental detokenization and stop strings.

Decoding one token at a time breaks multi-byte characters and leading spaces, so each step
decodes a small window [prefix_offset, end) and emits only what the newest tokens added
(the approach of vLLM's `detokenize_incrementally`).
"""

from __future__ import annotations

from engine.request import Request

# Tokens of the prompt decoded ahead of the first output token, so spacing comes out right.
_PROMPT_CONTEXT_TOKENS = 5


def init_offsets(request: Request) -> None:
    n = request.num_prompt_tokens
    request.detok_prefix_offset = max(0, n - _PROMPT_CONTEXT_TOKENS)
    request.detok_read_offset = n


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output without concatenating the two lists."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    out = request.output_token_ids
    if start >= n:
        return out[start - n : end - n]
    return prompt[start:] + out[: end - n]


def detokenize_new(tokenizer, request: Request, final: bool = False) -> str:
    """Append the text of the newest tokens to request.output_text; returns the added text.

    A trailing U+FFFD means a multi-byte character is still incomplete: wait for more tokens
    (unless the request is over, then flush whatever there is).
    """
    end = request.num_tokens
    start, read = request.detok_prefix_offset, request.detok_read_offset
    prefix_text = tokenizer.decode(token_slice(request, start, read), skip_special_tokens=True)
    full_text = tokenizer.decode(token_slice(request, start, end), skip_special_tokens=True)
    if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
        return ""
    new_text = full_text[len(prefix_text) :]
    request.detok_prefix_offset = read
    request.detok_read_offset = end
    request.output_text += new_text
    return new_text


def find_stop(text: str, stop: tuple[str, ...], num_new_chars: int) -> int | None:
    """Index where the earliest stop string starts, looking only where new text could match."""
    best = None
    for s in stop:
        window_start = max(0, len(text) - num_new_chars - len(s) + 1)
        i = text.find(s, window_start)
        if i != -1 and (best is None or i < best):
            best = i
    return best


def stop_holdback(stop: tuple[str, ...]) -> int:
    """Characters to hold back while streaming: a partial stop string must not be sent."""
    return max((len(s) for s in stop), default=1) - 1
