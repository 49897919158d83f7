"""Latency tab logic: TTFT / TPOT / ITL of the engine's recently finished requests (engine-side
RequestMetrics: from arrival in the engine) and its token throughput over time (StepStats)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from engine.telemetry.stats import EngineStats, FinishedRequest, latency_summary
from playground.figures.latency import cdf_figure, nice_bin_s, throughput_figure

WINDOWS_S = {"last 60 s": 60.0, "last 5 min": 300.0, "all kept": float("inf")}
SUMMARY_HEADERS = ["metric (ms)", "count", "mean", "median", "p90", "p99", "min", "max"]


@dataclass
class LatencyView:
    summary_md: str
    cdfs: go.Figure
    table: list[list[str | int]]
    throughput: go.Figure


def latencies_ms(finished: Sequence[FinishedRequest]) -> dict[str, list[float]]:
    """TTFT and TPOT per request, ITL per token gap, in ms; aborted requests are left out."""
    done = [f.metrics for f in finished if f.finish_reason != "abort"]
    return {
        "TTFT": [m.ttft_s * 1e3 for m in done if m.ttft_s is not None],
        "TPOT": [m.tpot_s * 1e3 for m in done if m.tpot_s is not None],
        "ITL": [gap * 1e3 for m in done for gap in m.itl_s],
    }


def summary_table(values_ms: dict[str, list[float]]) -> list[list[str | int]]:
    rows: list[list[str | int]] = []
    for name, values in values_ms.items():
        s = latency_summary(values)
        cells = [f"{s[k]:.1f}" if s[k] is not None else "-" for k in SUMMARY_HEADERS[2:]]
        rows.append([name, int(s["count"] or 0), *cells])
    return rows


def shared_window_start(stats: EngineStats, window_s: float, now: float) -> float:
    """Where both the CDFs and the throughput chart start: the window's start, or later when
    the engine's step history (a bounded ring) no longer reaches back that far. Finished
    requests are kept longer than steps, so cutting them there makes both charts cover one
    span of time."""
    start = now - window_s
    steps_dropped = stats.num_steps_total > len(stats.steps)
    if steps_dropped and stats.steps:
        start = max(start, stats.steps[0].start_time)
    return start


def _span(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "all kept"
    return f"last {seconds:.0f} s" if seconds < 120 else f"last {seconds / 60:.1f} min"


def latency_view(stats: EngineStats, window: str, now: float | None = None) -> LatencyView:
    now = time.perf_counter() if now is None else now
    window_s = WINDOWS_S.get(window, float("inf"))
    t0 = shared_window_start(stats, window_s, now)
    cut = t0 > now - window_s  # the step history is shorter than the window asked for
    finished = [
        f for f in stats.finished if f.metrics.finish_time is None or f.metrics.finish_time >= t0
    ]
    values = latencies_ms(finished)
    aborted = sum(f.finish_reason == "abort" for f in finished)
    steps = [s for s in stats.steps if s.start_time >= t0]
    start = steps[0].start_time if steps else now
    span = _span(now - t0) if math.isfinite(t0) else _span(now - start)
    bin_s = nice_bin_s(now - start)
    covers = f"Both charts cover the same {span}" + (
        f": the engine keeps its last {len(stats.steps):,} steps, less than the "
        f"{window} window, so requests that finished earlier are left out too."
        if cut
        else "."
    )
    if not finished:
        md = (
            "No finished request in this window: send a message in Chat or run a load test."
            f" {covers}"
        )
    else:
        md = (
            f"**{len(finished) - aborted}** finished requests ({aborted} aborted, left out) in "
            f"the {span} ({len(stats.finished)} in the engine's history). {covers} TTFT counts "
            "from arrival in the engine; TPOT = (last token - first token) / (tokens - 1); ITL "
            "pools every gap between consecutive tokens."
        )
    throughput = throughput_figure(
        steps,
        start,
        bin_s,
        f"Engine throughput (prefill + decode tokens/s), {span}",
        x_shift_s=start - now,
        x_title="seconds ago (0 = now)",
    )
    if steps:  # the axis runs up to now, so an idle stretch shows as one
        left = t0 if math.isfinite(t0) else start
        throughput.update_xaxes(range=[left - now, 0])
    return LatencyView(
        summary_md=md,
        cdfs=cdf_figure(
            {k: {"engine": v} for k, v in values.items()},
            f"Latency CDFs, requests finished in the {span}",
        ),
        table=summary_table(values),
        throughput=throughput,
    )
