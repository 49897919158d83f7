"""The Chat tab's token-probability view: every token of a reply shaded by the model's
probability of it (the less likely, the darker), its top alternatives on hover, and the
reply's perplexity under the stats line. It shows where a reply was forced and where it was a
coin toss: the tokens a higher temperature, a penalty or a quantized model would change first.

Both backends deliver OpenAI's chat logprobs shape, {"token", "logprob", "top_logprobs":
[{"token", "logprob"}]} per token: a remote server sends it, and the in-process engine's
TokenLogprobs go through the server's own formatter (engine/serving/logprobs_format.py), so
one parser reads both. The probabilities are the raw model's (before temperature, penalties
and top-k/top-p; docs/logprobs.md), so they say what the model thinks, not how it was sampled.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.serving.logprobs_format import TokenTexts, chat_logprobs

TOP_LOGPROBS = 5  # alternatives per token in the hover text (OpenAI allows up to 20)
# Shading: alpha = MAX_ALPHA x (1 - p) over the theme's orange, so a near-certain token is
# plain and an unlikely one stands out.
SHADE_RGB = "249, 115, 22"
MAX_ALPHA = 0.75
NEWLINE_MARK = "↵"  # a newline token gets a visible mark to shade and hover


@dataclass(frozen=True)
class TokenProb:
    text: str
    logprob: float  # natural log, <= 0
    top: tuple[tuple[str, float], ...]  # (token text, logprob), most likely first
    drafted: bool = False  # an accepted speculative draft (the in-process engine says which)

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)


def from_openai(content: Iterable[Any]) -> tuple[TokenProb, ...]:
    """OpenAI chat logprobs' `content` entries -> TokenProbs. The view is a display, so an entry
    a server got wrong (no token, a logprob that is not a number) is left out rather than
    failing the reply; so is a malformed alternative."""
    tokens = []
    for entry in content:
        pair = _token_logprob(entry)
        if pair is None:
            continue
        alternatives = entry.get("top_logprobs")
        top = (_token_logprob(t) for t in (alternatives if isinstance(alternatives, list) else ()))
        tokens.append(TokenProb(*pair, tuple(t for t in top if t is not None)))
    return tuple(tokens)


def _token_logprob(entry: Any) -> tuple[str, float] | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
        return None
    logprob = entry.get("logprob")
    if isinstance(logprob, bool) or not isinstance(logprob, int | float) or math.isnan(logprob):
        return None
    return entry["token"], min(0.0, float(logprob))


def engine_token_probs(
    texts: TokenTexts, logprobs: Sequence[Any] | None, drafted: Sequence[bool] = ()
) -> tuple[TokenProb, ...]:
    """An engine RequestOutput's logprobs (TokenLogprob per output token) -> TokenProbs, through
    the same chat shape the server sends; `drafted` (RequestMetrics.token_drafted, one flag per
    output token) marks the accepted speculative drafts."""
    if not logprobs:
        return ()
    tokens = from_openai(chat_logprobs(logprobs, texts)["content"])
    # The flags live on the engine's metrics, which later steps extend (never rewrite: a stop
    # string cuts only its own step's tokens, before the output is sent), so this output's
    # tokens are the first len(tokens) flags.
    flags = list(drafted[: len(tokens)])
    if len(flags) != len(tokens):
        return tokens
    return tuple(dataclasses.replace(t, drafted=d) for t, d in zip(tokens, flags, strict=True))


class TokensSoFar:
    """One streaming reply's TokenProbs, converted as its logprobs grow: each update converts
    only the entries it has not seen. A reply's logprobs only grow (a stop string cuts its own
    step's tokens before that output is sent), and converting all of them again on every
    update cost ~15 ms per 1,000 tokens, at up to 20 updates a second, on the event loop."""

    def __init__(self) -> None:
        self.num_seen = 0  # entries (engine TokenLogprobs or OpenAI dicts) converted so far
        self.tokens: list[TokenProb] = []

    def from_engine(
        self, texts: TokenTexts, logprobs: Sequence[Any] | None, drafted: Sequence[bool]
    ) -> tuple[TokenProb, ...]:
        new = (logprobs or [])[self.num_seen :]
        self.tokens += engine_token_probs(texts, new, drafted[self.num_seen :])
        self.num_seen += len(new)
        return tuple(self.tokens)

    def from_openai(self, content: Sequence[Any]) -> tuple[TokenProb, ...]:
        new = content[self.num_seen :]
        self.tokens += from_openai(new)
        self.num_seen += len(new)
        return tuple(self.tokens)


def perplexity(tokens: Sequence[TokenProb]) -> float | None:
    """exp(-mean logprob): the number of equally likely choices the model had per token, on
    average (1 = every token certain)."""
    if not tokens:
        return None
    return math.exp(-sum(t.logprob for t in tokens) / len(tokens))


def probability_stats(tokens: Sequence[TokenProb]) -> str:
    """The stats line's addition: ' · perplexity 2.31', or '' without tokens."""
    value = perplexity(tokens)
    return "" if value is None else f" · perplexity {value:.2f}"


def _hover(token: TokenProb) -> str:
    lines = [f"{json_quote(token.text)}  p {token.prob:.3f} (logprob {token.logprob:.2f})"]
    if token.drafted:
        lines.append("an accepted speculative draft")
    if token.top:
        lines.append(f"top {len(token.top)}:")
        lines += [f"  {json_quote(text)}  {math.exp(lp):.3f}" for text, lp in token.top]
    return "&#10;".join(html.escape(line, quote=True) for line in lines)


def json_quote(text: str) -> str:
    """A token's text quoted with its whitespace visible (" the", "\\n")."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\t", "\\t") + '"'


def probability_html(tokens: Sequence[TokenProb], cursor: bool = False) -> str:
    """The reply as shaded token spans, on one line of HTML: the chat's Markdown renderer takes
    a line that opens with <div> as raw HTML (so a token's '*' or '#' stays literal), and a
    newline in it would end that block. theme.css keeps spaces (white-space: pre-wrap)."""
    spans = "".join(_span(token) for token in tokens)
    return '<div class="pg-tokens">' + spans + (" ▌" if cursor else "") + "</div>"


# A streaming reply is drawn again on every update: its earlier tokens' spans come from here.
@functools.lru_cache(maxsize=8192)
def _span(token: TokenProb) -> str:
    alpha = MAX_ALPHA * (1.0 - min(1.0, token.prob))
    text = html.escape(token.text).replace("\n", f"{NEWLINE_MARK}<br>")
    css = "pg-tok pg-drafted" if token.drafted else "pg-tok"
    return (
        f'<span class="{css}" style="background: rgba({SHADE_RGB}, {alpha:.2f})" '
        f'title="{_hover(token)}">{text}</span>'
    )
