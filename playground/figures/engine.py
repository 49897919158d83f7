"""Live engine views besides the block map: per-step batch composition and the request queues."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import plotly.graph_objects as go

from engine.telemetry.stats import EngineStats, RequestProgress, StepStats
from playground.figures.style import KIND_COLORS, base_layout, empty_figure, plural

EMPTY_HINT = "No engine steps yet: send a message in Chat or run a load test."


TIMELINE_WINDOWS_S = {"last 30 s": 30.0, "last 2 min": 120.0, "last 10 min": 600.0}
DEFAULT_WINDOW = "last 2 min"
NUM_TIME_BINS = 120  # bars per chart, whatever the step rate: the payload stays small


def batch_timeline_figure(
    steps: Sequence[StepStats], now_s: float | None = None, window_s: float = 120.0
) -> go.Figure:
    """Prefill vs decode tokens per time bin of window_s / NUM_TIME_BINS seconds (stacked
    bars; each step's own tokens when no two steps share a bin), and the batch size (line,
    right axis; the largest of a bin), in wall-clock seconds before now_s (time.perf_counter(),
    the clock of StepStats.start_time) over the last window_s: a load test is not squeezed
    against old chat steps as it was on a step axis. Bars are a bin wide: one bar per 26 ms
    step on a 2-minute axis was a fifth of a pixel, and a chat's steps did not show at all.
    Dict traces: rebuilt every second on the live tab."""
    now_s = now_s if now_s is not None else (steps[-1].start_time if steps else 0.0)
    bin_s = window_s / NUM_TIME_BINS
    recent = [s for s in steps if 0.0 <= now_s - s.start_time <= window_s]
    title = f"Batch composition, {_window_text(window_s)}"
    if not recent:
        return empty_figure(EMPTY_HINT if not steps else _idle_hint(window_s), title)
    x, prefill, decode, batch, meta, preempted, copied = _binned(recent, now_s, bin_s)
    # Sparse (every step alone in its bin): a step's own tokens; else sums per bin.
    alone = len(x) == len(recent)
    y_title = "tokens in the step" if alone else f"tokens per {bin_s:g} s"
    hover = "%{x:.1f} s<br>%{y} %{fullData.name} (%{customdata})<extra></extra>"
    width = 0.9 * bin_s  # explicit: plotly's own width follows the closest bars, one bar alone
    traces: list[dict] = [
        {"type": "bar", "x": x, "y": prefill, "name": "prefill tokens", "customdata": meta,
         "width": width, "marker": {"color": KIND_COLORS["prefill"]}, "hovertemplate": hover},
        {"type": "bar", "x": x, "y": decode, "name": "decode tokens", "customdata": meta,
         "width": width, "marker": {"color": KIND_COLORS["decode"]}, "hovertemplate": hover},
        {"type": "scatter", "x": x, "y": batch, "yaxis": "y2",
         "name": "largest batch (requests)", "mode": "lines",
         "line": {"color": "#111827", "width": 1.5, "shape": "hv"},
         "hovertemplate": "%{x:.1f} s<br>batch up to %{y} requests<extra></extra>"},
    ]  # fmt: skip
    hit = [i for i, n in enumerate(preempted) if n]
    if hit:
        traces.append(
            {"type": "scatter", "x": [x[i] for i in hit], "y": [batch[i] for i in hit],
             "yaxis": "y2", "mode": "markers", "name": "preemption",
             "marker": {"symbol": "x", "size": 9, "color": "#dc2626"}}
        )  # fmt: skip
    cow = [i for i, n in enumerate(copied) if n]
    if cow:  # parallel sampling (n > 1): shared KV blocks copied before a sequence wrote
        traces.append(
            {"type": "scatter", "x": [x[i] for i in cow], "y": [batch[i] for i in cow],
             "yaxis": "y2", "mode": "markers", "name": "copy-on-write",
             "customdata": [copied[i] for i in cow],
             "hovertemplate": "%{x:.1f} s<br>%{customdata} KV blocks copied<extra></extra>",
             "marker": {"symbol": "diamond", "size": 9, "color": "#7c3aed"}}
        )  # fmt: skip
    max_batch = max(batch)
    layout = {
        "barmode": "stack",
        "xaxis": {"title": {"text": "seconds ago"}, "range": [-window_s, 0],
                  "ticksuffix": " s"},
        "yaxis": {"title": {"text": y_title}, "rangemode": "tozero"},
        # Whole requests only: integer ticks, never 0.5.
        "yaxis2": {"title": {"text": "requests"}, "overlaying": "y", "side": "right",
                   "range": [0, max_batch + 1], "tick0": 0,
                   "dtick": max(1, math.ceil((max_batch + 1) / 5)), "tickformat": "d",
                   "showgrid": False},
    }  # fmt: skip
    fig = go.Figure(data=traces, layout=layout)
    return base_layout(fig, f"{title} ({plural(len(recent), 'step')})", height=300)


def _binned(steps: list[StepStats], now_s: float, bin_s: float) -> tuple[list, ...]:
    """Per non-empty bin: center (seconds ago, < 0), prefill and decode token sums, largest
    batch, "<n> steps" (or "step <index>" for a step alone), preemptions, copy-on-write block
    copies."""
    bins: dict[int, list[int]] = {}
    for s in steps:
        i = min(int((now_s - s.start_time) / bin_s), NUM_TIME_BINS - 1)  # the window's edge
        b = bins.setdefault(i, [0, 0, 0, 0, 0, 0, 0])
        b[0] += s.num_prefill_tokens
        b[1] += s.num_decode_tokens
        b[2] = max(b[2], s.batch_size)
        b[3] += 1
        b[4] += s.num_preemptions
        b[5] += s.num_block_copies
        b[6] = s.step_index
    order = sorted(bins, reverse=True)  # oldest first
    return (
        [-(i + 0.5) * bin_s for i in order],
        [bins[i][0] for i in order],
        [bins[i][1] for i in order],
        [bins[i][2] for i in order],
        [f"step {bins[i][6]}" if bins[i][3] == 1 else plural(bins[i][3], "step") for i in order],
        [bins[i][4] for i in order],
        [bins[i][5] for i in order],
    )


def _window_text(window_s: float) -> str:
    return f"last {window_s:g} s" if window_s < 120 else f"last {window_s / 60:g} min"


def _idle_hint(window_s: float) -> str:
    return f"No engine step in the {_window_text(window_s)}: the engine is idle."


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


ACCEPTANCE_EMPTY_HINT = (
    "No draft verified yet: chat, or run a load test, with speculative decoding on."
)


def acceptance_figure(stats: EngineStats) -> go.Figure:
    """Speculative decoding since start-up: per draft position, the share of the drafts
    verified there that the target accepted (bars; the counts in the hover), titled with the
    mean accepted length (tokens a verifying request gets per step). Position i is verified
    only when a request proposed more than i tokens; a drafter that guesses well keeps the
    later bars high, which is where the speedup comes from."""
    title = "Draft acceptance by position"
    if not stats.num_spec_proposals_total:
        return empty_figure(ACCEPTANCE_EMPTY_HINT, title)
    drafts = stats.num_draft_tokens_by_position
    accepted = stats.num_accepted_tokens_by_position
    positions = [f"draft {i + 1}" for i in range(len(drafts))]
    percent = [100 * r for r in stats.acceptance_by_position]
    trace = {
        "type": "bar", "x": positions, "y": percent, "name": "accepted",
        "customdata": [[a, d] for a, d in zip(accepted, drafts, strict=True)],
        "marker": {"color": KIND_COLORS["decode"]},
        "text": [f"{p:.0f} %" for p in percent], "textposition": "outside",
        "hovertemplate": "%{x}: %{customdata[0]:,} of %{customdata[1]:,} accepted"
                         "<extra></extra>",
    }  # fmt: skip
    fig = go.Figure(data=[trace])
    mean = stats.mean_accepted_length
    base_layout(fig, f"{title} · {mean:.2f} tokens per verify step", height=260)
    fig.update_yaxes(title_text="accepted (%)", range=[0, 110])
    fig.update_layout(showlegend=False)
    return fig
