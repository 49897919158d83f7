"""KV calculator tab: the KV-cache formula with model presets and MHA / GQA / MQA variants, a
table over batch sizes and context lengths, memory bars against a GPU, and the loaded engine's
real allocation beside the formula (in remote mode, presets only: no engine is loaded)."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.handlers.kv import (
    BYTES_PER_ELEMENT,
    CUSTOM_MODEL,
    DEFAULT_CUSTOM,
    GPU_CHOICES,
    LOADED_MODEL,
    VARIANTS,
    CustomModel,
    preset_names,
)
from playground.handlers.kv_view import calculator_view, context_for_model


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    with gr.Row():
        with gr.Column(scale=1, min_width=280):
            ui.model = gr.Dropdown(
                preset_names(with_loaded=ctx.info is not None),
                value="Llama-3-8B (GQA)",
                label="Model",
            )
            with gr.Group(visible=False) as ui.custom_group:
                with gr.Row():
                    ui.custom_layers = gr.Number(
                        DEFAULT_CUSTOM.num_layers, label="Layers", precision=0, min_width=80
                    )
                    ui.custom_heads = gr.Number(
                        DEFAULT_CUSTOM.num_heads, label="Query heads", precision=0, min_width=80
                    )
                with gr.Row():
                    ui.custom_kv_heads = gr.Number(
                        DEFAULT_CUSTOM.num_kv_heads, label="KV heads", precision=0, min_width=80
                    )
                    ui.custom_head_dim = gr.Number(
                        DEFAULT_CUSTOM.head_dim, label="head_dim", precision=0, min_width=80
                    )
                ui.custom_params = gr.Number(
                    DEFAULT_CUSTOM.params_billions, label="Parameters (billions, for weights)"
                )
            ui.variant = gr.Radio(list(VARIANTS), value="as the model", label="Attention")
            ui.seq_len = gr.Number(4096, label="Context length (tokens per request)", precision=0)
            ui.batch = gr.Number(32, label="Batch size (concurrent requests)", precision=0)
            ui.kv_dtype = gr.Dropdown(
                list(BYTES_PER_ELEMENT), value="bf16 / fp16 (2 B)", label="KV cache element"
            )
            ui.weight_dtype = gr.Dropdown(
                list(BYTES_PER_ELEMENT), value="bf16 / fp16 (2 B)", label="Weight element"
            )
            ui.gpu = gr.Dropdown(list(GPU_CHOICES), value="H100 SXM 80GB", label="GPU")
            # A Number, not a Slider: a typed value outside a slider's range raised before the
            # handler could say why; here every value reaches parse_inputs, which explains.
            ui.fraction = gr.Number(
                0.9, label="Memory fraction for weights + KV (0 to 1)", elem_id="kv-fraction"
            )
        with gr.Column(scale=2):
            ui.formula = gr.Markdown(elem_id="kv-formula")
            ui.bars = gr.Plot(show_label=False, label="Weights + KV against GPU memory")
    ui.table = gr.Dataframe(
        label="KV cache in GB (1e9 bytes; ✗: weights + KV exceed the usable memory)",
        interactive=False,
        elem_id="kv-table",
    )
    ui.engine = gr.Markdown(elem_id="kv-engine")
    return ui


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    base_url = ctx.remote.base_url if ctx.remote else None

    def compute(model, variant, seq_len, batch, kv_dtype, weight_dtype, gpu, fraction, *custom):
        form = (model, variant, seq_len, batch, kv_dtype, weight_dtype, gpu, fraction)
        view = calculator_view(form, CustomModel(*custom), ctx.info, base_url)
        return (
            view.formula,
            view.bars,
            gr.Dataframe(value=view.rows, headers=view.headers),
            view.engine,
        )

    inputs = [
        ui.model,
        ui.variant,
        ui.seq_len,
        ui.batch,
        ui.kv_dtype,
        ui.weight_dtype,
        ui.gpu,
        ui.fraction,
        ui.custom_layers,
        ui.custom_heads,
        ui.custom_kv_heads,
        ui.custom_head_dim,
        ui.custom_params,
    ]
    outputs = [ui.formula, ui.bars, ui.table, ui.engine]

    def model_fields(model, seq_len, *custom):
        """The custom shape's fields for a custom model; the KV element is the engine's own
        for the loaded model (a leftover choice must not change the formula); the context
        length down to the model's maximum when it held more."""
        loaded = model == LOADED_MODEL
        kv = gr.Dropdown(
            interactive=not loaded,
            label="KV cache element (the loaded model: the engine's own)"
            if loaded
            else "KV cache element",
        )
        context = context_for_model(model, seq_len, ctx.info, CustomModel(*custom))
        seq = gr.skip() if context is None else gr.Number(value=context)
        return gr.Group(visible=model == CUSTOM_MODEL), kv, seq

    custom_fields = inputs[-5:]
    ui.model.change(
        model_fields,
        [ui.model, ui.seq_len, *custom_fields],
        [ui.custom_group, ui.kv_dtype, ui.seq_len],
        api_visibility="private",
    )
    for component in inputs:
        component.change(
            compute,
            inputs,
            outputs,
            api_visibility="private",
            trigger_mode="always_last",
            concurrency_limit=4,
        )
    ui.tab.select(compute, inputs, outputs, api_name="kv_calc", concurrency_limit=4)
