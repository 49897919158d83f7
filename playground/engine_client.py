"""What the playground uses of the engine, as Protocols: EngineService satisfies them, and tests
may pass smaller fakes. Typing only: importing this module imports no engine code, so remote
mode (`--base-url`) stays free of torch and the model runner.

The playground reaches the engine through these calls and the telemetry snapshots they return
(EngineStats, BlockSnapshot, RequestProgress), never through tensors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.block_manager import BlockSnapshot
    from engine.request import RequestOutput, SamplingParams
    from engine.telemetry.cost import ModelShape
    from engine.telemetry.stats import EngineStats, RequestProgress
    from playground.loadgen.workload import Tokenizer


class OutputStream(Protocol):
    """One request's RequestOutput deltas (EngineService.submit's RequestStream)."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def __iter__(self) -> Iterator[RequestOutput]:
        """The same deltas, blocking (for code on a worker thread)."""
        ...


class EngineClient(Protocol):
    """The in-process engine as the tabs see it (EngineService)."""

    config: EngineConfig
    model_name: str
    max_model_len: int  # tokens
    tokenizer: Tokenizer
    model_shape: ModelShape  # layers, heads, widths: the roofline and KV calculator
    device: str  # "cpu" | "cuda", resolved
    dtype: str  # "bfloat16", "float32", ...
    weight_bytes: int  # the weights as stored (quantized ones with their scales and zeros)

    def submit(self, prompt: str | Sequence[int], params: SamplingParams) -> OutputStream:
        """Enqueue; ValueError names a refused field, RuntimeError: shutting down."""
        ...

    def abort(self, request_id: str) -> None: ...

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """ValueError when the model has no chat template."""
        ...

    def stats(self) -> EngineStats: ...

    def block_snapshot(self) -> BlockSnapshot: ...

    # The published block map with the most blocks held since start-up (None before any).
    peak_block_snapshot: BlockSnapshot | None

    def queue_snapshot(self) -> list[RequestProgress]: ...

    def shutdown(self) -> None: ...
