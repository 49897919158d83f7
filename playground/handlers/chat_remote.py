"""Chat against a remote OpenAI-compatible server (remote mode): the same form as the local chat,
streamed from POST /v1/chat/completions, the metrics measured here, by the client. The
ChatBackend of remote mode.

The server applies its own chat template to the messages. Stop closes the HTTP stream; our
server, vLLM, SGLang and llama.cpp abort a request whose client disconnects and free its
KV cache (llama.cpp frees the slot).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engine.request import SamplingParams
from playground.handlers.chat import (
    NOTHING_TO_STOP,
    ActiveRequests,
    ChatReply,
    StreamThrottle,
    stats_line,
)
from playground.handlers.token_probs import TokensSoFar, probability_stats
from playground.remote.chat import ChatStream, ChatUpdate, chat_body, check_remote_params
from playground.remote.client import RemoteServer

CLIENT_MEASURED = "measured by the client"
# A server that ignores `logprobs: true` sends none: the reply shows as text, and says why.
NO_LOGPROBS = " · the server sent no token probabilities"


def remote_stats_line(update: ChatUpdate) -> str:
    """The finished reply's stats as this client timed them: TTFT is send -> first content
    chunk (network included), TPOT (E2E - TTFT) / (tokens - 1)."""
    m = update.metrics
    if m is None:
        return ""
    # Without the server's usage report (a stopped stream has none) only chunks were counted.
    usage = update.usage if isinstance(update.usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return stats_line(
        m,
        m.num_tokens,
        update.finish_reason,
        chunks_counted=not m.tokens_from_usage,
        measured_by=CLIENT_MEASURED,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        cached_tokens=_count(cached),  # OpenAI's field; vLLM and ours fill it
    )


def _count(value: object) -> int | None:
    """A token count from the server's usage report, or None if it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class RemoteChat:
    """Chat with a remote server; Stop closes the stream."""

    error_label = "Server error"

    def __init__(
        self, remote: RemoteServer, active: ActiveRequests[ChatStream] | None = None
    ) -> None:
        self.remote = remote
        self.active = active if active is not None else ActiveRequests[ChatStream]()
        self.waiting = f"waiting for {remote.base_url}"

    async def replies(
        self, messages: list[dict], params: SamplingParams, session: str
    ) -> AsyncIterator[ChatReply]:
        check_remote_params(params)
        stream = ChatStream(self.remote, chat_body(self.remote.model, messages, params))
        self.active.set(session, stream)
        throttle = StreamThrottle()
        so_far = TokensSoFar()
        try:
            async with contextlib.aclosing(stream.updates()) as updates:  # leaving closes it
                async for u in updates:
                    if not throttle.due(u.finished):
                        continue  # the next update carries the whole text so far
                    tokens = (so_far.from_openai(u.logprobs),) if u.logprobs else ()
                    stats = remote_stats_line(u)  # "" until the last update
                    if stats and params.logprobs is not None:
                        stats += probability_stats(tokens[0]) if tokens else NO_LOGPROBS
                    yield ChatReply(
                        u.request_id,
                        u.text,
                        f"{u.num_chunks} chunks",
                        u.finished,
                        u.finish_reason == "abort",
                        u.error,
                        stats,
                        tokens=tokens,
                    )
        finally:
            self.active.clear(session, stream)

    def streaming(self, session: str) -> bool:
        return self.active.get(session) is not None

    def stopped_message(self, request_id: str | None) -> str:
        return (
            f"Stopped {request_id or 'the reply'}: closed the stream to {self.remote.base_url} "
            "(our server, vLLM, SGLang and llama.cpp then abort the request and free its KV cache)."
        )

    def stop(self, session: str) -> str:
        stream = self.active.get(session)
        if stream is None:
            return NOTHING_TO_STOP
        stream.stop()
        return self.stopped_message(None)
