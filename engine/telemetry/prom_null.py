"""A stand-in for EngineMetricsRegistry where prometheus_client is not installed.

The engine must import on machines that have only torch and triton (the GPU check image);
there it records no Prometheus series, and says so when asked to render them.
"""

from __future__ import annotations

from engine.request import RequestMetrics
from engine.telemetry.stats import StepStats


class NullMetricsRegistry:
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name

    def observe_step(self, step: StepStats) -> None:
        pass

    def observe_finished(self, metrics: RequestMetrics, finish_reason: str) -> None:
        pass

    def observe_prefix_cache(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        pass

    def observe_spec_decode(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        pass

    def render(self) -> bytes:
        return b"# prometheus_client is not installed: no metrics recorded\n"
