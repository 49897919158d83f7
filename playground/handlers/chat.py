"""Chat logic both backends share: sampling form -> SamplingParams, conversation -> messages,
the stats line under a reply, the streaming throttle, the per-session registry the Stop button
aborts through, and the ChatBackend the tab streams ChatReply updates from: EngineChat
(handlers/chat_engine.py, the in-process engine) or RemoteChat (handlers/chat_remote.py, an
OpenAI-compatible server in remote mode)."""

from __future__ import annotations

import html
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from engine.request import SamplingParams
from playground.handlers.token_probs import TOP_LOGPROBS, TokenProb, probability_html

# Each turn: {"role": "user" | "assistant", "content": text, "stats": line (assistant only),
# "alternatives": the other replies of an n > 1 request (shown beside it, never sent back)}.
Turn = dict[str, Any]
MAX_CHAT_N = 4  # replies side by side: more would not fit the chat column

STREAM_YIELD_INTERVAL_S = 0.05  # at most ~20 UI updates/s per reply, however fast the engine
NOTHING_TO_STOP = "Nothing to stop: no reply is streaming."
# The Chat tab's sampling defaults (its sliders start here; benchmarks.batch1 --sampled times
# them): most chat UIs sample, so this, not greedy, is what a user's first token goes through.
CHAT_TEMPERATURE = 0.7
CHAT_TOP_P = 0.95


def sampling_params(
    temperature: float | None,
    top_p: float | None,
    top_k: float | None,
    max_tokens: float | None,
    seed: float | None,
    n: float | None = 1,
    frequency_penalty: float | None = 0.0,
    presence_penalty: float | None = 0.0,
    repetition_penalty: float | None = 1.0,
    token_probs: bool = False,
) -> SamplingParams:
    """Form numbers (Gradio sends floats or None) -> SamplingParams; ValueError names the field.

    The engine's convention everywhere (Chat, Load test, SamplingParams): top_k -1 = off, 0 is
    refused (it would keep no token); seed -1 = a fresh random seed per reply, else >= 0. A
    fraction is refused, never rounded: the box would still show what the user typed. The
    penalties go to SamplingParams as they are: it checks their ranges and names the field.
    token_probs asks for each token's logprob and its TOP_LOGPROBS alternatives."""
    k = whole("top_k", top_k)
    if k == 0 or k < -1:
        raise ValueError(f"top_k: must be -1 (off) or a whole number >= 1, got {k}")
    s = whole("seed", seed)
    if s < -1:
        raise ValueError(f"seed: must be -1 (random) or a whole number >= 0, got {s}")
    num_replies = whole("n", n)
    if not 1 <= num_replies <= MAX_CHAT_N:
        raise ValueError(f"n: must be a whole number in [1, {MAX_CHAT_N}], got {num_replies}")
    return SamplingParams(
        n=num_replies,
        max_tokens=whole("max_tokens", max_tokens),
        temperature=float(temperature if temperature is not None else -1),
        top_p=float(top_p if top_p is not None else -1),
        top_k=k,
        seed=None if s == -1 else s,
        # A blank field (None) reaches SamplingParams too, which refuses it by name.
        frequency_penalty=frequency_penalty,  # type: ignore[arg-type]
        presence_penalty=presence_penalty,  # type: ignore[arg-type]
        repetition_penalty=repetition_penalty,  # type: ignore[arg-type]
        logprobs=TOP_LOGPROBS if token_probs else None,
    )


def whole(name: str, value: float | None) -> int:
    """A form number that must be whole: 2.5, blank, inf and NaN raise ValueError."""
    if value is None or not math.isfinite(value) or value != int(value):
        raise ValueError(f"{name}: must be a whole number, got {value!r}")
    return int(value)


def build_messages(system_prompt: str, turns: Sequence[Turn], user_message: str) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    messages += [{"role": t["role"], "content": t["content"]} for t in turns]
    messages.append({"role": "user", "content": user_message})
    return messages


class ReplyTimes(Protocol):
    """Seconds, whoever measured them: the engine's RequestMetrics or the client's
    ClientMetrics."""

    @property
    def ttft_s(self) -> float | None: ...
    @property
    def tpot_s(self) -> float | None: ...
    @property
    def e2e_s(self) -> float | None: ...


def stats_line(
    times: ReplyTimes,
    num_tokens: int,
    finish_reason: str | None,
    *,
    chunks_counted: bool = False,
    measured_by: str | None = None,
    prompt_tokens: int | None = None,
    cached_tokens: int | None = None,
    accepted_drafts: int | None = None,
) -> str:
    """TTFT, TPOT, output tokens per second of end-to-end time, token count, and how the reply
    ended. chunks_counted: the count is of content chunks (no usage report; a chunk holds one
    token or more). measured_by: who timed it, when not the engine. Beside TTFT, what it
    depends on: the prompt's length and how much of it the prefix cache held (cached_tokens,
    None when caching is off or unreported); beside TPOT, what lowers it with speculative
    decoding: how many output tokens were accepted drafts (None when it is off)."""
    parts = []
    if times.ttft_s is not None:
        ttft = f"TTFT {times.ttft_s * 1e3:.0f} ms"
        if prompt_tokens:
            cached = "" if cached_tokens is None else f", {cached_tokens} cached"
            ttft += f" (prompt {prompt_tokens} tokens{cached})"
        parts.append(ttft)
    if times.tpot_s is not None:
        tpot = f"TPOT {times.tpot_s * 1e3:.0f} ms"
        if accepted_drafts is not None:
            tpot += f" ({accepted_drafts} of {num_tokens} tokens from accepted drafts)"
        parts.append(tpot)
    e2e_s = times.e2e_s
    if e2e_s and num_tokens:
        parts.append(f"{num_tokens / e2e_s:.1f} tok/s")
    parts.append(
        f"≥{num_tokens} tokens (chunks counted)" if chunks_counted else f"{num_tokens} tokens"
    )
    if measured_by:
        parts.append(measured_by)
    if finish_reason == "abort":
        parts.append("stopped")
    elif finish_reason == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)


class StreamThrottle:
    """Lets at most one update through per interval; the last update always passes. Skipping is
    safe because every update carries the whole reply so far."""

    def __init__(self, interval_s: float = STREAM_YIELD_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_s = -math.inf  # time.monotonic() of the last update let through

    def due(self, last: bool) -> bool:
        now = time.monotonic()
        if last or now - self._last_s >= self.interval_s:
            self._last_s = now
            return True
        return False


# Per reply of a turn (the reply, then its alternatives): its tokens with their probabilities,
# when the Chat tab's token view was on (the turn's "tokens"; ChatReply.tokens while streaming).
ReplyTokens = Sequence[Sequence[TokenProb]]


def render(
    turns: Sequence[Turn],
    streaming: str | None = None,
    live: str = "",
    streaming_alternatives: Sequence[str] = (),
    streaming_tokens: ReplyTokens = (),
) -> list[dict]:
    """Turns -> gr.Chatbot messages; each reply ends with its metrics line. A reply with
    alternatives (n > 1) shows all n side by side, the first being the one that continues. A
    reply with tokens shows them shaded by probability (token_probs.py)."""
    out = []
    for t in turns:
        content = reply_body([t["content"], *t.get("alternatives", ())], t.get("tokens", ()))
        if t.get("stats"):
            content = f"{content}\n\n<sub>{t['stats']}</sub>"
        out.append({"role": t["role"], "content": content})
    if streaming is not None:
        replies = [streaming, *streaming_alternatives]
        body = reply_body(replies, streaming_tokens, cursor=True)
        out.append({"role": "assistant", "content": f"{body}\n\n<sub>{live}</sub>"})
    return out


def reply_body(replies: Sequence[str], tokens: ReplyTokens = (), cursor: bool = False) -> str:
    """One turn's content: the text (Markdown), or the token view when there are tokens; n
    replies in columns."""
    if any(tokens):
        bodies = [probability_html(t, cursor) for t in tokens]
    elif len(replies) == 1:
        return f"{replies[0]} ▌" if cursor else replies[0]
    else:
        bodies = [html.escape(r).replace("\n", "<br>") + (" ▌" if cursor else "") for r in replies]
    return bodies[0] if len(bodies) == 1 else side_by_side(bodies)


def side_by_side(bodies: Sequence[str]) -> str:
    """n replies' HTML bodies in columns (theme.css lays out .pg-replies)."""
    columns = []
    for i, body in enumerate(bodies, start=1):
        label = "Reply 1 (continues)" if i == 1 else f"Reply {i}"
        columns.append(f'<div class="pg-reply"><b>{label}</b><br>{body}</div>')
    return '<div class="pg-replies">' + "".join(columns) + "</div>"


class ChatSessions:
    """Per browser session: whether a reply is streaming, and which conversation is current.

    Clear (or the chatbot's trash icon) starts a new conversation: reset() bumps the session's
    number, so the reply that was streaming sees it is stale, stops, and never writes the old
    turns back. begin() refuses a second reply while one streams (one at a time per session)."""

    def __init__(self) -> None:
        self._conversation: dict[str, int] = {}  # session -> current conversation number
        self._streaming: dict[str, int] = {}  # session -> conversation its reply belongs to
        self._lock = threading.Lock()

    def begin(self, session: str) -> int | None:
        """The conversation number this reply belongs to, or None if one is streaming."""
        with self._lock:
            if session in self._streaming:
                return None
            number = self._conversation.get(session, 0)
            self._streaming[session] = number
            return number

    def current(self, session: str, number: int) -> bool:
        with self._lock:
            return self._conversation.get(session, 0) == number

    def end(self, session: str, number: int) -> None:
        with self._lock:
            if self._streaming.get(session) == number:
                del self._streaming[session]

    def reset(self, session: str) -> None:
        with self._lock:
            self._conversation[session] = self._conversation.get(session, 0) + 1
            self._streaming.pop(session, None)

    def streaming(self, session: str) -> bool:
        with self._lock:
            return session in self._streaming


Handle = TypeVar("Handle")


class ActiveRequests(Generic[Handle]):
    """Which request each browser session is streaming, so Stop aborts the right one. A handle
    is the engine's request id (EngineChat) or the remote ChatStream (RemoteChat)."""

    def __init__(self) -> None:
        self._by_session: dict[str, Handle] = {}
        self._lock = threading.Lock()

    def set(self, session: str, handle: Handle) -> None:
        with self._lock:
            self._by_session[session] = handle

    def clear(self, session: str, handle: Handle) -> None:
        with self._lock:
            if self._by_session.get(session) == handle:
                del self._by_session[session]

    def get(self, session: str) -> Handle | None:
        with self._lock:
            return self._by_session.get(session)


@dataclass(frozen=True)
class ChatReply:
    """One update of a streaming reply, whichever backend produced it."""

    request_id: str | None
    text: str  # the reply so far
    progress: str  # "12 tokens" (engine) or "5 chunks" (remote), for the live line
    finished: bool
    stopped: bool  # aborted by Stop (or by the page going away)
    error: str | None
    stats: str  # the metrics line under a finished reply ("" while streaming)
    alternatives: tuple[str, ...] = ()  # n > 1: replies 2..n so far (text is reply 1)
    tokens: tuple[tuple[TokenProb, ...], ...] = ()  # per reply, when token probs were asked


class ChatBackend(Protocol):
    """What the Chat tab streams from: the in-process engine or a remote server."""

    waiting: str  # the live line before the first update ("waiting for the engine")
    error_label: str  # "Engine error" | "Server error"

    def replies(
        self, messages: list[dict], params: SamplingParams, session: str
    ) -> AsyncIterator[ChatReply]:
        """The reply so far, throttled; the last one is finished. ValueError / RuntimeError:
        refused before it started."""
        ...

    def streaming(self, session: str) -> bool:
        """Whether this browser session has a reply streaming (one at a time)."""
        ...

    def stopped_message(self, request_id: str | None) -> str: ...

    def stop(self, session: str) -> str:
        """Stops the session's reply; says what happened (NOTHING_TO_STOP when none)."""
        ...
