"""An official `openai` client talking to our server over a test's EngineService (127.0.0.1,
a free port), for the API tests that check what a real client reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai

from engine.serving.http_server import BackgroundServer
from engine.serving.server import create_app


@contextmanager
def served_client(service, served_model_name: str = "m") -> Iterator[openai.OpenAI]:
    srv = BackgroundServer(create_app(service, served_model_name=served_model_name)).start()
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    finally:
        srv.stop()
