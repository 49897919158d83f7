"""Chat against a remote OpenAI-compatible server (remote mode): the same form as the local chat,
streamed from POST /v1/chat/completions, the metrics measured here, by the client.

The server applies its own chat template to the messages. Stop closes the HTTP stream; our
server, vLLM and SGLang abort a request whose client disconnects and free its KV blocks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from engine.request import SamplingParams
from playground.handlers.chat import (
    NOTHING_TO_STOP,
    STREAM_YIELD_INTERVAL_S,
    ActiveRequests,
    ChatReply,
)
from playground.remote.client import ChatStream, ClientMetrics, RemoteServer, chat_body

CLIENT_MEASURED = "measured by the client"


def remote_stats_line(metrics: ClientMetrics, finish_reason: str | None) -> str:
    """TTFT (send -> first content chunk, network included), TPOT ((E2E - TTFT) / (tokens - 1)),
    output tokens per second of end-to-end time, token count: all timed by this client."""
    parts = []
    if metrics.ttft_s is not None:
        parts.append(f"TTFT {metrics.ttft_s * 1e3:.0f} ms")
    if metrics.tpot_s is not None:
        parts.append(f"TPOT {metrics.tpot_s * 1e3:.0f} ms")
    n = metrics.num_tokens
    if metrics.e2e_s > 0 and n:
        parts.append(f"{n / metrics.e2e_s:.1f} tok/s")
    # Without the server's usage report (a stopped stream has none) only chunks were counted,
    # and a chunk holds one token or more.
    parts.append(f"{n} tokens" if metrics.tokens_from_usage else f"≥{n} tokens (chunks counted)")
    parts.append(CLIENT_MEASURED)
    if finish_reason == "abort":
        parts.append("stopped")
    elif finish_reason == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)


class RemoteChat:
    """Chat with a remote server; the same interface as handlers_chat.EngineChat."""

    error_label = "Server error"

    def __init__(self, remote: RemoteServer, active: ActiveRequests) -> None:
        self.remote = remote
        self.active = active
        self.waiting = f"waiting for {remote.base_url}"

    async def replies(
        self, messages: list[dict], params: SamplingParams, session: str
    ) -> AsyncIterator[ChatReply]:
        stream = ChatStream(self.remote, chat_body(self.remote.model, messages, params))
        self.active.set(session, stream)
        last_yield = 0.0
        try:
            async with contextlib.aclosing(stream.updates()) as updates:  # leaving closes it
                async for u in updates:
                    now = time.monotonic()
                    if not u.finished and now - last_yield < STREAM_YIELD_INTERVAL_S:
                        continue  # the next update carries the whole text so far
                    last_yield = now
                    stats = remote_stats_line(u.metrics, u.finish_reason) if u.metrics else ""
                    yield ChatReply(
                        u.request_id,
                        u.text,
                        f"{u.num_chunks} chunks",
                        u.finished,
                        u.finish_reason == "abort",
                        u.error,
                        stats,
                    )
        finally:
            self.active.clear(session, stream)

    def stopped_message(self, request_id: str | None) -> str:
        return (
            f"Stopped {request_id or 'the reply'}: closed the stream to {self.remote.base_url} "
            "(our server, vLLM and SGLang then abort the request and free its KV blocks)."
        )

    def stop(self, session: str) -> str:
        stream = self.active.get(session)
        if stream is None:
            return NOTHING_TO_STOP
        stream.stop()
        return self.stopped_message(None)
