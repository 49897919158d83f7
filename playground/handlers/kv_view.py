"""The KV calculator tab's outputs from its form: formula, memory bars, table, engine pool."""

from __future__ import annotations

from typing import NamedTuple

import plotly.graph_objects as go

from playground.engine_info import EngineInfo
from playground.figures.kv import memory_bars_figure
from playground.figures.style import empty_figure
from playground.handlers.kv import (
    LOADED_MODEL,
    TABLE_CORNER,
    CustomModel,
    engine_pool_markdown,
    formula_markdown,
    parse_inputs,
    remote_pool_markdown,
    resolve_preset,
    table_rows,
)


class CalculatorView(NamedTuple):
    formula: str
    bars: go.Figure
    headers: list[str]
    rows: list[list[str]]
    engine: str


def calculator_view(
    form: tuple, custom: CustomModel, info: EngineInfo | None, base_url: str | None
) -> CalculatorView:
    """form: (model, variant, seq_len, batch, kv_dtype, weight_dtype, gpu, fraction) as the
    tab's fields hold them. A form error clears every output: the chart and table of the
    previous valid form beside an error named another model than the one picked."""
    model = form[0]
    try:
        x = parse_inputs(*form, info, custom)
    except ValueError as e:
        return CalculatorView(
            f"**Check the form:** {e}", empty_figure(f"Check the form: {e}"),
            [TABLE_CORNER], [], "",
        )  # fmt: skip
    headers, rows = table_rows(x)
    if info is None:
        engine_md = remote_pool_markdown(base_url or "none")
    else:
        engine_md = engine_pool_markdown(info, x.seq_len)
    if info is not None and model != LOADED_MODEL:
        engine_md = (
            f"Pick **{LOADED_MODEL}** to put this engine's real KV pool beside the formula."
            f"\n\n{engine_md}"
        )
    return CalculatorView(
        f"#### {x.preset.name}\n\n{formula_markdown(x)}", memory_bars_figure(x), headers, rows,
        engine_md,
    )  # fmt: skip


def context_for_model(
    model: str, seq_len: float | None, info: EngineInfo | None, custom: CustomModel
) -> int | None:
    """The context length to show once `model` is picked: its maximum when the field holds
    more (Llama-3-8B's 4,096 tokens are more than the embedded model's 1,024), else None (the
    field stays as it is, a bad value included: the form says what is wrong with it)."""
    try:
        limit = resolve_preset(model, info, custom).max_context
    except ValueError:
        return None
    if limit is None or not isinstance(seq_len, int | float) or seq_len <= limit:
        return None
    return limit
