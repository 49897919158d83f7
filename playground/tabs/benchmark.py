"""What the Load test and both Compare tabs share: one benchmark at a time across the three,
and a Stop button that acts on the run this tab started."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The Run button's event settings. One benchmark at a time (load test or compare): they would
# skew each other's numbers. The tab draws its own progress bar, so no Gradio spinner.
BENCHMARK_QUEUE: dict[str, Any] = {
    "concurrency_limit": 1,
    "concurrency_id": "benchmark",
    "show_progress": "hidden",
}


def stop_handler(current: dict[str, Any], idle: str, stopping: str) -> Callable[[], str]:
    """The Stop button's handler: stops current["run"] (a BackgroundRun or BackgroundCompare,
    None when nothing runs) and returns the status line, `idle` or `stopping`."""

    def stop() -> str:
        run = current["run"]
        if run is None:
            return idle
        run.stop()
        return stopping

    return stop
