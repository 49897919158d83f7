"""Compare tab: the same seeded workload on two engine configurations, each in its own engine
instance, one after the other; results side by side, overlaid charts, both peak block maps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from types import SimpleNamespace
from typing import Any

import gradio as gr
import plotly.graph_objects as go

from engine.config import (
    INT8_ACTIVATIONS_MIN_ROWS,
    INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS,
    literal_choices,
)
from engine.telemetry.cost import kv_cache_bytes
from playground.context import AppContext
from playground.figures.blocks import block_map_figure
from playground.figures.latency import (
    latency_cdfs_figure,
    output_rate_figure,
    requests_per_step_figure,
)
from playground.figures.style import empty_figure
from playground.handlers.compare import (
    COMPARE_HEADERS,
    NOISE_NOTE,
    BackgroundCompare,
    SideOutcome,
    compare_rows,
    runs_per_side,
)
from playground.handlers.compare_checks import (
    available_memory_bytes,
    check_kv_budget,
    check_samples_fit,
)
from playground.handlers.compare_engine import (
    BLOCK_SIZES,
    DEFAULT_COMPARE_WORKLOAD,
    DEFAULT_PRESET,
    MODEL_DTYPE_BYTES,
    PRESET_DEFAULTS,
    PRESETS,
    SIDE_FIELDS,
    engine_sides,
    preset_form,
    side_config,
    side_label,
)
from playground.handlers.compare_export import write_compare_json
from playground.handlers.loadtest import LENGTH_FIELDS, progress_html, spec_from_form
from playground.loadgen import build_requests
from playground.tabs.benchmark import BENCHMARK_QUEUE, stop_handler
from playground.tabs.workload_form import workload_form

POLL_S = 0.5
MAX_LEGEND_ENTRIES = 8  # a block map's legend past this would squash the map (one per request)
WORKLOAD_FIELDS = (
    "num_prompts",
    "seed",
    "arrival",
    "request_rate",
    *LENGTH_FIELDS,
    "prefix_len",
    "n",
)


def _side_form(name: str, values: dict) -> dict:
    parts = {}
    gr.Markdown(f"### Side {name}")
    parts["batching"] = gr.Radio(
        ["static", "continuous"], value=values["batching"], label="Batching"
    )
    parts["kv_layout"] = gr.Radio(
        ["contiguous", "paged"], value=values["kv_layout"], label="KV layout"
    )
    parts["kv_cache_dtype"] = gr.Radio(
        ["auto", "int8", "fp8"], value=values["kv_cache_dtype"],
        label="KV cache dtype (auto = the model's; int8/fp8 fit ~2x the tokens in the budget)",
        elem_id=f"compare-{name.lower()}-kv-dtype",
    )  # fmt: skip
    parts["enable_prefix_caching"] = gr.Checkbox(
        value=values["enable_prefix_caching"], label="Prefix caching (paged layout only)"
    )
    parts["enable_prompt_sharing"] = gr.Checkbox(
        value=values["enable_prompt_sharing"],
        label="Prompt sharing (n > 1: the samples share the prompt's blocks)",
    )
    parts["speculative_method"] = gr.Radio(
        ["off", "ngram", "draft"],
        value=values["speculative_method"],
        label="Speculative decoding (draft: the model's own int8 copy proposes)",
    )
    parts["block_size"] = gr.Dropdown(
        list(BLOCK_SIZES), value=values["block_size"], label="Block size (tokens)"
    )
    parts["max_num_seqs"] = gr.Number(values["max_num_seqs"], label="max_num_seqs", precision=0)
    parts["max_num_batched_tokens"] = gr.Number(
        values["max_num_batched_tokens"],
        label="max_num_batched_tokens (token budget per step)",
        precision=0,
    )
    parts["quantization"] = gr.Radio(
        literal_choices()["quantization"],
        value=values["quantization"],
        label="Weights: int8 / int4 (round-to-nearest) weight-only in every linear layer; awq: "
        "int4 from an AutoAWQ checkpoint in the decoder layers (the embedded model's is made "
        "once by `make quantize`, or on first use: minutes). The embedding and norms stay 16-bit",
        elem_id=f"compare-{name.lower()}-weights",
    )
    parts["quantize_lm_head"] = gr.Checkbox(
        value=values["quantize_lm_head"],
        label="Quantized weights: the LM head too (int8 / int4; awq: int4 round-to-nearest, "
        "as AutoAWQ leaves it 16-bit)",
    )
    parts["int8_activations"] = gr.Checkbox(
        value=values["int8_activations"],
        label="Quantized weights: int8 activations (W8A8 / W4A8 from "
        f"{INT8_WEIGHTS_ACTIVATIONS_MIN_ROWS} / {INT8_ACTIVATIONS_MIN_ROWS} rows: batched decode "
        "and prefill multiply bytes with AVX512-VNNI; batch-1 decode stays weight-only)",
    )
    parts["prepack_weights"] = gr.Checkbox(
        value=values["prepack_weights"],
        label="Prepacked weights (CPU, bf16: reordered for oneDNN once at load, not per matmul)",
    )
    parts["fused_ops"] = gr.Checkbox(
        value=values["fused_ops"],
        label="Fused ops (CPU: RMSNorm + residual add, RoPE, SiLU-and-mul as one C++ call each)",
    )
    parts["enforce_eager"] = gr.Checkbox(
        value=values["enforce_eager"],
        label="Eager: every product through its nn.Module (CPU: no direct kernel calls at "
        "decode's few rows; GPU: no CUDA graphs)",
    )
    parts["huge_pages"] = gr.Checkbox(
        value=values["huge_pages"],
        label="Huge pages (CPU on Linux: the weights and the KV pool in 2 MiB pages, fewer TLB "
        "misses when a step streams them)",
    )
    return {f: parts[f] for f in SIDE_FIELDS}


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    form = preset_form(DEFAULT_PRESET)
    a, b = form["A"], form["B"]
    gr.Markdown(
        "Runs the same seeded requests on two engines that differ only in the fields below "
        f"(same model {ctx.info.model_name}, same dtype, the same KV budget in bytes), one after "
        "the other, each in its own engine instance that is shut down after. The main engine "
        "keeps serving Chat meanwhile."
    )
    with gr.Row():
        ui.preset = gr.Dropdown(list(PRESETS), value=DEFAULT_PRESET, label="Preset", scale=2)
        ui.kv_budget = gr.Number(
            form["kv_budget"],
            label="KV budget (tokens at the model dtype; the same bytes on both sides)",
            precision=0,
            scale=1,
        )
        ui.max_model_len = gr.Number(
            form["max_model_len"], label="max_model_len", precision=0, scale=1
        )
        ui.repeats = gr.Number(
            form["repeats"], label="Runs per side (spread = noise)", precision=0, scale=1
        )
    ui.headline = gr.Markdown(_headline_md(DEFAULT_PRESET), elem_id="compare-headline")
    with gr.Row():
        with gr.Column():
            ui.side_a = _side_form("A", a)
        with gr.Column():
            ui.side_b = _side_form("B", b)
        ui.form = workload_column(form["workload"])  # the page opens as the preset sets it
    run_controls(ui, "Pick a preset and press **Run compare**.", "Side by side", 900)
    ui.cdfs = gr.Plot(show_label=False, label="Latency CDFs, A vs B")
    with gr.Row():
        ui.rate = gr.Plot(show_label=False, label="Output tokens/s over time")
        ui.batch = gr.Plot(show_label=False, label="Requests per engine step")
    with gr.Row():
        ui.map_a = gr.Plot(
            show_label=False, label="Block map of A at its peak", elem_id="compare-map-a"
        )
        ui.map_b = gr.Plot(
            show_label=False, label="Block map of B at its peak", elem_id="compare-map-b"
        )
    return ui


# --- what the remote Compare tab (compare_remote.py) shares with this one ---------------------


def workload_column(defaults: dict[str, Any] | None = None) -> dict:
    """The workload form, in the column right of the two sides (defaults: a preset's)."""
    with gr.Column(scale=2):
        gr.Markdown("### Workload (both sides)")
        return workload_form(defaults or DEFAULT_COMPARE_WORKLOAD, WORKLOAD_FIELDS)


def run_controls(ui: SimpleNamespace, status: str, results_label: str, max_height: int) -> None:
    """Run / Stop, the progress bar, the status line and the side-by-side table."""
    with gr.Row():
        ui.run = gr.Button("Run compare", variant="primary", elem_id="compare-run")
        ui.stop = gr.Button("Stop", variant="stop")
    ui.progress = gr.HTML(progress_html(0, 0, 0.0, "not started"), elem_id="compare-progress")
    ui.status = gr.Markdown(status, elem_id="compare-status")
    gr.Markdown(NOISE_NOTE, elem_id="compare-noise-note")
    ui.results = gr.Dataframe(
        headers=COMPARE_HEADERS,
        label=results_label,
        interactive=False,
        elem_id="compare-results",
        max_height=max_height,
    )
    # Shown once a compare finishes: the workload, both configurations, every repeat.
    ui.download = gr.DownloadButton("Download results (JSON)", visible=False)


def client_figures(outcomes: list[SideOutcome], cdfs_title: str) -> tuple:
    """Latency CDFs and output tokens/s of the sides that have a result, A vs B."""
    runs = {o.label: o.result for o in outcomes if o.result is not None}
    cdfs = latency_cdfs_figure({k: res.per_request for k, res in runs.items()}, cdfs_title)
    rate = output_rate_figure(
        {k: (res.start_time, res.per_request) for k, res in runs.items()},
        bin_s=0.5,
        title="Output tokens/s seen by the client",
    )
    return cdfs, rate


async def follow(cmp: BackgroundCompare, current: dict, num_outputs: int) -> AsyncIterator[tuple]:
    """(progress bar over the whole A-then-B run, running status, skip for the other outputs:
    the progress and status must be the first two) every POLL_S until both sides finish; the
    tab's Stop acts on cmp meanwhile. Closing this (the page went away) stops the compare:
    the caller wraps it in contextlib.aclosing so that happens at once."""
    current["run"] = cmp
    skips = [gr.skip()] * (num_outputs - 2)
    try:
        while not cmp.done.is_set():
            yield (cmp.progress(), cmp.running_status(), *skips)
            await asyncio.to_thread(cmp.done.wait, POLL_S)
    finally:
        if not cmp.done.is_set():
            cmp.stop()
        current["run"] = None


def stop_compare(current: dict) -> Callable[[], Any]:
    """Stop's handler for this tab and the remote Compare tab (compare_remote.py). With no
    compare running it leaves the status (the last run's summary) alone and says so in a toast."""
    stop = stop_handler(current, "", "Stopping the compare...")

    def handler() -> Any:
        message = stop()
        if not message:
            gr.Info("No compare is running.")
            return gr.skip()
        return message

    return handler


# --- this tab ----------------------------------------------------------------------------------


def _headline_md(preset: str) -> str:
    if preset not in PRESET_DEFAULTS:
        return ""
    return f"**Headline row for this preset:** ★ {PRESET_DEFAULTS[preset].headline}"


def compact_legend(fig: go.Figure, max_entries: int = MAX_LEGEND_ENTRIES) -> go.Figure:
    """Keeps the block map's first legend entries (free, cached, then requests) and hides the
    rest behind one "+N more" entry, so a 32-request legend does not squash the map; hovering
    a cell still names its request."""
    entries = [t for t in fig.data if t.type == "scatter" and t.showlegend is not False and t.name]
    if len(entries) <= max_entries:
        return fig
    hidden = entries[max_entries - 1 :]
    for trace in hidden:
        trace.showlegend = False
    fig.add_scatter(x=[None], y=[None], mode="markers", name=f"+{len(hidden)} more (hover a cell)")
    return fig


def _figures(outcomes: list[SideOutcome]) -> tuple:
    runs = {o.label: o for o in outcomes if o.result is not None}
    cdfs, rate = client_figures(outcomes, "Latency CDFs, A vs B (last run of each side)")
    batch = requests_per_step_figure(
        {k: (o.result.start_time, o.steps) for k, o in runs.items()}, "Requests per engine step"
    )
    maps = [
        compact_legend(block_map_figure(o.peak, f"{o.label} at peak"))
        if o.peak
        else empty_figure(o.error or "")
        for o in outcomes
    ]
    return cdfs, rate, batch, *maps


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    names = list(ui.form)
    current: dict[str, BackgroundCompare | None] = {"run": None}

    def apply_preset(name):
        """Every field the preset depends on, and every other one back to its default."""
        try:
            form = preset_form(name)
        except ValueError as e:
            gr.Warning(str(e))
            return [gr.skip()] * len(preset_outputs)
        return [
            form["kv_budget"],
            form["max_model_len"],
            form["repeats"],
            _headline_md(name),
            *(form["A"][f] for f in SIDE_FIELDS),
            *(form["B"][f] for f in SIDE_FIELDS),
            *(form["workload"][f] for f in names),
        ]

    async def run_compare(preset, kv_budget, max_model_len, repeats, *values):
        n = len(SIDE_FIELDS)
        skip = gr.skip()
        side_a = dict(zip(SIDE_FIELDS, values[:n], strict=True))
        side_b = dict(zip(SIDE_FIELDS, values[n : 2 * n], strict=True))
        workload = dict(zip(names, values[2 * n :], strict=True))
        try:
            num_repeats = runs_per_side(repeats)
            spec = spec_from_form(workload, int(max_model_len or 0) or None)
            base = ctx.service.config
            head_dim = ctx.info.shape.head_dim
            cfg_a = side_config(base, side_a, kv_budget, max_model_len, head_dim=head_dim)
            cfg_b = side_config(base, side_b, kv_budget, max_model_len, head_dim=head_dim)
            shape = ctx.info.shape
            check_kv_budget(
                int(kv_budget),
                # At the model dtype's element size, as kv_budget_blocks counts the budget.
                kv_cache_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, 1, 1,
                               MODEL_DTYPE_BYTES[base.dtype]),
                await asyncio.to_thread(available_memory_bytes, ctx.info.device),
            )  # fmt: skip
            check_samples_fit(spec.n, {"side A": cfg_a.max_num_seqs, "side B": cfg_b.max_num_seqs})
            requests = build_requests(spec, ctx.service.tokenizer)
        except ValueError as e:
            gr.Warning(str(e))
            yield (skip, f"**Not started:** {e}", *[skip] * (len(outputs) - 2))
            return
        sides = [
            ("A", side_label("A", side_a, side_b), cfg_a),
            ("B", side_label("B", side_b, side_a), cfg_b),
        ]
        engines = engine_sides(sides, ctx.make_service)
        cmp = BackgroundCompare(spec, engines, requests, num_repeats).start()
        yield (*[skip] * (len(outputs) - 1), gr.DownloadButton(visible=False))  # the previous file
        async with aclosing(follow(cmp, current, len(outputs))) as updates:
            async for update in updates:
                yield update
        a, b = cmp.outcomes
        headline = PRESET_DEFAULTS[preset].headline if preset in PRESET_DEFAULTS else None
        status = (
            f"**Done.** {num_repeats} run(s) per side. A = {a.label[3:]}, B = {b.label[3:]}. "
            "Ratios are B / A; 'better' names the side that wins beyond the noise band, '≈' "
            "a difference within it." + (f" Headline: ★ {headline}." if headline else "")
        ) + cmp.problems()
        figures = await asyncio.to_thread(_figures, cmp.outcomes)
        rows = compare_rows(a, b, headline=headline)
        path = await asyncio.to_thread(write_compare_json, spec, num_repeats, cmp.outcomes, rows)
        yield (
            cmp.final_progress(),
            status,
            rows,
            *figures,
            gr.DownloadButton(value=path, visible=True),
        )

    side_inputs = [*ui.side_a.values(), *ui.side_b.values()]
    preset_outputs = [
        ui.kv_budget,
        ui.max_model_len,
        ui.repeats,
        ui.headline,
        *side_inputs,
        *ui.form.values(),
    ]
    ui.preset.change(apply_preset, ui.preset, preset_outputs, api_visibility="private")
    outputs = [ui.progress, ui.status, ui.results, ui.cdfs, ui.rate, ui.batch, ui.map_a, ui.map_b,
               ui.download]  # fmt: skip
    inputs = [ui.preset, ui.kv_budget, ui.max_model_len, ui.repeats, *side_inputs]
    inputs += list(ui.form.values())
    ui.run.click(run_compare, inputs, outputs, api_name="compare", **BENCHMARK_QUEUE)
    stop = stop_compare(current)
    ui.stop.click(stop, None, ui.status, concurrency_limit=None, api_name="stop_compare")
