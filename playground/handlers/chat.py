"""Chat logic: sampling form -> SamplingParams, conversation -> chat template -> engine stream,
per-reply metrics, and the per-session registry the Stop button aborts through.

The tab streams ChatReply updates from a backend: EngineChat here (the in-process engine), or
handlers_chat_remote.RemoteChat (an OpenAI-compatible server, in remote mode)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams
from engine.request import RequestMetrics, RequestOutput

# Each turn: {"role": "user" | "assistant", "content": text, "stats": line (assistant only)}.
Turn = dict[str, str]

STREAM_YIELD_INTERVAL_S = 0.05  # at most ~20 UI updates/s per reply, however fast the engine


def sampling_params(
    temperature: float | None,
    top_p: float | None,
    top_k: float | None,
    max_tokens: float | None,
    seed: float | None,
) -> SamplingParams:
    """Form numbers (Gradio sends floats or None) -> SamplingParams; ValueError names the field.

    top_k 0 or -1 means off; seed blank or -1 means a fresh random seed per reply."""

    def whole(name: str, value: float | None) -> int:
        if value is None or value != int(value):
            raise ValueError(f"{name}: must be a whole number, got {value!r}")
        return int(value)

    k = whole("top_k", top_k)
    s = None if seed is None or seed == -1 else whole("seed", seed)
    return SamplingParams(
        max_tokens=whole("max_tokens", max_tokens),
        temperature=float(temperature if temperature is not None else -1),
        top_p=float(top_p if top_p is not None else -1),
        top_k=-1 if k in (0, -1) else k,
        seed=s,
    )


def build_messages(system_prompt: str, turns: Sequence[Turn], user_message: str) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    messages += [{"role": t["role"], "content": t["content"]} for t in turns]
    messages.append({"role": "user", "content": user_message})
    return messages


def prompt_for(service: Any, messages: list[dict]) -> list[int] | str:
    """Token ids from the model's chat template, or plain "role: text" lines without one."""
    try:
        return service.apply_chat_template(messages)
    except ValueError:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])


def stats_line(metrics: RequestMetrics, num_tokens: int, finish_reason: str | None) -> str:
    """TTFT (arrival -> first token), TPOT (mean gap after the first token), output tokens per
    second of end-to-end time, token count: all from the engine's RequestMetrics."""
    parts = []
    if metrics.ttft_s is not None:
        parts.append(f"TTFT {metrics.ttft_s * 1e3:.0f} ms")
    if metrics.tpot_s is not None:
        parts.append(f"TPOT {metrics.tpot_s * 1e3:.0f} ms")
    e2e = metrics.e2e_s
    if e2e and num_tokens:
        parts.append(f"{num_tokens / e2e:.1f} tok/s")
    parts.append(f"{num_tokens} tokens")
    if finish_reason == "abort":
        parts.append("stopped")
    elif finish_reason == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)


def render(turns: Sequence[Turn], streaming: str | None = None, live: str = "") -> list[dict]:
    """Turns -> gr.Chatbot messages; each reply ends with its metrics line."""
    out = []
    for t in turns:
        content = t["content"]
        if t.get("stats"):
            content = f"{content}\n\n<sub>{t['stats']}</sub>"
        out.append({"role": t["role"], "content": content})
    if streaming is not None:
        out.append({"role": "assistant", "content": f"{streaming} ▌\n\n<sub>{live}</sub>"})
    return out


class ActiveRequests:
    """Which request each browser session is streaming, so Stop aborts the right one. A handle
    is the engine's request id (local) or the remote_client.ChatStream (remote mode)."""

    def __init__(self) -> None:
        self._by_session: dict[str, Any] = {}
        self._lock = threading.Lock()

    def set(self, session: str, handle: Any) -> None:
        with self._lock:
            self._by_session[session] = handle

    def clear(self, session: str, handle: Any) -> None:
        with self._lock:
            if self._by_session.get(session) == handle:
                del self._by_session[session]

    def get(self, session: str) -> Any | None:
        with self._lock:
            return self._by_session.get(session)


async def stream_reply(
    service: Any,
    prompt: list[int] | str,
    params: SamplingParams,
    active: ActiveRequests,
    session: str,
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one reply, thinned to STREAM_YIELD_INTERVAL_S (the last one is
    always yielded). Aborts the request if the consumer goes away before it finishes."""
    stream = service.submit(prompt, params)
    active.set(session, stream.request_id)
    last_yield = 0.0
    finished = False
    try:
        async for out in stream:
            finished = out.finished
            now = time.monotonic()
            if finished or now - last_yield >= STREAM_YIELD_INTERVAL_S:
                last_yield = now
                yield out
    finally:
        active.clear(session, stream.request_id)
        if not finished:
            service.abort(stream.request_id)


NOTHING_TO_STOP = "Nothing to stop: no reply is streaming."


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


class EngineChat:
    """Chat with the in-process engine: its chat template, its own per-request metrics."""

    waiting = "waiting for the engine"
    error_label = "Engine error"

    def __init__(self, service: Any, active: ActiveRequests) -> None:
        self.service = service
        self.active = active

    async def replies(
        self, messages: list[dict], params: SamplingParams, session: str
    ) -> AsyncIterator[ChatReply]:
        prompt = prompt_for(self.service, messages)
        async for out in stream_reply(self.service, prompt, params, self.active, session):
            n = len(out.token_ids)
            yield ChatReply(
                out.request_id,
                out.text,
                f"{n} tokens",
                out.finished,
                out.finish_reason == "abort",
                out.error,
                stats_line(out.metrics, n, out.finish_reason) if out.finished else "",
            )

    def stopped_message(self, request_id: str | None) -> str:
        return f"Stopped {request_id}: the engine freed its KV blocks at once."

    def stop(self, session: str) -> str:
        request_id = self.active.get(session)
        if request_id is None:
            return NOTHING_TO_STOP
        self.service.abort(request_id)
        return self.stopped_message(request_id)
