"""Compare tab in remote mode: the same seeded workload against two OpenAI-compatible servers
(A = the one the playground points at, B = another base URL), one after the other; the client's
numbers side by side and overlaid latency CDFs and output rates."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.handlers_compare import COMPARE_HEADERS, DEFAULT_COMPARE_WORKLOAD
from playground.handlers_compare_remote import (
    RemoteCompare,
    connect_side,
    remote_compare_rows,
    target_for,
)
from playground.handlers_loadtest import progress_html, spec_from_form
from playground.loadgen import build_requests
from playground.tabs.benchmark import BENCHMARK_QUEUE
from playground.tabs.compare import WORKLOAD_FIELDS, client_figures, stop_compare
from playground.tabs.workload_form import workload_form

POLL_S = 0.5


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    a = ctx.remote
    gr.Markdown(
        "Runs the same seeded requests against two OpenAI-compatible servers, one after the "
        "other, and puts what the client measured side by side. **Both must serve the same "
        "model**: the prompts are token ids from the tokenizer "
        f"`{ctx.tokenizer.name}`. Engine-side rows (steps, block maps, preemptions) need our "
        "engine: run the playground without `--base-url` to compare engine configurations."
    )
    with gr.Row():
        with gr.Column():
            gr.Markdown(f"### Side A\n\n`{a.base_url}`\n\nmodel `{a.model}`")
        with gr.Column():
            gr.Markdown("### Side B")
            ui.b_url = gr.Textbox(
                label="Base URL", placeholder="http://127.0.0.1:8001", elem_id="compare-b-url"
            )
            ui.b_model = gr.Textbox(label="Model (blank: the first of its /v1/models)")
            ui.b_key = gr.Textbox(label="API key (blank: none)", type="password")
        with gr.Column(scale=2):
            gr.Markdown("### Workload (both sides)")
            ui.form = workload_form(DEFAULT_COMPARE_WORKLOAD, WORKLOAD_FIELDS)
    with gr.Row():
        ui.run = gr.Button("Run compare", variant="primary", elem_id="compare-run")
        ui.stop = gr.Button("Stop", variant="stop")
    ui.progress = gr.HTML(progress_html(0, 0, 0.0, "not started"), elem_id="compare-progress")
    ui.status = gr.Markdown(
        "Give side B's base URL and press **Run compare**.", elem_id="compare-status"
    )
    ui.results = gr.Dataframe(
        headers=COMPARE_HEADERS,
        label="Side by side (measured by the client)",
        interactive=False,
        elem_id="compare-results",
        max_height=700,
    )
    with gr.Row():
        ui.cdfs = gr.Plot(show_label=False, label="Latency CDFs, A vs B")
        ui.rate = gr.Plot(show_label=False, label="Output tokens/s over time")
    return ui


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    names = list(ui.form)
    current: dict[str, RemoteCompare | None] = {"run": None}
    a = ctx.remote

    def prepare(b_url, b_model, b_key, workload):
        """Off the event loop: asks B which model it serves, loads the tokenizer."""
        spec = spec_from_form(workload, a.max_model_len)
        b = connect_side("B", b_url, b_model, b_key)
        tokenizer = ctx.tokenizer.get()
        sides = [
            ("A", f"A: {a.label}", target_for(a, tokenizer)),
            ("B", f"B: {b.label}", target_for(b, tokenizer)),
        ]
        return spec, sides, build_requests(spec, tokenizer)

    async def run_compare(b_url, b_model, b_key, *values):
        skip = gr.skip()
        workload = dict(zip(names, values, strict=True))
        try:
            spec, sides, requests = await asyncio.to_thread(
                prepare, b_url, b_model, b_key, workload
            )
        except ValueError as e:
            gr.Warning(str(e))
            yield skip, f"**Not started:** {e}", skip, skip, skip
            return
        cmp = RemoteCompare(spec, sides, requests).start()
        current["run"] = cmp
        try:
            while not cmp.done.is_set():
                run = cmp.current
                done = len(run.results) if run else 0
                elapsed = run.elapsed_s if run else 0.0
                yield progress_html(done, len(requests), elapsed, cmp.phase), skip, skip, skip, skip
                await asyncio.to_thread(cmp.done.wait, POLL_S)
        finally:
            if not cmp.done.is_set():
                cmp.stop()
            current["run"] = None
        first, second = cmp.outcomes
        errors = [f"{o.label}: {o.error}" for o in cmp.outcomes if o.error]
        status = (
            f"**Done.** {first.label}; {second.label}. Ratios are B / A; 'better' says which "
            "side wins on that row. Latencies are measured by the client."
        )
        if errors:
            status += "\n\n**Problems:** " + "; ".join(errors)
        cdfs, rate = await asyncio.to_thread(
            client_figures, cmp.outcomes, "Latency CDFs, A vs B (client)"
        )
        elapsed = sum(o.result.duration_s for o in cmp.outcomes if o.result)
        done_html = progress_html(len(requests), len(requests), elapsed, "done (both runs)")
        yield done_html, status, remote_compare_rows(first, second), cdfs, rate

    inputs = [ui.b_url, ui.b_model, ui.b_key, *ui.form.values()]
    outputs = [ui.progress, ui.status, ui.results, ui.cdfs, ui.rate]
    ui.run.click(run_compare, inputs, outputs, api_name="compare", **BENCHMARK_QUEUE)
    stop = stop_compare(current)
    ui.stop.click(stop, None, ui.status, concurrency_limit=None, api_name="stop_compare")
