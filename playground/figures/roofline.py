"""The roofline: attainable FLOP/s = min(peak, intensity x bandwidth) on log-log axes, with the
engine's recent steps as points (achieved FLOP/s at their FLOP/byte)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go

from engine.telemetry.ceilings import DeviceCeilings, roof_fraction, roofline_curve
from engine.telemetry.stats import StepStats
from playground.figures.style import KIND_COLORS, base_layout, fmt_si


def marker_size(batch_size: int) -> float:
    """Marker diameter in px: area grows with the batch (sqrt keeps big batches readable)."""
    return 6.0 + 4.0 * math.sqrt(max(1, batch_size))


def decade_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten covering [lo, hi]: the log axes label only these, all in one notation
    (fmt_si: '100 TFLOP/s', '1 PFLOP/s'), never Plotly's mix of '10^15' and '100T'."""
    first = math.floor(math.log10(max(lo, 1e-30)))
    last = math.ceil(math.log10(max(hi, lo, 1e-30)))
    return [10.0**k for k in range(first, last + 1)]


DRAFT_COLOR = "#059669"  # green: the draft model's passes (speculative_method="draft")


def _point_hover(step: StepStats, fraction: float) -> str:
    return (
        f"step {step.step_index} ({step.kind})<br>batch {step.batch_size} requests: "
        f"{step.num_prefill_tokens} prefill + {step.num_decode_tokens} decode tokens"
        f"<br>FLOPs {fmt_si(step.flops)}<br>bytes {fmt_si(step.bytes_moved, 'B')}"
        f"<br>time {step.target_duration_s * 1e3:.2f} ms"
        f"<br>intensity {step.arithmetic_intensity:.3g} FLOP/B"
        f"<br>achieved {fmt_si(step.achieved_flops_per_s, 'FLOP/s')}"
        f"<br>{fraction:.1%} of the roof"
    )


def _add_draft_points(
    fig: go.Figure, ceilings: DeviceCeilings, dtype: str, steps: Sequence[StepStats]
) -> None:
    """speculative_method="draft": each step's draft-model passes as one point of their own
    (catch-up + k proposals; their FLOPs and bytes over the draft's share of the step)."""
    hover = []
    for s in steps:
        fraction = roof_fraction(
            ceilings, dtype, s.draft_flops, s.draft_bytes_moved, s.draft_duration_s
        )
        hover.append(
            f"step {s.step_index}: draft model<br>FLOPs {fmt_si(s.draft_flops)}<br>bytes "
            f"{fmt_si(s.draft_bytes_moved, 'B')}<br>time {s.draft_duration_s * 1e3:.2f} ms"
            f"<br>{fraction:.1%} of the roof"
        )
    fig.add_scatter(
        x=[s.draft_flops / s.draft_bytes_moved for s in steps],
        y=[s.draft_flops / s.draft_duration_s for s in steps],
        mode="markers",
        name="draft-model passes",
        marker={"color": DRAFT_COLOR, "size": 7, "symbol": "diamond", "opacity": 0.7},
        text=hover,
        hovertemplate="%{text}<extra></extra>",
    )


def roofline_figure(
    ceilings: DeviceCeilings, dtype: str, steps: Sequence[StepStats], max_points: int = 600
) -> go.Figure:
    steps = [s for s in steps if s.flops > 0 and s.bytes_moved > 0 and s.target_duration_s > 0]
    steps = steps[-max_points:]
    drafts = [s for s in steps if s.draft_flops > 0 and s.draft_duration_s > 0]
    intensities = [s.arithmetic_intensity for s in steps]
    intensities += [s.draft_flops / s.draft_bytes_moved for s in drafts]
    lo = min([0.1, *(i / 3 for i in intensities)])
    hi = max([1e4, *(i * 3 for i in intensities)])
    xs, ys = roofline_curve(ceilings, dtype, lo, hi)
    peak = ceilings.peak(dtype)
    ridge = ceilings.ridge_point(dtype)
    fig = go.Figure()
    fig.add_scatter(
        x=xs,
        y=ys,
        mode="lines",
        name="roof: min(peak, I x bandwidth)",
        line={"color": "#111827", "width": 2.5},
        hovertemplate="I=%{x:.3g} FLOP/B<br>attainable %{y:.3s}FLOP/s<extra>roof</extra>",
    )
    for kind in ("prefill", "decode", "mixed"):
        chosen = [s for s in steps if s.kind == kind]
        if not chosen:
            continue
        fractions = [
            roof_fraction(ceilings, dtype, s.flops, s.bytes_moved, s.target_duration_s)
            for s in chosen
        ]
        fig.add_scatter(
            x=[s.arithmetic_intensity for s in chosen],
            y=[s.achieved_flops_per_s for s in chosen],
            mode="markers",
            name=f"{kind} steps",
            marker={
                "color": KIND_COLORS[kind],
                "size": [marker_size(s.batch_size) for s in chosen],
                "opacity": 0.7,
                "line": {"width": 0.5, "color": "white"},
            },
            text=[_point_hover(s, f) for s, f in zip(chosen, fractions, strict=True)],
            hovertemplate="%{text}<extra></extra>",
        )
    if drafts:
        _add_draft_points(fig, ceilings, dtype, drafts)
    fig.add_vline(x=ridge, line={"dash": "dot", "color": "#6b7280"})
    # Right of the dotted line and under the flat roof, so the text crosses neither.
    fig.add_annotation(
        x=math.log10(ridge),
        y=math.log10(peak),
        text=f"ridge {ridge:.3g} FLOP/B",
        showarrow=False,
        xanchor="left",
        yanchor="top",
        xshift=6,
        yshift=-6,
        font={"size": 11, "color": "#374151"},
    )
    xs_all = [*xs, *intensities]
    ys_all = [*ys, *(s.achieved_flops_per_s for s in steps)]
    ys_all += [s.draft_flops / s.draft_duration_s for s in drafts]
    x_ticks = decade_ticks(min(xs_all), max(xs_all))
    y_ticks = decade_ticks(min(ys_all), max(ys_all))
    fig.update_xaxes(
        type="log",
        title_text="arithmetic intensity (FLOP / byte moved)",
        tickvals=x_ticks,
        ticktext=[fmt_si(v) for v in x_ticks],
    )
    fig.update_yaxes(
        type="log",
        title_text="FLOP/s",
        tickvals=y_ticks,
        ticktext=[fmt_si(v, "FLOP/s") for v in y_ticks],
    )
    kind = "measured" if ceilings.measured else "datasheet"
    title = (
        f"{ceilings.name} ({kind}, {dtype}): peak {fmt_si(peak, 'FLOP/s')}, "
        f"bandwidth {fmt_si(ceilings.bandwidth_bytes_per_s, 'B/s')}"
    )
    return base_layout(fig, title, height=460)
