"""The inference engine: paged KV cache, continuous batching, our own Llama-family model."""

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "EngineConfig", "EngineService", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # EngineService pulls in threading/asyncio machinery only when asked for.
    if name == "EngineService":
        from engine.service import EngineService

        return EngineService
    raise AttributeError(name)
