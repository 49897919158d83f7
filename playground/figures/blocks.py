"""The block map (one grid cell per KV block, colored by owner) and the KV usage gauge.

Drawn as a heatmap of category indices with a stepped colorscale, so the grid scales with the
browser width; the legend comes from invisible marker traces, one per category.
"""

from __future__ import annotations

import html
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from engine.core.block_manager import BlockSnapshot
from playground.figures.style import (
    CACHED_COLOR,
    FREE_COLOR,
    base_layout,
    owner_color,
    tint,
)

MAX_CELLS = 4096  # above this, one cell stands for several consecutive blocks
MAX_LEGEND_OWNERS = 16


@dataclass(frozen=True)
class Cell:
    """One grid cell: a block, or a run of consecutive blocks on very large pools."""

    category: str  # "free" | "cached" | "used:<req>" | "reserved:<req>"
    hover: str
    shared: bool  # some block of the cell has ref count > 1


def _block_category(snapshot: BlockSnapshot, block_id: int) -> str:
    state = snapshot.states[block_id]
    owner = snapshot.owners[block_id]
    if state in ("used", "reserved") and owner is not None:
        return f"{state}:{owner}"
    return state  # "free", "cached", or a state this UI does not know yet


def _block_hover(snapshot: BlockSnapshot, block_id: int) -> str:
    owner = snapshot.owners[block_id]
    if snapshot.states[block_id] == "free" and not snapshot.ref_counts[block_id]:
        return f"block {block_id}: free"  # short: most cells of a big pool are free
    return (
        f"block {block_id}<br>state: {snapshot.states[block_id]}"
        f"<br>request: {html.escape(owner) if owner else '-'}"
        f"<br>tokens filled: {snapshot.tokens_filled[block_id]} / {snapshot.block_size}"
        f"<br>ref count: {snapshot.ref_counts[block_id]}"
    )


def build_cells(snapshot: BlockSnapshot, max_cells: int = MAX_CELLS) -> tuple[list[Cell], int]:
    """The grid's cells and how many blocks each stands for."""
    n = snapshot.num_blocks
    per_cell = max(1, math.ceil(n / max_cells))
    cells = []
    for start in range(0, n, per_cell):
        ids = range(start, min(n, start + per_cell))
        shared = any(snapshot.ref_counts[b] > 1 for b in ids)
        if per_cell == 1:
            cells.append(
                Cell(_block_category(snapshot, start), _block_hover(snapshot, start), shared)
            )
            continue
        cats = Counter(_block_category(snapshot, b) for b in ids)
        held = [c for c in cats if c not in ("free", "cached")]
        category = max(held, key=cats.__getitem__) if held else cats.most_common(1)[0][0]
        states = Counter(snapshot.states[b] for b in ids)
        hover = f"blocks {ids[0]}-{ids[-1]}<br>" + "<br>".join(
            f"{s}: {k}" for s, k in states.most_common()
        )
        owners = Counter(snapshot.owners[b] for b in ids if snapshot.owners[b])
        if owners:
            hover += "<br>requests: " + ", ".join(html.escape(o) for o, _ in owners.most_common(4))
        cells.append(Cell(category, hover, shared))
    return cells, per_cell


def _category_color(category: str) -> str:
    if category == "free":
        return FREE_COLOR
    if category == "cached":
        return CACHED_COLOR
    state, _, owner = category.partition(":")
    if not owner:
        return "#fde68a"  # an unknown state: visible, never mistaken for free
    return owner_color(owner) if state == "used" else tint(owner_color(owner))


def _category_label(category: str) -> str:
    state, _, owner = category.partition(":")
    if not owner:
        return {"free": "free", "cached": "free, prefix-cached"}.get(state, state)
    return owner if state == "used" else f"{owner} (reserved, empty)"


def _stepped_colorscale(colors: list[str]) -> list[list[float | str]]:
    """Category i (z = i) gets colors[i]: constant over [i/m, (i+1)/m]."""
    m = len(colors)
    if m == 1:
        return [[0.0, colors[0]], [1.0, colors[0]]]
    scale: list[list[float | str]] = []
    for i, color in enumerate(colors):
        scale += [[i / m, color], [(i + 1) / m, color]]
    return scale


def grid_columns(num_cells: int) -> int:
    return 32 if num_cells <= 512 else 64


def block_map_figure(
    snapshot: BlockSnapshot, title: str | None = None, max_cells: int = MAX_CELLS
) -> go.Figure:
    # Refreshed every second: traces are plain dicts and the grid numpy arrays, so Plotly
    # validates each once (trace objects would be deep-copied into the figure).
    cells, per_cell = build_cells(snapshot, max_cells)
    cols = grid_columns(len(cells))
    rows = max(1, math.ceil(len(cells) / cols))
    categories = sorted({c.category for c in cells}, key=_category_sort_key)
    index = {cat: i for i, cat in enumerate(categories)}
    z = np.full(rows * cols, np.nan)
    text = np.full(rows * cols, "", dtype=object)
    z[: len(cells)] = [index[c.category] for c in cells]
    text[: len(cells)] = [c.hover for c in cells]
    colors = [_category_color(c) for c in categories]
    traces: list[dict] = [
        {
            "type": "heatmap", "z": z.reshape(rows, cols), "text": text.reshape(rows, cols),
            "hovertemplate": "%{text}<extra></extra>", "showscale": False,
            "colorscale": _stepped_colorscale(colors), "zmin": -0.5,
            "zmax": len(colors) - 0.5, "xgap": 1, "ygap": 1,
        }
    ]  # fmt: skip
    shared = [(i % cols, i // cols) for i, c in enumerate(cells) if c.shared]
    if shared:
        traces.append(
            {
                "type": "scatter", "x": [p[0] for p in shared], "y": [p[1] for p in shared],
                "mode": "markers", "marker": {"symbol": "circle", "size": 5, "color": "black"},
                "name": "shared (ref count > 1)", "hoverinfo": "skip",
            }
        )  # fmt: skip
    traces += _legend_traces(categories)
    used = sum(s != "free" and s != "cached" for s in snapshot.states)
    head = title or "Block map"
    unit = f" · one cell = {per_cell} blocks" if per_cell > 1 else ""
    subtitle = (
        f"{head}: {used} / {snapshot.num_blocks} blocks held ({snapshot.layout} layout, "
        f"{snapshot.block_size} tokens per block){unit}"
    )
    fig = go.Figure(
        data=traces,
        layout={
            "xaxis": {"visible": False, "range": [-0.5, cols - 0.5]},
            "yaxis": {"visible": False, "autorange": "reversed"},
        },
    )
    base_layout(fig, subtitle, height=min(900, max(200, rows * 22 + 110)))
    fig.update_layout(legend={"y": -0.02, "yanchor": "top"}, margin={"b": 10})
    return fig


def _category_sort_key(category: str) -> tuple[int, str]:
    order = {"free": 0, "cached": 1}
    if category in order:
        return (order[category], category)
    return (2, category.partition(":")[2] + category)


def _legend_traces(categories: list[str]) -> list[dict]:
    """Invisible one-marker traces: the heatmap itself has no legend."""
    owners = [c for c in categories if c.startswith("used:") or c.startswith("reserved:")]
    shown = [c for c in categories if c not in owners] + owners[: 2 * MAX_LEGEND_OWNERS]
    traces = [
        {
            "type": "scatter", "x": [None], "y": [None], "mode": "markers",
            "name": _category_label(cat),
            "marker": {"symbol": "square", "size": 12, "color": _category_color(cat),
                       "line": {"width": 1, "color": "#9ca3af"}},
        }
        for cat in shown
    ]  # fmt: skip
    hidden = len(categories) - len(shown)
    if hidden > 0:
        traces.append({"type": "scatter", "x": [None], "y": [None], "mode": "markers",
                       "name": f"+{hidden} more"})  # fmt: skip
    return traces


def usage_gauge(num_used_blocks: int, num_blocks: int, title: str = "KV cache usage") -> go.Figure:
    """Fraction of the pool's blocks held by requests (vLLM's kv_cache_usage_perc)."""
    pct = 100.0 * num_used_blocks / num_blocks if num_blocks else 0.0
    fig = go.Figure(
        go.Indicator(
            mode="gauge+number",
            value=pct,
            number={"suffix": " %", "valueformat": ".1f"},
            title={"text": f"{title}<br><sub>{num_used_blocks} / {num_blocks} blocks</sub>"},
            gauge={
                "axis": {"range": [0, 100]},
                "bar": {"color": "#2563eb"},
                "steps": [{"range": [90, 100], "color": "#fee2e2"}],
            },
        )
    )
    fig.update_layout(height=230, margin={"l": 25, "r": 25, "t": 60, "b": 10})
    return fig
