"""What every tab gets: the engine client and the few shared helpers (no global state)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from playground.engine_info import EngineInfo, engine_info
from playground.handlers_chat import ActiveRequests
from playground.handlers_roofline import CeilingsProvider


def _new_service(config: EngineConfig) -> Any:
    from engine.service import EngineService

    return EngineService(config)


@dataclass
class AppContext:
    service: Any  # the EngineService every tab shares
    info: EngineInfo
    chats: ActiveRequests = field(default_factory=ActiveRequests)
    ceilings: CeilingsProvider | None = None
    # Builds the throw-away engines of the Compare tab (tests may substitute a smaller one).
    make_service: Callable[[EngineConfig], Any] = _new_service

    @classmethod
    def for_service(cls, service: Any, **kwargs: Any) -> AppContext:
        info = engine_info(service)
        ctx = cls(service=service, info=info, **kwargs)
        if ctx.ceilings is None:
            ctx.ceilings = CeilingsProvider(info.device)
        return ctx
