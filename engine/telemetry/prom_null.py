"""A stand-in for EngineMetricsRegistry where prometheus_client is not installed, and the
choice between the two.

The engine must import on machines that have only torch and triton (the GPU check image);
there it records no Prometheus series, and says so when asked to render them. The engine itself
never picks Prometheus (engine/core stays free of it): LLMEngine takes a metrics factory, null by
default, and LLM and EngineService pass `new_metrics_registry`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.request import RequestMetrics
from engine.telemetry.stats import StepStats

if TYPE_CHECKING:
    from engine.telemetry.prom import EngineMetricsRegistry


def new_metrics_registry(model_name: str = "") -> EngineMetricsRegistry | NullMetricsRegistry:
    """A Prometheus registry for one engine, or the null one without prometheus_client."""
    try:
        from engine.telemetry.prom import EngineMetricsRegistry
    except ImportError:  # no prometheus_client (GPU check machines have torch + triton only)
        return NullMetricsRegistry(model_name)
    return EngineMetricsRegistry(model_name)


class NullMetricsRegistry:
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name

    def observe_step(self, step: StepStats) -> None:
        pass

    def observe_queues(
        self, num_running: int, num_waiting: int, num_blocks_used: int, num_kv_blocks: int
    ) -> None:
        pass

    def observe_finished(self, metrics: RequestMetrics, finish_reason: str) -> None:
        pass

    def observe_prefix_cache(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        pass

    def observe_spec_decode(
        self, num_draft_tokens: int, num_accepted_tokens: int, num_drafts: int = 0,
        accepted_by_position: Sequence[int] = (),
    ) -> None:  # fmt: skip
        pass

    def observe_step_failure(self) -> None:
        pass

    def render(self) -> bytes:
        return b"# prometheus_client is not installed: no metrics recorded\n"
