"""What one client may cost the server, and where each limit is enforced below the routes:
the body size and read deadline (read_body), the request-head deadline (an h11 protocol for
uvicorn). The declared Content-Length is checked earlier still, by the guard (http_guard.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import h11
from fastapi import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.serving.protocol import APIError


@dataclass(frozen=True)
class HTTPLimits:
    """What one client may cost the server (docs/serving.md, "Limits")."""

    max_body_bytes: int = 4 * 2**20  # a larger body is answered 413 before it is read
    # A text prompt (or a chat's contents) longer than this is refused before tokenizing it;
    # None: 16 characters per token of max_model_len (real text averages about 4).
    max_prompt_chars: int | None = None
    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    body_timeout_s: float = 30.0  # the whole body must arrive within this (else 408)
    keep_alive_timeout_s: int = 5  # an idle keep-alive connection is closed after this
    drain_timeout_s: float = 5.0  # shutdown: in-flight requests get this long to finish


def too_large(limit_bytes: int) -> APIError:
    return APIError(
        413,
        f"the request body exceeds this server's limit of {limit_bytes} bytes (--max-body-bytes)",
        code="request_too_large",
    )


async def read_body(request: Request, limits: HTTPLimits) -> bytes:
    """The body, at most max_body_bytes (a chunked body declares no length) and within
    body_timeout_s (a client trickling bytes holds a connection and a task until then)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise too_large(limits.max_body_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
            code="request_timeout",
        ) from None  # fmt: skip
    return b"".join(chunks)


class HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for the request line and headers: uvicorn times
    out only idle keep-alive connections, so a client that opens a connection and sends
    nothing, or trickles its headers a byte at a time, would hold it forever (slowloris).
    The deadline runs from the connection's start (and from each response's end) until h11
    has a complete request head."""

    header_timeout_s = 10.0  # set per server by h11_protocol_for
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._arm_head_deadline()  # before super(): it may start the next (pipelined) request
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request head has arrived
            self._cancel_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def h11_protocol_for(limits: HTTPLimits) -> type[H11Protocol]:
    """uvicorn takes a protocol class, not an instance: the deadline rides on a subclass."""
    return type(
        "H11Protocol", (HeaderDeadlineH11Protocol,), {"header_timeout_s": limits.header_timeout_s}
    )
