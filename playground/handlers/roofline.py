"""Roofline tab logic: which roof (this device measured once, or a datasheet preset) and the
engine's recent steps placed under it."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import plotly.graph_objects as go

from engine.telemetry.ceilings import (
    PRESETS,
    DeviceCeilings,
    best_of_runs,
    get_ceilings,
    measure_ceilings,
    remember_ceilings,
    roof_fraction,
)
from engine.telemetry.stats import StepStats
from playground.figures.roofline import roofline_figure
from playground.figures.style import fmt_si, plural

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


MEASURE_REPEATS = 3  # a re-measure keeps the best of these: a busy CPU only ever slows one


def roof_choices() -> list[str]:
    return [MEASURED, *PRESETS]


def is_better(new: DeviceCeilings, old: DeviceCeilings) -> bool:
    """The new roof is at least as high as the old one on bandwidth and on every shared peak
    (a lower roof usually means the machine was busy while measuring)."""
    shared = set(new.peak_flops_per_s) & set(old.peak_flops_per_s)
    return new.bandwidth_bytes_per_s >= old.bandwidth_bytes_per_s and all(
        new.peak_flops_per_s[k] >= old.peak_flops_per_s[k] for k in shared
    )


class CeilingsProvider:
    """This device's ceilings, measured at most once (engine.telemetry.ceilings caches them on
    disk too). A re-measure keeps the best of repeats and replaces the shown (and cached) roof
    only when it is higher; a lower one is kept beside it as `latest` and said so."""

    def __init__(self, device: str, measure=measure_ceilings) -> None:
        self.device = device
        self._measure = measure
        self._measured: DeviceCeilings | None = None
        self.latest: DeviceCeilings | None = None  # the last re-measure, when it was not kept
        self._lock = threading.Lock()

    @property
    def measured_yet(self) -> bool:
        return self._measured is not None

    def measured(self) -> DeviceCeilings:
        with self._lock:
            if self._measured is None:
                self._measured = get_ceilings(self.device)
            return self._measured

    def remeasure(
        self,
        repeats: int = MEASURE_REPEATS,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> tuple[DeviceCeilings, bool]:
        """Measures `repeats` times; returns (best of them, whether it is now the shown roof)."""
        runs = []
        for i in range(repeats):
            if on_progress is not None:
                on_progress(i, repeats)
            runs.append(self._measure(self.device))
        new = best_of_runs(runs, datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
        old = self.measured()
        with self._lock:
            if is_better(new, old):
                self._measured, self.latest = new, None
                remember_ceilings(new, self.device)
                return new, True
            self.latest = new
            return new, False

    def get(self, choice: str) -> DeviceCeilings:
        if choice == MEASURED:
            return self.measured()
        if choice not in PRESETS:
            raise ValueError(f"roof: pick one of {', '.join(roof_choices())}")
        return PRESETS[choice]


def remeasure_note(new: DeviceCeilings, kept: bool, shown: DeviceCeilings, dtype: str) -> str:
    """What a re-measure found, said next to the roof it leaves shown."""

    def roof(c: DeviceCeilings) -> str:
        return (
            f"{fmt_si(c.peak(dtype), 'FLOP/s')} / {fmt_si(c.bandwidth_bytes_per_s, 'B/s')} "
            f"({c.source.split(';')[0]})"
        )

    if kept:
        return f"**Re-measured:** the new roof {roof(new)} is shown (it is not lower)."
    return (
        f"**Re-measured, not kept:** the new roof {roof(new)} is lower than the one shown, "
        f"{roof(shown)}: the machine was probably busy. The better (shown) roof stays cached."
    )


def caption(ceilings: DeviceCeilings, dtype: str, steps: Sequence[StepStats], device: str) -> str:
    kinds = {}
    for kind in ("prefill", "decode", "mixed"):
        chosen = [s for s in steps if s.kind == kind and s.duration_s > 0 and s.flops > 0]
        if chosen:
            fractions = [
                roof_fraction(ceilings, dtype, s.flops, s.bytes_moved, s.duration_s) for s in chosen
            ]
            kinds[kind] = (len(chosen), statistics.median(fractions))
    points = ", ".join(
        f"{plural(n, f'{k} step')} (median {f:.1%} of the roof)" for k, (n, f) in kinds.items()
    )
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


def roof_dtype(ceilings: DeviceCeilings, dtype: str, fallback: str) -> tuple[str, str]:
    """The dtype whose peak is the compute roof: `dtype` (what the matmuls multiply) where
    this roof has its peak, else `fallback` (the model dtype), with a note saying so."""
    if dtype in ceilings.peak_flops_per_s:
        if dtype == "int8" and dtype != fallback:
            return dtype, (
                "**Compute roof: int8 products** (`torch._int_mm`): the quantized linears "
                "multiply int8 activations (int8_activations); attention and the small ops stay "
                f"{fallback}."
            )
        return dtype, ""
    how = " (Re-measure adds it)" if ceilings.measured else ""
    return fallback, (
        f"**No {dtype} peak in this roof** ({ceilings.source.split(';')[0]}){how}: drawn with "
        f"the {fallback} peak, which the {dtype} products can run above."
    )


def roofline_view(
    provider: CeilingsProvider,
    choice: str,
    dtype: str,
    steps: Sequence[StepStats],
    model_dtype: str | None = None,
) -> tuple[go.Figure, str]:
    """The roofline at `dtype`'s peak (the matmuls' element type: "int8" with int8
    activations; else the model dtype, which `model_dtype` names when they differ)."""
    ceilings = provider.get(choice)
    dtype, note = roof_dtype(ceilings, dtype, model_dtype or dtype)
    fig = roofline_figure(ceilings, dtype, steps)
    if not any(s.flops > 0 and s.duration_s > 0 for s in steps):
        _note(fig, "No engine steps yet: send a message in Chat or run a load test.")
    text = caption(ceilings, dtype, steps, provider.device)
    if note:
        text = f"{note}\n\n{text}"
    if choice == MEASURED and provider.latest is not None:  # said on every redraw, not once
        text = f"{remeasure_note(provider.latest, False, ceilings, dtype)}\n\n{text}"
    return fig, text


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
