"""The workload form shared by the Load test and Compare tabs: one component per field of
handlers_loadtest.WORKLOAD_FIELDS."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gradio as gr

from playground.handlers.loadtest import ARRIVALS, LENGTH_KINDS


def _length_fields(which: str, d: Mapping[str, Any], parts: dict[str, gr.components.Component]):
    with gr.Row():
        parts[f"{which}_kind"] = gr.Radio(
            list(LENGTH_KINDS), value=d[f"{which}_kind"], label=f"{which.title()} length (tokens)"
        )
    with gr.Row():
        parts[f"{which}_mean"] = gr.Number(
            d.get(f"{which}_mean", 32), label="fixed / mean", precision=0, min_width=80
        )
        parts[f"{which}_low"] = gr.Number(d[f"{which}_low"], label="min", precision=0, min_width=80)
        parts[f"{which}_high"] = gr.Number(
            d[f"{which}_high"], label="max", precision=0, min_width=80
        )
        parts[f"{which}_std"] = gr.Number(
            d.get(f"{which}_std", 8.0), label="std (normal)", min_width=80
        )


def workload_form(defaults: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """Builds the components of `fields` (a subset of WORKLOAD_FIELDS), in that order."""
    d = defaults
    parts: dict[str, Any] = {}
    with gr.Row():
        parts["num_prompts"] = gr.Number(
            d["num_prompts"], label="Requests", precision=0, min_width=90
        )
        _number(parts, d, fields, "max_concurrency", "Max concurrency (0 = no limit)", 0)
        parts["seed"] = gr.Number(d["seed"], label="Seed", precision=0, min_width=90)
    with gr.Row():
        parts["arrival"] = gr.Radio(list(ARRIVALS), value=d["arrival"], label="Arrivals")
    with gr.Row():
        parts["request_rate"] = gr.Number(
            d.get("request_rate", 8.0), label="Rate (req/s)", min_width=90
        )
        _number(
            parts, d, fields, "burstiness", "Burstiness (gamma shape; 1 = Poisson, < 1 burstier)"
        )
    _length_fields("input", d, parts)
    _length_fields("output", d, parts)
    row_fields = ("prefix_len", "temperature", "top_p", "top_k", "ignore_eos")
    if any(f in fields for f in row_fields):
        with gr.Row():
            _number(parts, d, fields, "prefix_len", "Shared system-prompt prefix (tokens)", 0)
            _number(parts, d, fields, "temperature", "Temperature")
            _number(parts, d, fields, "top_p", "Top-p", width=70)
            _number(parts, d, fields, "top_k", "Top-k (-1 = off)", 0, width=70)
            if "ignore_eos" in fields:
                parts["ignore_eos"] = gr.Checkbox(
                    d["ignore_eos"], label="Ignore EOS (exact lengths)"
                )
    return {name: parts[name] for name in fields}


def _number(
    parts: dict[str, Any], d: Mapping[str, Any], fields: Sequence[str], name: str, label: str,
    precision: int | None = None, width: int = 90,
) -> None:  # fmt: skip
    """A gr.Number for `name` when the form has that field."""
    if name in fields:
        parts[name] = gr.Number(d[name], label=label, precision=precision, min_width=width)
