"""The inference engine: paged KV cache, continuous batching, our own Llama-family model.

Exports are lazy: `import engine.telemetry.cost` (pure Python) or `engine.config` must not pay
for torch and the model runner. `from engine import LLM` loads them on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.llm import LLM
    from engine.request import RequestOutput, SamplingParams
    from engine.serving.service import EngineService

# name -> module that defines it
_EXPORTS = {
    "EngineConfig": "engine.config",
    "LLM": "engine.llm",
    "LLMEngine": "engine.core.engine",
    "EngineService": "engine.serving.service",
    "RequestOutput": "engine.request",
    "SamplingParams": "engine.request",
}

__all__ = ["LLM", "EngineConfig", "EngineService", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
