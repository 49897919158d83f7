"""KV calculator chart: weights + KV cache per batch size against a GPU's memory (GB)."""

from __future__ import annotations

import plotly.graph_objects as go

from playground.figures.style import base_layout
from playground.handlers.kv import GB, TABLE_BATCH_SIZES, KVInputs, exceeds

FITS_COLOR = "#2563eb"
EXCEEDS_COLOR = "#dc2626"  # weights + KV above the usable memory: red, and in the legend


def memory_bars_figure(x: KVInputs) -> go.Figure:
    batches = sorted({*TABLE_BATCH_SIZES, x.batch_size})
    labels = [str(b) for b in batches]
    over = [exceeds(x, b) for b in batches]
    kv_gb = [x.kv(batch_size=b) / GB for b in batches]
    # The selected batch: a thick black outline (its color still says fits / exceeds).
    outline = [3 if b == x.batch_size else 0 for b in batches]
    fig = go.Figure()
    fig.add_bar(
        x=labels,
        y=[x.weights_bytes / GB] * len(batches),
        name="weights",
        marker_color="#9ca3af",
        hovertemplate="weights %{y:.1f} GB<extra></extra>",
    )
    for name, color, keep in (
        (f"KV cache, fits ({x.seq_len:,} tokens per request)", FITS_COLOR, False),
        ("KV cache, weights + KV exceed the usable memory", EXCEEDS_COLOR, True),
    ):
        fig.add_bar(
            x=labels,
            y=[kv if o == keep else None for kv, o in zip(kv_gb, over, strict=True)],
            name=name,
            marker={"color": color, "line": {"color": "#111827", "width": outline}},
            hovertemplate="batch %{x}<br>KV %{y:.2f} GB<extra></extra>",
        )
    fig.add_scatter(
        x=[str(x.batch_size)],
        y=[x.weights_bytes / GB + x.kv() / GB],
        mode="markers+text",
        text=["selected"],
        textposition="top center",
        marker={"symbol": "triangle-down", "size": 12, "color": "#111827"},
        name=f"selected batch ({x.batch_size}, outlined)",
        hoverinfo="skip",
    )
    total_gb = x.memory_gb
    fig.add_hline(
        y=total_gb,
        line={"color": "#111827", "dash": "dash"},
        annotation_text=f"{x.gpu}: {total_gb:g} GB",
        annotation_position="top left",
    )
    fig.add_hline(
        y=total_gb * x.memory_fraction,
        line={"color": "#6b7280", "dash": "dot"},
        annotation_text=f"usable ({x.memory_fraction:.0%})",
        annotation_position="bottom left",
    )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="batch size (concurrent requests)", type="category")
    fig.update_yaxes(title_text="GB (1e9 bytes)")
    title = f"{x.preset.name}, {x.num_kv_heads} KV heads: memory per batch size"
    return base_layout(fig, title, height=380)
