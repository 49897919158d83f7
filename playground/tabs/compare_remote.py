"""Compare tab in remote mode: the same seeded workload against two OpenAI-compatible servers
(A = the one the playground points at, B = another base URL), one after the other; the client's
numbers side by side and overlaid latency CDFs and output rates."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.handlers.compare import BackgroundCompare, runs_per_side
from playground.handlers.compare_export import write_compare_json
from playground.handlers.compare_remote import (
    RemoteSide,
    caching_markdown,
    connect_side,
    remote_compare_rows,
    targets_for,
)
from playground.handlers.loadtest import spec_from_form
from playground.loadgen import build_requests
from playground.tabs.benchmark import BENCHMARK_QUEUE
from playground.tabs.compare import (
    client_figures,
    follow,
    run_controls,
    stop_compare,
    workload_column,
)


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    a = ctx.remote
    gr.Markdown(
        "Runs the same seeded requests against two OpenAI-compatible servers, one after the "
        "other, and puts what the client measured side by side. **Both must serve the same "
        "model**: the prompts are token ids (tokenizer: "
        f"{ctx.tokenizer.description}). Server-side caching changes TTFT: each side's is named "
        "with the results, and a second run on the same server gets salted prompts. "
        "Engine-side rows (steps, block maps, preemptions) need our "
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
            ui.repeats = gr.Number(
                1, label="Runs per side (spread = noise)", precision=0, elem_id="compare-repeats"
            )
        ui.form = workload_column()
    run_controls(
        ui,
        "Give side B's base URL and press **Run compare**.",
        "Side by side (measured by the client)",
        700,
    )
    with gr.Row():
        ui.cdfs = gr.Plot(show_label=False, label="Latency CDFs, A vs B")
        ui.rate = gr.Plot(show_label=False, label="Output tokens/s over time")
    return ui


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    names = list(ui.form)
    current: dict[str, BackgroundCompare | None] = {"run": None}
    a = ctx.remote

    def prepare(b_url, b_model, b_key, workload):
        """Off the event loop: asks B which model it serves, loads the tokenizer."""
        spec = spec_from_form(workload, a.max_model_len)
        b = connect_side("B", b_url, b_model, b_key)
        prompts = ctx.tokenizer.resolve()
        requests = build_requests(spec, prompts.tokenizer)
        target_a, target_b, warning = targets_for(a, b, prompts, requests)
        sides = [
            RemoteSide("A", f"A: {a.label}", target_a),
            RemoteSide("B", f"B: {b.label}", target_b),
        ]
        notes = caching_markdown(sides) + warning + f"\n\n**Prompts:** {prompts.source}."
        return spec, sides, requests, notes

    async def run_compare(b_url, b_model, b_key, repeats, *values):
        skip = gr.skip()
        workload = dict(zip(names, values, strict=True))
        try:
            num_repeats = runs_per_side(repeats)
            spec, sides, requests, notes = await asyncio.to_thread(
                prepare, b_url, b_model, b_key, workload
            )
        except ValueError as e:
            gr.Warning(str(e))
            yield (skip, f"**Not started:** {e}", *[skip] * (len(outputs) - 2))
            return
        cmp = BackgroundCompare(spec, sides, requests, num_repeats).start()
        yield (*[skip] * (len(outputs) - 1), gr.DownloadButton(visible=False))  # the previous file
        async with aclosing(follow(cmp, current, len(outputs))) as updates:
            async for update in updates:
                yield update
        first, second = cmp.outcomes
        status = (
            (
                f"**Done.** {num_repeats} run(s) per side. {first.label}; {second.label}. Ratios "
                "are B / A; 'better' names the side that wins beyond the noise band, '≈' a "
                "difference within it. Latencies are measured by the client."
            )
            + notes
            + cmp.problems()
        )
        cdfs, rate = await asyncio.to_thread(
            client_figures, cmp.outcomes, "Latency CDFs, A vs B (client)"
        )
        rows = remote_compare_rows(first, second)
        path = await asyncio.to_thread(write_compare_json, spec, num_repeats, cmp.outcomes, rows)
        yield (
            cmp.final_progress(),
            status,
            rows,
            cdfs,
            rate,
            gr.DownloadButton(value=path, visible=True),
        )

    inputs = [ui.b_url, ui.b_model, ui.b_key, ui.repeats, *ui.form.values()]
    outputs = [ui.progress, ui.status, ui.results, ui.cdfs, ui.rate, ui.download]
    ui.run.click(run_compare, inputs, outputs, api_name="compare", **BENCHMARK_QUEUE)
    stop = stop_compare(current)
    ui.stop.click(stop, None, ui.status, concurrency_limit=None, api_name="stop_compare")
