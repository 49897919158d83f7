"""Roofline tab logic: which roof (this device measured once, or a datasheet preset) and the
engine's recent steps placed under it."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence

import plotly.graph_objects as go

from engine.telemetry.ceilings import PRESETS, DeviceCeilings, get_ceilings, roof_fraction
from engine.telemetry.stats import StepStats
from playground.figures.roofline import roofline_figure
from playground.figures.style import fmt_si

MEASURED = "this device (measured)"

HOW_TO_READ = (
    "**How to read it.** x is a step's arithmetic intensity (FLOPs per byte moved, estimated "
    "from the model's shapes), y the FLOP/s it achieved (FLOPs / measured step time). The black "
    "line is what the device allows at that intensity: left of the ridge the memory bandwidth "
    "caps a step (*memory-bound*), right of it the compute peak does. Decode reads every weight "
    "for one token per request, so it sits far left, memory-bound: **bigger batches move it "
    "right and up** (same weight bytes, more FLOPs). Prefill computes many tokens per weight "
    "read and lands near or right of the ridge. Point size grows with the batch."
)


def roof_choices() -> list[str]:
    return [MEASURED, *PRESETS]


class CeilingsProvider:
    """This device's ceilings, measured at most once (engine.telemetry.ceilings caches them on
    disk too), re-measured on request."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._measured: DeviceCeilings | None = None
        self._lock = threading.Lock()

    @property
    def measured_yet(self) -> bool:
        return self._measured is not None

    def measured(self, refresh: bool = False) -> DeviceCeilings:
        with self._lock:
            if self._measured is None or refresh:
                self._measured = get_ceilings(self.device, refresh=refresh)
            return self._measured

    def get(self, choice: str) -> DeviceCeilings:
        if choice == MEASURED:
            return self.measured()
        if choice not in PRESETS:
            raise ValueError(f"roof: pick one of {', '.join(roof_choices())}")
        return PRESETS[choice]


def caption(ceilings: DeviceCeilings, dtype: str, steps: Sequence[StepStats], device: str) -> str:
    kinds = {}
    for kind in ("prefill", "decode", "mixed"):
        chosen = [s for s in steps if s.kind == kind and s.duration_s > 0 and s.flops > 0]
        if chosen:
            fractions = [
                roof_fraction(ceilings, dtype, s.flops, s.bytes_moved, s.duration_s) for s in chosen
            ]
            kinds[kind] = (len(chosen), statistics.median(fractions))
    points = ", ".join(f"{n} {k} steps (median {f:.1%} of the roof)" for k, (n, f) in kinds.items())
    source = (
        f"Roof: {ceilings.source}. Ridge at {ceilings.ridge_point(dtype):.3g} FLOP/B "
        f"(peak {fmt_si(ceilings.peak(dtype), 'FLOP/s')} / bandwidth "
        f"{fmt_si(ceilings.bandwidth_bytes_per_s, 'B/s')})."
    )
    if not ceilings.measured:
        source += (
            f" The points were measured on this {device}, not on that GPU: against a datasheet "
            "roof they show how far this machine is from it."
        )
    return f"{points or 'No steps yet.'}\n\n{source}\n\n{HOW_TO_READ}"


def _note(fig: go.Figure, text: str) -> None:
    fig.add_annotation(
        text=text,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        showarrow=False,
        font={"size": 14, "color": "#6b7280"},
    )


def roofline_view(
    provider: CeilingsProvider, choice: str, dtype: str, steps: Sequence[StepStats]
) -> tuple[go.Figure, str]:
    ceilings = provider.get(choice)
    fig = roofline_figure(ceilings, dtype, steps)
    if not any(s.flops > 0 and s.duration_s > 0 for s in steps):
        _note(fig, "No engine steps yet: send a message in Chat or run a load test.")
    return fig, caption(ceilings, dtype, steps, provider.device)


REMOTE_DTYPE = "bfloat16"  # a remote server's weight dtype is unknown: bf16, the usual one
NO_REMOTE_STEPS = (
    "**The step points need our engine.** Where each step lands (its FLOPs, bytes moved and "
    "time) is read from the engine's own telemetry; a remote OpenAI server does not expose it. "
    "Run the playground with our engine (without `--base-url`) to see them. The roofs below "
    "are datasheet values (bf16 peak)."
)


def remote_roofline_view(choice: str) -> tuple[go.Figure, str]:
    """Remote mode: a datasheet roof with no points, and why there are none."""
    if choice not in PRESETS:
        raise ValueError(f"roof: pick one of {', '.join(PRESETS)}")
    ceilings = PRESETS[choice]
    fig = roofline_figure(ceilings, REMOTE_DTYPE, [])
    _note(fig, "Step points need our engine's telemetry (remote mode).")
    source = (
        f"Roof: {ceilings.name}, {ceilings.source}. Ridge at "
        f"{ceilings.ridge_point(REMOTE_DTYPE):.3g} FLOP/B "
        f"(peak {fmt_si(ceilings.peak(REMOTE_DTYPE), 'FLOP/s')} / bandwidth "
        f"{fmt_si(ceilings.bandwidth_bytes_per_s, 'B/s')})."
    )
    return fig, f"{NO_REMOTE_STEPS}\n\n{source}\n\n{HOW_TO_READ}"
