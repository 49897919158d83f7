"""Relaying one engine request over HTTP: submit it, then either collect its final output or
turn its RequestOutput deltas into OpenAI server-sent events. Whatever ends the relay early (a
client disconnect cancels the handler or the event generator) aborts the request, which frees
its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from engine.serving.protocol import (
    SSE_DONE,
    APIError,
    bad_request,
    chat_chunk,
    completion_chunk,
    error_body,
    field_of,
    sse,
    usage,
    usage_chunk,
)


def submit(service: Any, prompt: str | list[int], params: Any, request_id: str) -> Any:
    try:
        return service.submit(prompt, params, request_id=request_id)
    except ValueError as e:  # empty / too long prompt, never fits the KV cache, ...
        message = str(e)
        raise bad_request(message, param=field_of(message) or "prompt") from None
    except RuntimeError as e:  # the engine is shutting down
        raise APIError(503, str(e), type="service_unavailable") from None


async def collect(service: Any, stream: Any, request: Request) -> Any:
    """The final RequestOutput; aborts the request if the client disconnects first."""

    async def drain() -> Any:
        last = None
        async for out in stream:
            last = out
        return last

    async def disconnected() -> None:
        # The body has been read: the next ASGI message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # client gone (or this handler cancelled): free the blocks
            service.abort(stream.request_id)
            work.cancel()
    if not work.done() or work.cancelled():
        # The client is gone: nobody reads this answer (and work.result() of a task just
        # cancelled would raise InvalidStateError). 499 is nginx's "client closed request".
        raise APIError(499, "the client closed the request", code="client_closed_request")
    last = work.result()
    if not getattr(service, "is_running", True):
        raise APIError(503, "the server is shutting down", type="service_unavailable")
    if last is None or last.error:
        detail = last.error if last is not None else "no output"
        raise APIError(500, f"the engine failed the request: {detail}", type="internal_error")
    if last.finish_reason == "abort":
        raise APIError(503, "the request was aborted (server shutting down?)", type="aborted")
    return last


async def _relay(service: Any, stream: Any) -> AsyncIterator[Any]:
    """The stream's deltas; aborts the request when the consumer stops early (disconnect)."""
    finished = False
    try:
        async for out in stream:
            finished = out.finished
            yield out
    finally:
        if not finished:
            service.abort(stream.request_id)


def _stream_error(out: Any) -> str:
    """The error event of a stream the server ended: the engine failed or shut down, or the
    request was aborted (only the server aborts a stream whose client still reads it: when
    shutdown's drain time is over). The client then gets [DONE], as after any stream."""
    if out.error:
        body = error_body(f"the engine failed the request: {out.error}", type="internal_error")
    else:
        body = error_body(
            "the request was aborted: the server is shutting down", type="service_unavailable"
        )
    return sse(body)


def completion_events(
    service: Any, stream: Any, model: str, include_usage: bool
) -> AsyncIterator[str]:
    rid = stream.request_id
    return _events(
        service, stream, model, include_usage, "text_completion",
        lambda out: completion_chunk(rid, model, out.new_text, out.finish_reason),
    )  # fmt: skip


def chat_events(service: Any, stream: Any, model: str, include_usage: bool) -> AsyncIterator[str]:
    rid = stream.request_id

    def chunk_for(out: Any) -> dict[str, Any]:
        delta = {"content": out.new_text} if out.new_text else {}
        return chat_chunk(rid, model, delta, out.finish_reason)

    first = chat_chunk(rid, model, {"role": "assistant", "content": ""}, None)
    return _events(service, stream, model, include_usage, "chat.completion.chunk", chunk_for, first)


async def _events(
    service: Any,
    stream: Any,
    model: str,
    include_usage: bool,
    usage_object: str,
    chunk_for: Callable[[Any], dict[str, Any]],
    first: dict[str, Any] | None = None,
) -> AsyncIterator[str]:
    """SSE events of one request: a chunk per delta with text (or the final one), then the
    usage chunk when asked for, then [DONE]. With include_usage every chunk carries
    "usage": null, as OpenAI's stream does."""

    def event(chunk: dict[str, Any]) -> str:
        if include_usage:
            chunk["usage"] = None
        return sse(chunk)

    if first is not None:
        yield event(first)
    last = None
    async for out in _relay(service, stream):
        if out.error or out.finish_reason == "abort":
            yield _stream_error(out)
            yield SSE_DONE
            return
        last = out
        if out.new_text or out.finished:
            yield event(chunk_for(out))
    if include_usage and last is not None:
        u = usage(len(last.prompt_token_ids), len(last.token_ids))
        yield sse(usage_chunk(stream.request_id, model, usage_object, u))
    yield SSE_DONE
