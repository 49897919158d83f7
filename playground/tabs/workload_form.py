"""The workload form shared by the Load test and Compare tabs: one component per field of
handlers_loadtest.WORKLOAD_FIELDS."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gradio as gr

from playground.handlers_loadtest import ARRIVALS, LENGTH_KINDS


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
        if "max_concurrency" in fields:
            parts["max_concurrency"] = gr.Number(
                d["max_concurrency"],
                label="Max concurrency (0 = no limit)",
                precision=0,
                min_width=90,
            )
        parts["seed"] = gr.Number(d["seed"], label="Seed", precision=0, min_width=90)
    with gr.Row():
        parts["arrival"] = gr.Radio(list(ARRIVALS), value=d["arrival"], label="Arrivals")
    with gr.Row():
        parts["request_rate"] = gr.Number(
            d.get("request_rate", 8.0), label="Rate (req/s)", min_width=90
        )
        if "burstiness" in fields:
            parts["burstiness"] = gr.Number(
                d["burstiness"],
                label="Burstiness (gamma shape; 1 = Poisson, < 1 burstier)",
                min_width=90,
            )
    _length_fields("input", d, parts)
    _length_fields("output", d, parts)
    row_fields = ("prefix_len", "temperature", "top_p", "top_k", "ignore_eos")
    if any(f in fields for f in row_fields):
        with gr.Row():
            if "prefix_len" in fields:
                parts["prefix_len"] = gr.Number(
                    d["prefix_len"],
                    label="Shared system-prompt prefix (tokens)",
                    precision=0,
                    min_width=90,
                )
            if "temperature" in fields:
                parts["temperature"] = gr.Number(
                    d["temperature"], label="Temperature", min_width=90
                )
            if "top_p" in fields:
                parts["top_p"] = gr.Number(d["top_p"], label="Top-p", min_width=70)
            if "top_k" in fields:
                parts["top_k"] = gr.Number(d["top_k"], label="Top-k (-1 = off)", precision=0,
                                           min_width=70)  # fmt: skip
            if "ignore_eos" in fields:
                parts["ignore_eos"] = gr.Checkbox(
                    d["ignore_eos"], label="Ignore EOS (exact lengths)"
                )
    return {name: parts[name] for name in fields}
