"""Roofline tab: this device's measured roof (or a datasheet preset) on log-log axes with the
engine's recent steps as points. In remote mode: datasheet roofs only, and why no points."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import gradio as gr
import plotly.graph_objects as go

from playground.context import AppContext
from playground.handlers.roofline import (
    HOW_TO_READ,
    MEASURE_REPEATS,
    MEASURED,
    NO_REMOTE_STEPS,
    PRESETS,
    remeasure_note,
    remote_roofline_view,
    roof_choices,
    roofline_view,
)
from playground.tabs.plot_stream import PlotStream

REFRESH_S = 2.0


def create_ui(ctx: AppContext) -> SimpleNamespace:
    if ctx.remote is not None:
        return _create_remote_ui()
    ui = SimpleNamespace()
    with gr.Row():
        ui.roof = gr.Dropdown(roof_choices(), value=MEASURED, label="Roof", scale=2)
        ui.refresh = gr.Button("Refresh points", scale=1, elem_id="roofline-refresh")
        ui.remeasure = gr.Button("Re-measure this device", scale=1)
        ui.auto = gr.Checkbox(True, label="Auto-refresh (2 s)", scale=1)
    ui.figure = gr.Plot(show_label=False, label="Roofline", elem_id="roofline-plot")
    ui.caption = gr.Markdown(
        "Open this tab to measure this device's ceilings (a few seconds, once; cached on "
        f"disk).\n\n{HOW_TO_READ}",
        elem_id="roofline-caption",
    )
    ui.timer = gr.Timer(REFRESH_S, active=False)
    ui.num_steps = gr.State(None)
    ui.stream = PlotStream("roofline-refresh")
    return ui


def _create_remote_ui() -> SimpleNamespace:
    ui = SimpleNamespace()
    presets = list(PRESETS)
    with gr.Row():
        ui.roof = gr.Dropdown(presets, value=presets[0], label="Roof (datasheet)", scale=2)
        ui.refresh = gr.Button("Draw", scale=1)
    ui.figure = gr.Plot(show_label=False, label="Roofline", elem_id="roofline-plot")
    ui.caption = gr.Markdown(NO_REMOTE_STEPS, elem_id="roofline-caption")
    return ui


def _create_remote_handlers(ui: SimpleNamespace) -> None:
    def draw(choice):
        try:
            return remote_roofline_view(choice)
        except ValueError as e:
            return gr.skip(), f"**Could not draw the roofline:** {e}"

    outputs = [ui.figure, ui.caption]
    common = {"concurrency_id": "roofline", "concurrency_limit": 2, "show_progress": "minimal"}
    ui.refresh.click(draw, [ui.roof], outputs, api_name="roofline", **common)
    ui.roof.change(draw, [ui.roof], outputs, api_visibility="private", **common)
    ui.tab.select(draw, [ui.roof], outputs, api_visibility="private", **common)


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    if ctx.remote is not None:
        _create_remote_handlers(ui)
        return
    dtype = ctx.info.dtype
    matmul_dtype = ctx.info.matmul_dtype or dtype  # "int8" with int8 activations

    def draw(choice, last_num_steps=None, auto=True, force=True, note=""):
        if not auto and not force:
            return gr.skip(), gr.skip(), gr.skip()
        stats = ctx.service.stats()
        if not force and stats.num_steps_total == last_num_steps:
            return gr.skip(), gr.skip(), gr.skip()
        try:
            fig, caption = roofline_view(ctx.ceilings, choice, matmul_dtype, stats.steps, dtype)
        except (ValueError, KeyError, RuntimeError) as e:
            gr.Warning(f"Roofline: {e}")
            return gr.skip(), f"**Could not draw the roofline:** {e}", last_num_steps
        return fig, (f"{note}\n\n{caption}" if note else caption), stats.num_steps_total

    def tick(choice, last_num_steps, auto):
        """The new points, redrawn in place in the browser (plot_stream.py says why)."""
        fig, caption, num_steps = draw(choice, last_num_steps, auto, force=False)
        figure = fig if isinstance(fig, go.Figure) else None  # else skipped: unchanged
        return caption, ui.stream.encode({"roofline-plot": figure}), num_steps

    async def remeasure(choice, last_num_steps, progress=gr.Progress()):
        """Best of MEASURE_REPEATS runs, with progress; the caption says what was kept."""
        skip = gr.skip()

        def step(i: int, n: int) -> None:
            progress((i, n), desc=f"Measuring this device's ceilings, run {i + 1} of {n}")

        yield skip, f"**Measuring this device's ceilings** ({MEASURE_REPEATS} runs)...", skip
        try:
            new, kept = await asyncio.to_thread(ctx.ceilings.remeasure, on_progress=step)
        except RuntimeError as e:
            yield skip, f"**The measurement failed:** {e}", skip
            return
        # A lower roof that was not kept is named by roofline_view itself, on every redraw.
        note = remeasure_note(new, kept, ctx.ceilings.measured(), dtype) if kept else ""
        if not kept:
            gr.Warning("Re-measured roof is lower than the cached one: kept the better one.")
        yield draw(choice, last_num_steps, note=note)

    outputs = [ui.figure, ui.caption, ui.num_steps]
    common = {"concurrency_id": "roofline", "concurrency_limit": 2, "show_progress": "minimal"}
    ui.refresh.click(draw, [ui.roof, ui.num_steps], outputs, api_name="roofline", **common)
    ui.roof.change(draw, [ui.roof, ui.num_steps], outputs, api_visibility="private", **common)
    ui.remeasure.click(
        remeasure,
        [ui.roof, ui.num_steps],
        outputs,
        api_name="remeasure",
        **{**common, "show_progress": "full"},
    )
    ui.tab.select(draw, [ui.roof, ui.num_steps], outputs, api_visibility="private", **common)
    ticked = ui.timer.tick(
        tick,
        [ui.roof, ui.num_steps, ui.auto],
        [ui.caption, ui.stream.payload, ui.num_steps],
        trigger_mode="once",
        api_visibility="undocumented",
        **{**common, "show_progress": "hidden"},
    )
    ui.stream.attach(ticked)
