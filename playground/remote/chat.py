"""One streaming chat reply from a remote OpenAI-compatible server, over the OpenAIClient:

stream = ChatStream(remote, chat_body(remote.model, messages, params))
async for update in stream.updates(): ...            # ChatUpdate: the reply so far
stream.stop()                                        # from any thread: closes the stream
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from playground.remote.client import (
    CONNECT_TIMEOUT_S,
    ClientMetrics,
    RemoteServer,
    StreamReply,
)

if TYPE_CHECKING:
    from engine.request import SamplingParams

CHAT_TIMEOUT = httpx.Timeout(3600.0, connect=CONNECT_TIMEOUT_S)  # a stalled server: press Stop


def chat_body(model: str, messages: list[dict], params: SamplingParams) -> dict[str, Any]:
    """A streaming chat request with the form's sampling fields; top_k is a vLLM extension
    (SGLang, llama.cpp and ours accept it too) and is left out when off, as are penalties at
    0 (OpenAI's fields; servers that lack them then see nothing new)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.top_k != -1:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(params, name):
            body[name] = getattr(params, name)
    if params.logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = params.logprobs
    return body


def check_remote_params(params: SamplingParams) -> None:
    """ValueError for a form value chat_body cannot send: n > 1 (servers differ in support,
    and the remote reply view shows one) and the repetition penalty (not an OpenAI field; vLLM
    calls it repetition_penalty, llama.cpp repeat_penalty). Sending neither would answer a
    different request than the one asked for."""
    if params.n != 1:
        raise ValueError(f"n: remote mode sends one reply per request, got n = {params.n}")
    if params.repetition_penalty != 1.0:
        raise ValueError("repetition_penalty: not an OpenAI field, so remote mode does not "
                         f"send it; use 1.0 (got {params.repetition_penalty:g}) and the "
                         "frequency or presence penalty instead")  # fmt: skip


@dataclass(frozen=True)
class ChatUpdate:
    request_id: str | None  # the server's id for the completion, once a chunk named it
    text: str  # the reply so far
    num_chunks: int  # content chunks received so far
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" (stopped here) | None
    error: str | None = None
    metrics: ClientMetrics | None = None  # on the finished update
    logprobs: tuple[dict, ...] = ()  # chat logprobs' content entries so far (when asked)
    usage: dict | None = None  # the server's usage report, on the finished update


def _update(reply: StreamReply) -> ChatUpdate:
    return ChatUpdate(
        reply.request_id, reply.text, len(reply.parts), logprobs=tuple(reply.logprobs)
    )


def _final(reply: StreamReply, end_time: float) -> ChatUpdate:
    return ChatUpdate(
        reply.request_id,
        reply.text,
        len(reply.parts),
        finished=True,
        finish_reason=reply.finish_reason,
        error=reply.error,
        metrics=reply.metrics(end_time),
        logprobs=tuple(reply.logprobs),
        usage=reply.usage,
    )


class ChatStream:
    """One streaming POST /v1/chat/completions. The HTTP read runs in its own task, so stop()
    closes the connection even while the server is silent (queued, or in a long prefill); a
    server that aborts on disconnect (ours, vLLM, SGLang, llama.cpp) then frees the request's KV
    cache."""

    def __init__(self, remote: RemoteServer, body: dict[str, Any]) -> None:
        self.remote = remote
        self.body = body
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stop_requested = False

    def stop(self) -> None:
        """Safe from any thread; the last update then has finish_reason "abort"."""
        self._stop_requested = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)

    async def updates(self) -> AsyncIterator[ChatUpdate]:
        """The reply so far, newest only (updates that piled up are merged); the last one is
        finished. Leaving early closes the stream."""
        queue: asyncio.Queue[ChatUpdate] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.ensure_future(self._read(queue))
        if self._stop_requested:
            self._task.cancel()
        try:
            while True:
                update = await queue.get()
                while not update.finished and not queue.empty():
                    update = queue.get_nowait()
                yield update
                if update.finished:
                    return
        finally:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _read(self, queue: asyncio.Queue[ChatUpdate]) -> None:
        reply = StreamReply(send_time=time.perf_counter())
        try:
            async with self.remote.client(CHAT_TIMEOUT) as client:
                await client.stream(
                    "chat/completions", self.body, reply, lambda r: queue.put_nowait(_update(r))
                )
        except asyncio.CancelledError:  # stop(), or the consumer left: the connection is closed
            reply.finish_reason = "abort"
        queue.put_nowait(_final(reply, time.perf_counter()))
