"""Running the app under uvicorn: its HTTP limits applied (uvicorn_config), a shutdown that
drains in-flight requests (DrainingServer), and a server on a background thread for tests and
for the UI serving the API alongside (BackgroundServer)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from engine.serving.http_limits import HTTPLimits, h11_protocol_for
from engine.serving.server_state import ServerState


def uvicorn_config(app: FastAPI, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings with this app's HTTP limits (timeouts, header size)."""
    limits: HTTPLimits = app.state.server.limits
    return uvicorn.Config(
        app,
        http=h11_protocol_for(limits),
        timeout_keep_alive=limits.keep_alive_timeout_s,
        # Request line + headers: at most 16 KiB (h11's default, said here on purpose).
        h11_max_incomplete_event_size=16 * 1024,
        timeout_graceful_shutdown=int(limits.drain_timeout_s) + 5,
        **kwargs,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains as docs/serving.md says: from the moment shutdown begins
    new requests are answered 503 (uvicorn alone would stop accepting connections at once),
    in-flight ones get drain_timeout_s to finish, and whatever is still running then is
    aborted so that it ends properly: a JSON 503, or an error event and [DONE] on a stream."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.state
        state.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + state.limits.drain_timeout_s
        while state.inflight and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        for request_id in list(state.inflight):
            state.service.abort(request_id)
        deadline = loop.time() + 2.0  # their answers are one engine-thread pass away
        while state.inflight and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


class BackgroundServer:
    """The server on a background thread (tests, or the UI serving the API alongside).
    port 0 picks a free port; `url` says which."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn_config(app, log_level="warning")
        self.server = DrainingServer(config, app.state.server)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
