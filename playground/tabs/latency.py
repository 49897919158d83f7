"""Latency tab: TTFT / TPOT / ITL distributions of recent requests and engine throughput."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.handlers.latency import SUMMARY_HEADERS, WINDOWS_S, latency_view
from playground.tabs.plot_stream import PlotStream

REFRESH_S = 2.0


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    with gr.Row():
        ui.window = gr.Radio(list(WINDOWS_S), value="last 5 min", label="Window", scale=3)
        ui.refresh = gr.Button("Refresh", scale=1, elem_id="latency-refresh")
        ui.auto = gr.Checkbox(True, label="Auto-refresh (2 s)", scale=1)
    ui.summary = gr.Markdown(
        "No finished request yet: send a message in Chat or run a load test.",
        elem_id="latency-summary",
    )
    ui.cdfs = gr.Plot(show_label=False, label="Latency CDFs", elem_id="latency-cdfs")
    ui.table = gr.Dataframe(headers=SUMMARY_HEADERS, label="Summary (ms)", interactive=False)
    ui.throughput = gr.Plot(
        show_label=False, label="Throughput over time", elem_id="latency-throughput"
    )
    gr.Markdown(
        "A CDF point (x, y) reads: a fraction y of the requests (of the token gaps, for ITL) "
        "took at most x ms. A steep curve means steady latency; a long tail to the right means "
        "some requests waited, usually in the queue behind others or behind a long prefill."
    )
    ui.timer = gr.Timer(REFRESH_S, active=False)
    ui.num_finished = gr.State(None)
    ui.stream = PlotStream("latency-refresh")
    return ui


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    outputs = [ui.summary, ui.cdfs, ui.table, ui.throughput, ui.num_finished]
    # A timer tick sends its plots through the stream's payload instead (plot_stream.py).
    tick_outputs = [ui.summary, ui.table, ui.stream.payload, ui.num_finished]

    def draw(window, last, force=True):
        stats = ctx.service.stats()
        key = (stats.num_steps_total, len(stats.finished), window)
        if not force and key == last:
            return None, key
        return latency_view(stats, window), key

    def draw_all(window, last):
        view, key = draw(window, last)
        return [view.summary_md, view.cdfs, view.table, view.throughput, key]

    def tick(window, last, auto):
        if not auto:
            return [gr.skip(), gr.skip(), "", gr.skip()]
        view, key = draw(window, last, force=False)
        if view is None:
            return [gr.skip(), gr.skip(), "", key]
        payload = ui.stream.encode(
            {"latency-cdfs": view.cdfs, "latency-throughput": view.throughput}
        )
        return [view.summary_md, view.table, payload, key]

    common = {"concurrency_id": "latency", "concurrency_limit": 2}
    ui.refresh.click(draw_all, [ui.window, ui.num_finished], outputs, api_name="latency", **common)
    ui.window.change(
        draw_all, [ui.window, ui.num_finished], outputs, api_visibility="private", **common
    )
    ui.tab.select(
        draw_all, [ui.window, ui.num_finished], outputs, api_visibility="private", **common
    )
    ticked = ui.timer.tick(
        tick,
        [ui.window, ui.num_finished, ui.auto],
        tick_outputs,
        trigger_mode="once",
        show_progress="hidden",
        api_visibility="undocumented",
        **common,
    )
    ui.stream.attach(ticked)
