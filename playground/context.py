"""What every tab gets: the engine client and the few shared helpers (no global state).

Two modes: over our in-process engine (`service` and `info` set), or, in remote mode, over an
OpenAI-compatible server (`remote` set, no engine loaded: `service` and `info` are None)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from playground.engine_client import EngineClient
from playground.engine_info import EngineInfo, engine_info
from playground.handlers.roofline import CeilingsProvider
from playground.loadgen.targets import EngineTarget, OpenAITarget, Target
from playground.remote.client import RemoteServer
from playground.remote.tokenizer import LazyTokenizer

if TYPE_CHECKING:
    from engine.config import EngineConfig

MakeService = Callable[["EngineConfig"], EngineClient]


def _new_service(config: EngineConfig) -> EngineClient:
    # Local mode only: remote mode never imports the engine's service (nor torch).
    from engine.serving.service import EngineService

    return EngineService(config)


@dataclass
class AppContext:
    service: EngineClient | None  # the EngineService every tab shares (None in remote mode)
    info: EngineInfo | None  # None in remote mode
    ceilings: CeilingsProvider | None = None
    # Builds the throw-away engines of the Compare tab (tests may substitute a smaller one).
    make_service: MakeService = _new_service
    remote: RemoteServer | None = None  # remote mode: the OpenAI-compatible server
    tokenizer: LazyTokenizer | None = None  # remote mode: builds load-test prompts

    @classmethod
    def for_service(
        cls, service: EngineClient, make_service: MakeService | None = None
    ) -> AppContext:
        info = engine_info(service)
        return cls(
            service=service,
            info=info,
            ceilings=CeilingsProvider(info.device),
            make_service=make_service or _new_service,
        )

    @classmethod
    def for_remote(cls, remote: RemoteServer) -> AppContext:
        # The roofline offers datasheet roofs only: this machine's ceilings say nothing about
        # the server's, so the "cpu" provider is never asked to measure.
        return cls(
            service=None,
            info=None,
            ceilings=CeilingsProvider("cpu"),
            remote=remote,
            tokenizer=LazyTokenizer.for_remote(remote),
        )

    @property
    def model_name(self) -> str:
        return self.remote.model if self.remote is not None else self.info.model_name

    @property
    def max_model_len(self) -> int | None:
        """Tokens; None when a remote server does not report it."""
        return self.remote.max_model_len if self.remote is not None else self.info.max_model_len

    def load_test_target(self) -> Target:
        """Where the Load test tab sends its workload. Remote mode loads the tokenizer on first
        use (seconds; call it off the event loop); ValueError when it cannot."""
        if self.remote is None:
            return EngineTarget(self.service)
        return OpenAITarget.for_server(self.remote, self.tokenizer.resolve())
