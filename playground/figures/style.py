"""Shared look of every Plotly figure: colors, layout defaults, the empty-state figure."""

from __future__ import annotations

import zlib

import plotly.graph_objects as go
import plotly.io as pio

# One color per step kind / segment, used by every chart so a reader learns them once.
KIND_COLORS = {
    "prefill": "#2563eb",  # blue
    "decode": "#f97316",  # orange
    "mixed": "#9333ea",  # purple
    "idle": "#9ca3af",
}
SEGMENT_COLORS = {"queue": "#9ca3af", "prefill": KIND_COLORS["prefill"], "decode": "#f97316"}
SIDE_COLORS = ("#2563eb", "#dc2626")  # compare: side A, side B
# Block states are grays and black, so no request color can be mistaken for one: requests get
# only saturated hues (no gray, no near-white in OWNER_PALETTE).
FREE_COLOR = "#eef0f3"  # near white: the empty pool recedes
CACHED_COLOR = "#9ca3af"  # mid gray: free, but still holds a prefix-cache hit
SHARED_COLOR = "#111827"  # near black: held by several requests (ref count > 1)
UNKNOWN_STATE_COLOR = "#fde68a"  # a state this UI does not know: visible, never "free"
FAILED_COLOR = "#dc2626"

# Request colors: 20 saturated hues (Tableau-20's dark and mid rows, gray left out).
OWNER_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#393b79",
    "#637939",
    "#8c6d31",
    "#843c39",
    "#7b4173",
    "#3182bd",
    "#e6550d",
    "#31a354",
    "#756bb1",
    "#d6616b",
    "#ce6dbd",
)


def owner_color_index(request_id: str) -> int:
    """Stable per request (never an arrival order that shifts between refreshes): "req-<n>"
    takes n mod the palette, so the 20 requests issued one after another never share a color;
    other ids hash."""
    _, _, number = request_id.rpartition("-")
    if number.isdigit():
        return int(number) % len(OWNER_PALETTE)
    return zlib.crc32(request_id.encode()) % len(OWNER_PALETTE)


def owner_color(request_id: str) -> str:
    return OWNER_PALETTE[owner_color_index(request_id)]


def tint(hex_color: str, amount: float = 0.65) -> str:
    """The color mixed with white: amount 0 keeps it, 1 gives white."""
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * amount) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


# Looked up once: update_layout(template="plotly_white") would resolve and copy it per call.
_TEMPLATE = pio.templates["plotly_white"]


def base_layout(fig: go.Figure, title: str | None = None, height: int = 320) -> go.Figure:
    fig.update_layout(
        # The title sits at the very top, the legend just above the plot area under it.
        title={
            "text": title,
            "x": 0.01,
            "y": 1.0,
            "yref": "container",
            "yanchor": "top",
            "pad": {"t": 10},
            "font": {"size": 14},
        }
        if title
        else None,
        height=height,
        margin={"l": 55, "r": 20, "t": 75 if title else 30, "b": 45},
        template=_TEMPLATE,
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
        hoverlabel={"namelength": -1},
        uirevision="keep",  # keep zoom and hidden traces across timer refreshes
    )
    return fig


def empty_figure(message: str, title: str | None = None, height: int = 240) -> go.Figure:
    """A blank chart that says what to do to fill it."""
    fig = go.Figure()
    fig.add_annotation(
        text=message,
        showarrow=False,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        font={"size": 14, "color": "#6b7280"},
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return base_layout(fig, title, height)


def plural(count: int, noun: str) -> str:
    """plural(1, "step") -> '1 step', plural(3, "step") -> '3 steps' (nouns taking an -s)."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def fmt_si(value: float, unit: str = "") -> str:
    """1.2e12 -> '1.20 T' + unit: compact numbers for hover text."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def fmt_bytes(num_bytes: float) -> str:
    """Binary units: 536870912 -> '512 MiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.4g} {unit}"
        value /= 1024
    return f"{value:.4g} TiB"
