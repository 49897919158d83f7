"""Load test tab: a seeded workload against the running engine (chat keeps working), with live
charts, a `vllm bench serve`-style results table, a per-request timeline and a JSON download.
In remote mode the same form drives the OpenAI-compatible server through loadgen's OpenAITarget;
the charts then show only what the client sees."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.figures.latency import (
    gantt_figure,
    nice_bin_s,
    output_rate_figure,
    queue_depth_figure,
    throughput_figure,
)
from playground.figures.style import empty_figure
from playground.handlers.compare_checks import check_samples_fit
from playground.handlers.loadtest import (
    DEFAULT_WORKLOAD,
    WORKLOAD_FIELDS,
    BackgroundRun,
    progress_html,
    spec_from_form,
    summary_rows,
    write_result_json,
)
from playground.tabs.benchmark import BENCHMARK_QUEUE, stop_handler
from playground.tabs.workload_form import workload_form

POLL_S = 0.5  # how often the run's progress reaches the page
ENGINE_INTRO = (
    "Sends a seeded workload to the engine that is serving Chat right now (in-process, through "
    "the same load generator as `python -m playground.loadgen`). Chat and the live tabs keep "
    "working during the run."
)
REMOTE_INTRO = (
    "Sends a seeded workload to `{url}` ({model}) through the same load generator as "
    "`python -m playground.loadgen --base-url ...`: streaming POST /v1/completions with "
    "token-id prompts (tokenizer: {tokenizer}). Every number is measured by the client; the "
    "server's queues are not visible from here.\n\n**Caching:** {caching}."
)
# Short lines: a Plotly annotation does not wrap, and the panel is ~230 px wide at 1400 px
# (checked in a screenshot: two long lines clipped at the right edge).
NO_REMOTE_QUEUES = (
    "Running / waiting queues<br>are our engine's own telemetry:<br>"
    "a remote OpenAI server<br>does not expose them."
)
ENGINE_GANTT = "Per-request timeline: queue, prefill, decode"
REMOTE_GANTT = "Per-request timeline (client): send → first token → end"


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    with gr.Row():
        with gr.Column(scale=2, min_width=360):
            gr.Markdown(_intro(ctx))
            ui.form = workload_form(DEFAULT_WORKLOAD, WORKLOAD_FIELDS)
            with gr.Row():
                ui.run = gr.Button("Run load test", variant="primary", elem_id="loadtest-run")
                ui.stop = gr.Button("Stop", variant="stop")
        with gr.Column(scale=3):
            ui.progress = gr.HTML(
                progress_html(0, 0, 0.0, "not started"), elem_id="loadtest-progress"
            )
            ui.status = gr.Markdown(
                "Set a workload and press **Run load test**.", elem_id="loadtest-status"
            )
            with gr.Row():
                ui.live_throughput = gr.Plot(
                    show_label=False, label="Engine tokens/s during the run"
                )
                ui.live_queue = gr.Plot(
                    show_label=False, label="Running / waiting requests", elem_id="loadtest-queue"
                )
            ui.results = gr.Dataframe(
                headers=["metric", "value"],
                label="Serving benchmark result",
                interactive=False,
                elem_id="loadtest-results",
                max_height=900,
            )
            ui.download = gr.DownloadButton("Download results (JSON)", visible=False)
    ui.gantt = gr.Plot(show_label=False, label="Per-request timeline", elem_id="loadtest-gantt")
    return ui


def _intro(ctx: AppContext) -> str:
    if ctx.remote is None:
        return ENGINE_INTRO
    r = ctx.remote
    return REMOTE_INTRO.format(
        url=r.base_url, model=r.model, tokenizer=ctx.tokenizer.description, caching=r.cache_note
    )


def notes_markdown(notes: dict[str, str]) -> str:
    """The result's notes (server-side caching, how prompts were built) as status lines."""
    return "".join(f"\n\n**{key.capitalize()}:** {note}." for key, note in notes.items())


def _live(ctx: AppContext, run: BackgroundRun) -> tuple:
    """Progress bar, charts and the timeline so far (built off the event loop)."""
    bin_s = nice_bin_s(run.elapsed_s, 30)
    t0 = run.start_time
    progress = progress_html(len(run.results), run.total, run.elapsed_s)
    if ctx.remote is not None:  # what the client saw: tokens of finished requests only
        title = "Output tokens/s seen by the client (finished requests)"
        return (
            progress,
            output_rate_figure({"client": (t0, run.results)}, bin_s, title),
            empty_figure(NO_REMOTE_QUEUES, "Running and waiting requests"),
            gantt_figure(run.results, t0, REMOTE_GANTT, client_only=True),
        )
    steps = ctx.service.stats().steps
    return (
        progress,
        throughput_figure(
            steps,
            t0,
            bin_s,
            "Engine tokens/s (all requests, chat included)",
            x_title="seconds since the run started",
        ),
        queue_depth_figure(steps, t0, "Running and waiting requests"),
        gantt_figure(run.results, t0, ENGINE_GANTT),
    )


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    names = list(ui.form)
    current: dict[str, BackgroundRun | None] = {"run": None}

    async def run_test(*values):
        skip = gr.skip()
        try:
            spec = spec_from_form(dict(zip(names, values, strict=True)), ctx.max_model_len)
            if ctx.service is not None:  # remote servers do not say their limit
                check_samples_fit(spec.n, {"the engine": ctx.service.config.max_num_seqs})
            target = await asyncio.to_thread(ctx.load_test_target)  # remote: loads a tokenizer
        except ValueError as e:
            gr.Warning(str(e))
            yield skip, f"**Not started:** {e}", skip, skip, skip, skip, skip
            return
        run = BackgroundRun(spec, target).start()
        current["run"] = run
        where = ctx.remote.label if ctx.remote else ctx.model_name
        status = f"Running {spec.num_prompts} requests against {where}..."
        hidden = gr.DownloadButton(visible=False)
        try:
            while not run.done.is_set():
                progress, tput, queue, gantt = await asyncio.to_thread(_live, ctx, run)
                yield progress, status, tput, queue, gantt, skip, hidden
                await asyncio.to_thread(run.done.wait, POLL_S)
        finally:  # the page went away mid-run: stop rather than load the engine unseen
            if not run.done.is_set():
                run.stop()
            current["run"] = None
        if run.error or run.result is None:
            msg = f"**The load test failed:** {run.error or 'no result'}"
            yield skip, msg, skip, skip, skip, skip, hidden
            return
        result = run.result
        summary = result.summary()
        progress, tput, queue, _ = await asyncio.to_thread(_live, ctx, run)
        remote = ctx.remote is not None
        gantt = gantt_figure(
            result.per_request,
            result.start_time,
            REMOTE_GANTT if remote else ENGINE_GANTT,
            client_only=remote,
        )
        note = (
            "Stopped: aborted requests (in flight or not sent yet) are left out of the table. "
            if run.stopped
            else ""
        )
        status = (
            f"**Done** in {result.duration_s:.1f} s: {summary['completed']} succeeded, "
            f"{summary['failed']} failed, {run.num_aborted} aborted. {note}Latencies are measured by the client (send -> "
            "first token -> last token), as `vllm bench serve` does."
        ) + notes_markdown(result.notes)
        path = await asyncio.to_thread(write_result_json, result)
        yield (
            progress,
            status,
            tput,
            queue,
            gantt,
            summary_rows(summary),
            gr.DownloadButton(value=path, visible=True),
        )

    outputs = [
        ui.progress,
        ui.status,
        ui.live_throughput,
        ui.live_queue,
        ui.gantt,
        ui.results,
        ui.download,
    ]
    ui.run.click(run_test, list(ui.form.values()), outputs, api_name="load_test", **BENCHMARK_QUEUE)
    stop = stop_handler(
        current,
        "No load test is running.",
        "Stopping: requests in flight are aborted; finished ones are kept.",
    )
    ui.stop.click(stop, None, ui.status, concurrency_limit=None, api_name="stop_load_test")
