"""The block map (one grid cell per KV block, or per run of blocks on a big pool) and the KV
usage gauge.

Cheap to redraw every second however big the pool: ONE heatmap trace of small integer color
codes on a fixed colorscale (the browser paints it as one image, not a shape per cell), at
most MAX_CELLS cells (a GPU pool of 100k blocks shows ~25 blocks per cell), and a compact grid
whose height grows with the pool. The legend comes from a few invisible marker traces: the
states, then the requests holding the most blocks (at most MAX_LEGEND_OWNERS, never two of one
color) and "+K more".
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
    OWNER_PALETTE,
    SHARED_COLOR,
    UNKNOWN_STATE_COLOR,
    base_layout,
    owner_color_index,
    tint,
)

MAX_CELLS = 2048  # above this, one cell stands for several consecutive blocks
MAX_LEGEND_OWNERS = 12
CELL_PX = 9  # row height of a big grid; small pools get taller cells

# Fixed color codes: z in the heatmap is an index into COLORS, the same on every refresh.
FREE, CACHED, SHARED, UNKNOWN = 0, 1, 2, 3
USED_BASE = 4  # USED_BASE + palette index: a block a request filled (or is filling)
RESERVED_BASE = USED_BASE + len(OWNER_PALETTE)  # + palette index: reserved, not yet filled
COLORS = (
    FREE_COLOR,
    CACHED_COLOR,
    SHARED_COLOR,
    UNKNOWN_STATE_COLOR,
    *OWNER_PALETTE,
    *(tint(c) for c in OWNER_PALETTE),
)
STATE_LABELS = {
    FREE: "free",
    CACHED: "free, prefix-cached",
    SHARED: "shared (ref count > 1)",
    UNKNOWN: "other state",
}


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


def blocks_per_cell(num_blocks: int, max_cells: int = MAX_CELLS) -> int:
    return max(1, math.ceil(num_blocks / max_cells))


def build_cells(snapshot: BlockSnapshot, max_cells: int = MAX_CELLS) -> tuple[list[Cell], int]:
    """The grid's cells and how many blocks each stands for. A run's category is its most
    common request (a held block outweighs any number of free ones), else cached, else free."""
    n = snapshot.num_blocks
    per_cell = blocks_per_cell(n, max_cells)
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


def color_code(category: str, shared: bool) -> int:
    """The cell's index into COLORS."""
    if category == "free":
        return FREE
    if category == "cached":
        return CACHED
    state, _, owner = category.partition(":")
    if not owner:
        return UNKNOWN  # visible, never mistaken for free
    if shared:
        return SHARED
    base = USED_BASE if state == "used" else RESERVED_BASE
    return base + owner_color_index(owner)


def grid_columns(num_cells: int) -> int:
    """Wide and short: 32 columns for a tiny pool, 128 for the biggest grids."""
    if num_cells <= 512:
        return 32
    return 64 if num_cells <= 1024 else 128


def _fixed_colorscale() -> list[list[float | str]]:
    """Code i (z = i) gets COLORS[i]: constant over [i/m, (i+1)/m]."""
    m = len(COLORS)
    scale: list[list[float | str]] = []
    for i, color in enumerate(COLORS):
        scale += [[i / m, color], [(i + 1) / m, color]]
    return scale


_COLORSCALE = _fixed_colorscale()


def block_map_figure(
    snapshot: BlockSnapshot, title: str | None = None, max_cells: int = MAX_CELLS
) -> go.Figure:
    # Refreshed every second: traces are plain dicts and the grid numpy arrays, so Plotly
    # validates each once (trace objects would be deep-copied into the figure).
    cells, per_cell = build_cells(snapshot, max_cells)
    cols = grid_columns(len(cells))
    rows = max(1, math.ceil(len(cells) / cols))
    z = np.full(rows * cols, np.nan)
    text = np.full(rows * cols, "", dtype=object)
    z[: len(cells)] = [color_code(c.category, c.shared) for c in cells]
    text[: len(cells)] = [c.hover for c in cells]
    gap = 1 if rows * cols <= 1024 else 0  # gaps on a big grid would be most of its pixels
    heat = {
        "type": "heatmap", "z": z.reshape(rows, cols), "text": text.reshape(rows, cols),
        "hovertemplate": "%{text}<extra></extra>", "showscale": False,
        "colorscale": _COLORSCALE, "zmin": -0.5, "zmax": len(COLORS) - 0.5,
        "xgap": gap, "ygap": gap, "name": "blocks", "showlegend": False,
    }  # fmt: skip
    traces = [heat, *_legend_traces(snapshot, cells)]
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
            "xaxis": {"visible": False, "range": [-0.5, cols - 0.5], "fixedrange": True},
            "yaxis": {"visible": False, "autorange": "reversed", "fixedrange": True},
        },
    )
    cell_px = 22 if rows <= 8 else 14 if rows <= 16 else CELL_PX
    base_layout(fig, subtitle, height=min(420, rows * cell_px + 120))
    fig.update_layout(legend={"y": -0.02, "yanchor": "top"}, margin={"b": 10})
    return fig


def _legend_traces(snapshot: BlockSnapshot, cells: list[Cell]) -> list[dict]:
    """Invisible one-marker traces (the heatmap has no legend): the states on the map, then the
    requests holding the most blocks, never two of one color, then "+K more"."""
    codes = {color_code(c.category, c.shared) for c in cells}
    entries = [(STATE_LABELS[code], COLORS[code]) for code in sorted(codes) if code < USED_BASE]
    held = Counter(
        (snapshot.owners[b], snapshot.states[b])
        for b in range(snapshot.num_blocks)
        if snapshot.owners[b] and snapshot.states[b] in ("used", "reserved")
    )
    by_owner = Counter()
    for (owner, _), k in held.items():
        by_owner[owner] += k
    shown_colors: set[int] = set()
    hidden = 0
    for owner, _ in sorted(by_owner.items(), key=lambda item: (-item[1], item[0])):
        color = owner_color_index(owner)
        if len(shown_colors) >= MAX_LEGEND_OWNERS or color in shown_colors:
            hidden += 1
            continue
        shown_colors.add(color)
        name = html.escape(owner)
        if held[(owner, "used")]:
            entries.append((name, COLORS[USED_BASE + color]))
        if held[(owner, "reserved")]:
            entries.append((f"{name} (reserved, empty)", COLORS[RESERVED_BASE + color]))
    traces = [
        {
            "type": "scatter", "x": [None], "y": [None], "mode": "markers", "name": name,
            "marker": {"symbol": "square", "size": 12, "color": color,
                       "line": {"width": 1, "color": "#9ca3af"}},
        }
        for name, color in entries
    ]  # fmt: skip
    if hidden:
        traces.append({"type": "scatter", "x": [None], "y": [None], "mode": "markers",
                       "marker": {"color": "rgba(0,0,0,0)"},
                       "name": f"+{hidden} more requests (hover a cell)"})  # fmt: skip
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
