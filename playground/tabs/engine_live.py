"""Engine (live) tab: the block map, KV usage gauge, request queues and per-step batch
composition, refreshed by a 1 s timer while the tab is open."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.handlers.live import live_view

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
                ui.refresh = gr.Button("Refresh now", size="sm")
                ui.auto = gr.Checkbox(True, label="Auto-refresh (1 s)")
            gr.Markdown(
                "Each cell is one KV block of the pool. Its color is the request holding it "
                "(legend); gray cells are free. A lighter tint marks blocks *reserved but not "
                "yet filled* (the contiguous layout reserves max_model_len up front). With "
                "prefix caching, *free, prefix-cached* blocks still hold a full block of an "
                "earlier prompt for the next request that starts the same way, and a dot marks "
                "a block shared by several requests. Hover a cell for its block id, owner, "
                "tokens filled and ref count."
            )
    ui.queue = gr.HTML(elem_id="live-queue")
    ui.timeline = gr.Plot(
        show_label=False, label="Batch composition per step", elem_id="batch-timeline"
    )
    ui.timer = gr.Timer(REFRESH_S, active=False)
    ui.signature = gr.State(None)
    return ui


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    outputs = [ui.summary, ui.block_map, ui.gauge, ui.queue, ui.timeline, ui.signature]

    def refresh(last_signature, auto=True, force=False):
        if not auto and not force:
            return [gr.skip()] * len(outputs)
        sig, view = live_view(ctx.service)
        if sig == last_signature and not force:
            return [gr.skip()] * len(outputs)  # nothing changed: send nothing
        return [view.summary_md, view.block_map, view.gauge, view.queue_html, view.timeline, sig]

    def refresh_now(last_signature):
        return refresh(last_signature, force=True)

    # One live group: timers of every open browser tab share a few workers, and a tick that
    # finds the previous one still queued is dropped rather than piled up.
    live = {"concurrency_limit": 4, "concurrency_id": "live", "show_progress": "hidden"}
    ui.timer.tick(
        refresh,
        [ui.signature, ui.auto],
        outputs,
        trigger_mode="once",
        api_visibility="undocumented",
        **live,
    )
    ui.refresh.click(refresh_now, [ui.signature], outputs, api_name="live_refresh", **live)
    ui.tab.select(refresh_now, [ui.signature], outputs, api_visibility="private", **live)
