"""ServerState: what every part of the HTTP server shares about one app (the service, the
model names it answers to, its auth and limits, and the requests being answered)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.config import DEFAULT_MAX_MODEL_LEN
from engine.serving.http_limits import HTTPLimits
from engine.serving.protocol import bad_request


@dataclass
class ServerState:
    service: Any  # EngineService
    model_name: str  # the name clients send as "model" and see in /v1/models
    aliases: frozenset[str]  # other names accepted as "model" (e.g. the engine's model spec)
    api_key: str | None = None
    metrics_auth: bool = True  # /metrics needs the key too (False: open for a scraper)
    # Host / Origin values accepted (DNS rebinding, cross-site requests); None: any.
    allowed_hosts: frozenset[str] | None = None
    limits: HTTPLimits = field(default_factory=HTTPLimits)
    draining: bool = False  # shutting down: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    inflight: set[str] = field(default_factory=set)  # request ids being answered
    # Tokenizing a long prompt takes seconds: it runs here, not on the event loop. One thread:
    # HF fast tokenizers are not safe to call from several threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    )

    def resolve_model(self, requested: str | None) -> str:
        if requested is None or requested == self.model_name or requested in self.aliases:
            return self.model_name
        raise bad_request(
            f"model: '{requested}' is not served here (served: '{self.model_name}')",
            param="model",
            code="model_not_found",
        )

    def max_prompt_chars(self) -> int:
        limit = self.limits.max_prompt_chars
        return limit if limit is not None else 16 * max_model_len(self.service)


def max_model_len(service: Any) -> int:
    """The context length the engine enforces (prompt + output tokens)."""
    resolved = getattr(service, "max_model_len", None) or service.config.max_model_len
    return int(resolved or DEFAULT_MAX_MODEL_LEN)
