"""Engine (live) tab: the block map, KV usage gauge, request queues, per-step batch
composition and (with speculative decoding) draft acceptance by position, refreshed by a 1 s
timer while the tab is open."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.figures.engine import DEFAULT_WINDOW, TIMELINE_WINDOWS_S
from playground.handlers.live import live_view
from playground.tabs.plot_stream import PlotStream

REFRESH_S = 1.0


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    ui.summary = gr.Markdown("Loading the engine's state...", elem_id="live-summary")
    with gr.Row():
        with gr.Column(scale=3):
            ui.block_map = gr.Plot(show_label=False, label="KV block map", elem_id="block-map")
        with gr.Column(scale=1, min_width=240):
            ui.gauge = gr.Plot(show_label=False, label="KV usage", elem_id="kv-gauge")
            with gr.Row():
                ui.refresh = gr.Button("Refresh now", size="sm", elem_id="live-refresh")
                ui.auto = gr.Checkbox(True, label="Auto-refresh (1 s)")
            gr.Markdown(
                "Each cell is one KV block of the pool (on a big pool, a run of blocks: the "
                "title says how many). Its color is the request holding it; the legend lists "
                "the requests holding the most blocks. Near-white cells are free. A lighter "
                "tint marks blocks *reserved but not yet filled* (the contiguous layout "
                "reserves max_model_len up front). With prefix caching, gray *free, "
                "prefix-cached* blocks still hold a full block of an earlier prompt for the "
                "next request that starts the same way, and black ones are *shared* by "
                "several requests. Hover a cell for its block id, owner, tokens filled and "
                "ref count."
            )
    ui.queue = gr.HTML(elem_id="live-queue")
    ui.timeline = gr.Plot(
        show_label=False, label="Batch composition over time", elem_id="batch-timeline"
    )
    # Speculative decoding's view: only for an engine that drafts (its config is fixed).
    ui.speculative = ctx.info.config.speculative_method != "off"
    ui.acceptance = gr.Plot(
        show_label=False, label="Draft acceptance by position", elem_id="spec-acceptance",
        visible=ui.speculative,
    )  # fmt: skip
    ui.window = gr.Radio(
        list(TIMELINE_WINDOWS_S),
        value=DEFAULT_WINDOW,
        label="Timeline window",
        elem_id="timeline-window",
    )
    ui.timer = gr.Timer(REFRESH_S, active=False)
    ui.signature = gr.State(None)
    ui.stream = PlotStream("live-refresh")
    return ui


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    outputs = [ui.summary, ui.block_map, ui.gauge, ui.queue, ui.timeline, ui.acceptance,
               ui.signature]  # fmt: skip
    # A timer tick sends its plots through the stream's payload instead (plot_stream.py).
    tick_outputs = [ui.summary, ui.queue, ui.stream.payload, ui.signature]

    def view_of(last_signature, window):
        window_s = TIMELINE_WINDOWS_S.get(window, TIMELINE_WINDOWS_S[DEFAULT_WINDOW])
        return live_view(ctx.service, window_s, last_signature, speculative=ui.speculative)

    def refresh_now(last_signature, window=DEFAULT_WINDOW):
        sig, view = view_of(None, window)
        views = [view.summary_md, view.block_map, view.gauge, view.queue_html, view.timeline,
                 view.acceptance]  # fmt: skip
        return [gr.skip() if v is None else v for v in views] + [sig]

    def tick(last_signature, window=DEFAULT_WINDOW, auto=True):
        if not auto:
            return [gr.skip(), gr.skip(), "", gr.skip()]
        sig, view = view_of(last_signature, window)
        # None: unchanged since the last tick, so nothing is sent for it.
        text = [gr.skip() if v is None else v for v in (view.summary_md, view.queue_html)]
        figures = {"block-map": view.block_map, "kv-gauge": view.gauge,
                   "batch-timeline": view.timeline, "spec-acceptance": view.acceptance}  # fmt: skip
        return [*text, ui.stream.encode(figures), sig]

    # One live group: timers of every open browser tab share a few workers, and a tick that
    # finds the previous one still queued is dropped rather than piled up.
    live = {"concurrency_limit": 4, "concurrency_id": "live", "show_progress": "hidden"}
    ticked = ui.timer.tick(
        tick,
        [ui.signature, ui.window, ui.auto],
        tick_outputs,
        trigger_mode="once",
        api_visibility="undocumented",
        **live,
    )
    ui.stream.attach(ticked)
    now = [ui.signature, ui.window]
    ui.refresh.click(refresh_now, now, outputs, api_name="live_refresh", **live)
    ui.tab.select(refresh_now, now, outputs, api_visibility="private", **live)
    ui.window.change(refresh_now, now, outputs, api_visibility="private", **live)
