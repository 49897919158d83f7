"""Live engine views besides the block map: per-step batch composition and the request queues."""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go

from engine.telemetry.stats import RequestProgress, StepStats
from playground.figures.style import KIND_COLORS, base_layout, empty_figure

EMPTY_HINT = "No engine steps yet: send a message in Chat or run a load test."


def batch_timeline_figure(steps: Sequence[StepStats], max_steps: int = 200) -> go.Figure:
    """Prefill vs decode tokens of each recent step (stacked bars) and its batch size (line,
    right axis). Dict traces: this figure is rebuilt every second on the live tab."""
    steps = list(steps)[-max_steps:]
    if not steps:
        return empty_figure(EMPTY_HINT, "Batch composition per step")
    x = [s.step_index for s in steps]
    hover = "step %{x}<br>%{y} %{meta} tokens<extra></extra>"
    traces: list[dict] = [
        {"type": "bar", "x": x, "y": [s.num_prefill_tokens for s in steps],
         "name": "prefill tokens", "marker": {"color": KIND_COLORS["prefill"]},
         "meta": "prefill", "hovertemplate": hover},
        {"type": "bar", "x": x, "y": [s.num_decode_tokens for s in steps],
         "name": "decode tokens", "marker": {"color": KIND_COLORS["decode"]},
         "meta": "decode", "hovertemplate": hover},
        {"type": "scatter", "x": x, "y": [s.batch_size for s in steps], "yaxis": "y2",
         "name": "requests in the step", "mode": "lines",
         "line": {"color": "#111827", "width": 1.5, "shape": "hv"},
         "hovertemplate": "step %{x}<br>batch %{y} requests<extra></extra>"},
    ]  # fmt: skip
    preempted = [s for s in steps if s.num_preemptions]
    if preempted:
        traces.append(
            {"type": "scatter", "x": [s.step_index for s in preempted],
             "y": [s.batch_size for s in preempted], "yaxis": "y2", "mode": "markers",
             "name": "preemption", "marker": {"symbol": "x", "size": 9, "color": "#dc2626"}}
        )  # fmt: skip
    layout = {
        "barmode": "stack",
        "bargap": 0.05,
        "xaxis": {"title": {"text": "engine step"}},
        "yaxis": {"title": {"text": "tokens in the step"}},
        "yaxis2": {"title": {"text": "requests"}, "overlaying": "y", "side": "right",
                   "rangemode": "tozero", "showgrid": False},
    }  # fmt: skip
    fig = go.Figure(data=traces, layout=layout)
    return base_layout(fig, f"Batch composition of the last {len(steps)} steps", height=300)


def _bar(fraction: float, css_class: str) -> str:
    pct = max(0.0, min(1.0, fraction)) * 100
    return (
        f'<div class="pg-bar"><div class="pg-bar-fill {css_class}" '
        f'style="width:{pct:.1f}%"></div></div>'
    )


def queue_html(rows: Sequence[RequestProgress]) -> str:
    """Running then waiting requests, each with its prefill and decode progress."""
    if not rows:
        return '<p class="pg-empty">No request running or waiting. Send a message or run a load test.</p>'
    body = []
    for r in rows:
        prefill_done = min(r.num_computed_tokens, r.num_prompt_tokens)
        prefill = prefill_done / r.num_prompt_tokens if r.num_prompt_tokens else 1.0
        decode = r.num_output_tokens / r.max_tokens if r.max_tokens else 0.0
        body.append(
            f'<tr class="pg-{html.escape(r.status)}"><td>{html.escape(r.request_id)}</td>'
            f"<td>{html.escape(r.status)}</td>"
            f"<td>{_bar(prefill, 'pg-prefill')}{prefill_done} / {r.num_prompt_tokens}</td>"
            f"<td>{_bar(decode, 'pg-decode')}{r.num_output_tokens} / {r.max_tokens}</td>"
            f"<td>{r.num_blocks}</td></tr>"
        )
    running = sum(r.status == "running" for r in rows)
    return (
        f'<div class="pg-queue"><p><b>{running}</b> running, <b>{len(rows) - running}</b> '
        "waiting or preempted</p><table><thead><tr><th>request</th><th>status</th>"
        "<th>prefill (prompt tokens in KV)</th><th>decode (output / max tokens)</th>"
        f"<th>KV blocks</th></tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )
