"""Latency and throughput charts: CDFs, tokens/s over time, and the per-request Gantt chart."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.telemetry.stats import StepStats
from playground.figures.style import (
    FAILED_COLOR,
    KIND_COLORS,
    SEGMENT_COLORS,
    SIDE_COLORS,
    base_layout,
    empty_figure,
)
from playground.loadgen.metrics import RequestResult


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Step points of the empirical CDF, starting from 0 at the smallest value."""
    xs = sorted(values)
    n = len(xs)
    return [xs[0], *xs], [0.0, *((i + 1) / n for i in range(n))]


def cdf_figure(
    metrics: Mapping[str, Mapping[str, Sequence[float]]], title: str | None = None
) -> go.Figure:
    """One panel per metric ("TTFT" -> {series name -> values in ms}), one line per series.

    A point (x, y) reads: a fraction y of the requests (or gaps, for ITL) took at most x ms.
    """
    if not any(values for series in metrics.values() for values in series.values()):
        return empty_figure(
            "No finished request yet: send a message in Chat or run a load test.", title
        )
    names = list(metrics)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, shared_yaxes=True)
    series_names = list(dict.fromkeys(s for m in metrics.values() for s in m))
    for col, name in enumerate(names, start=1):
        for k, series in enumerate(series_names):
            values = metrics[name].get(series) or []
            if not values:
                continue
            xs, ys = _cdf(values)
            color = SIDE_COLORS[k % len(SIDE_COLORS)] if len(series_names) > 1 else "#2563eb"
            fig.add_scatter(
                x=xs,
                y=ys,
                mode="lines+markers" if len(values) <= 20 else "lines",
                line={"shape": "hv", "color": color},
                name=series,
                legendgroup=series,
                showlegend=col == 1 and len(series_names) > 1,
                hovertemplate=f"{series}<br>%{{x:.1f}} ms<br>%{{y:.0%}} at or below<extra></extra>",
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="ms", row=1, col=col)
    fig.update_yaxes(title_text="fraction at or below", tickformat=".0%", row=1, col=1)
    base_layout(fig, title, height=320)
    fig.update_layout(legend={"y": -0.25, "yanchor": "top"}, margin={"b": 80})
    return fig


def latency_cdfs_figure(
    runs: Mapping[str, Sequence[RequestResult]], title: str | None = None
) -> go.Figure:
    """TTFT, TPOT and E2E latency CDFs (ms) of each run's successful requests, overlaid
    (name -> the run's results): what a client measured."""

    def ms(results: Sequence[RequestResult], attr: str) -> list[float]:
        values = [getattr(r, attr) for r in results if r.success]
        return [v * 1e3 for v in values if v is not None]

    metrics = {
        name: {label: ms(results, attr) for label, results in runs.items()}
        for name, attr in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E latency", "e2e_s"))
    }
    return cdf_figure(metrics, title)


def throughput_figure(
    steps: Sequence[StepStats],
    t0: float,
    bin_s: float = 1.0,
    title: str | None = None,
    x_shift_s: float = 0.0,
    x_title: str = "seconds",
) -> go.Figure:
    """Prefill and decode tokens per second, binned by step start from t0; x is seconds after
    t0 plus x_shift_s (pass t0 - now to read x as seconds ago, negative)."""
    steps = [s for s in steps if s.start_time >= t0 and s.num_tokens]
    if not steps:
        return empty_figure(
            "No engine steps in this window: send a message or run a load test.", title
        )
    num_bins = int((steps[-1].start_time - t0) // bin_s) + 1
    prefill = [0.0] * num_bins
    decode = [0.0] * num_bins
    for s in steps:
        i = int((s.start_time - t0) // bin_s)
        prefill[i] += s.num_prefill_tokens / bin_s
        decode[i] += s.num_decode_tokens / bin_s
    x = [(i + 0.5) * bin_s + x_shift_s for i in range(num_bins)]
    fig = go.Figure()
    for name, ys in (("prefill", prefill), ("decode", decode)):
        fig.add_bar(
            x=x,
            y=ys,
            name=f"{name} tokens/s",
            marker_color=KIND_COLORS[name],
            width=bin_s,
            hovertemplate=f"t=%{{x:.1f}} s<br>%{{y:.0f}} {name} tokens/s<extra></extra>",
        )
    fig.update_layout(barmode="stack", bargap=0)
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=f"tokens/s ({bin_s:g} s bins)")
    return base_layout(fig, title, height=280)


def output_rate_figure(
    runs: Mapping[str, tuple[float, Sequence[RequestResult]]],
    bin_s: float = 1.0,
    title: str | None = None,
) -> go.Figure:
    """Output tokens/s seen by the client over each run (name -> (start, results)), overlaid."""
    lines = {
        name: _binned_rate([t - t0 for r in results if r.success for t in r.token_times], bin_s)
        for name, (t0, results) in runs.items()
    }
    return _runs_overlay_figure(
        lines,
        "lines+markers",
        "t=%{x:.1f} s<br>%{y:.0f} tokens/s",
        "No tokens received yet.",
        f"output tokens/s ({bin_s:g} s bins)",
        title,
    )


def _binned_rate(times: Sequence[float], bin_s: float) -> tuple[list[float], list[float]] | None:
    """Events per second in bins of bin_s (x: bin centres); None when there are no events."""
    if not times:
        return None
    num_bins = int(max(times) // bin_s) + 1
    counts = [0] * num_bins
    for t in times:
        counts[int(t // bin_s)] += 1
    return [(i + 0.5) * bin_s for i in range(num_bins)], [c / bin_s for c in counts]


def _runs_overlay_figure(
    lines: Mapping[str, tuple[list[float], list[float]] | None],
    mode: str,
    hover: str,
    empty: str,
    y_title: str,
    title: str | None,
) -> go.Figure:
    """One step line per run (name -> (seconds since its start, values); None: nothing to draw)
    overlaid, coloured A/B by the run's place in `lines` (a run without a line keeps its colour
    slot); the message `empty` when no run has a line."""
    fig = go.Figure()
    for k, (name, xy) in enumerate(lines.items()):
        if xy is None:
            continue
        fig.add_scatter(
            x=xy[0],
            y=xy[1],
            mode=mode,
            name=name,
            line={"color": SIDE_COLORS[k % 2], "shape": "hv"},
            hovertemplate=f"{name}<br>{hover}<extra></extra>",
        )
    if not fig.data:
        return empty_figure(empty, title)
    fig.update_xaxes(title_text="seconds since the run started")
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    return base_layout(fig, title, height=280)


def queue_depth_figure(
    steps: Sequence[StepStats], t0: float, title: str | None = None
) -> go.Figure:
    """Running and waiting requests after each step, seconds after t0."""
    steps = [s for s in steps if s.start_time >= t0]
    if not steps:
        return empty_figure("Waiting for the first engine step.", title)
    x = [s.start_time - t0 for s in steps]
    fig = go.Figure()
    fig.add_scatter(
        x=x,
        y=[s.num_running for s in steps],
        name="running",
        mode="lines",
        line={"shape": "hv", "color": "#16a34a"},
    )
    fig.add_scatter(
        x=x,
        y=[s.num_waiting for s in steps],
        name="waiting",
        mode="lines",
        line={"shape": "hv", "color": "#9ca3af"},
    )
    fig.update_xaxes(title_text="seconds since the run started")
    fig.update_yaxes(title_text="requests", rangemode="tozero")
    return base_layout(fig, title, height=280)


# Client-only names (remote servers report no queue time): what the client saw, nothing more.
CLIENT_SEGMENTS = {"prefill": "send → first token", "decode": "first token → end"}


def gantt_figure(
    results: Sequence[RequestResult],
    t0: float,
    title: str | None = None,
    max_rows: int = 400,
    client_only: bool = False,
) -> go.Figure:
    """One row per request: queue (engine waiting queue), prefill (scheduled -> first token),
    decode (first token -> last token). Times are seconds after t0 (the test's start).
    client_only (a remote server): no queue segment; send -> first token -> end."""
    results = sorted(results, key=lambda r: r.index)[:max_rows]
    if not results:
        return empty_figure("No finished request yet.", title)
    segments: dict[str, tuple[list[int], list[float], list[float]]] = {
        name: ([], [], []) for name in ("queue", "prefill", "decode", "failed")
    }

    def add(name: str, index: int, start: float, end: float | None) -> None:
        if end is None or end < start:
            return
        rows, bases, lengths = segments[name]
        rows.append(index)
        bases.append(start - t0)
        lengths.append(max(end - start, 1e-4))

    for r in results:
        if not r.success:
            add("failed", r.index, r.send_time, r.end_time)
            continue
        scheduled = r.send_time + (r.queue_s or 0.0)
        if not client_only:
            add("queue", r.index, r.send_time, scheduled)
        add("prefill", r.index, scheduled, r.first_token_time)
        add("decode", r.index, r.first_token_time or scheduled, r.end_time)
    fig = go.Figure()
    for name, (rows, bases, lengths) in segments.items():
        if not rows:
            continue
        shown = CLIENT_SEGMENTS.get(name, name) if client_only else name
        fig.add_bar(
            y=rows,
            x=lengths,
            base=bases,
            orientation="h",
            name=shown,
            marker_color=SEGMENT_COLORS.get(name, FAILED_COLOR),
            hovertemplate=f"request %{{y}}<br>{shown}: %{{base:.2f}} s + %{{x:.3f}} s<extra></extra>",
        )
    fig.update_layout(barmode="overlay", bargap=0.15)
    fig.update_xaxes(title_text="seconds since the test started")
    fig.update_yaxes(title_text="request", autorange="reversed")
    height = min(700, max(220, 14 * len(results) + 110))
    return base_layout(fig, title, height=height)


def nice_bin_s(duration_s: float, target_bins: int = 40) -> float:
    """A round bin width giving about target_bins bins over duration_s."""
    raw = max(duration_s, 1e-3) / target_bins
    exp = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * exp >= raw:
            return max(0.25, m * exp)
    return max(0.25, 10 * exp)


def requests_per_step_figure(
    runs: Mapping[str, tuple[float, Sequence[StepStats]]], title: str | None = None
) -> go.Figure:
    """Requests in each engine step over time, one line per run (name -> (t0, steps))."""
    lines = {
        name: ([s.start_time - t0 for s in steps], [s.batch_size for s in steps]) if steps else None
        for name, (t0, steps) in runs.items()
    }
    return _runs_overlay_figure(
        lines,
        "lines",
        "t=%{x:.2f} s<br>%{y} requests",
        "No engine steps recorded.",
        "requests in the step",
        title,
    )
