"""The workload form shared by the Load test and Compare tabs: one component per field of
handlers_loadtest.WORKLOAD_FIELDS."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gradio as gr

from playground.handlers.loadtest import ARRIVALS, LENGTH_KINDS

# Which of a length distribution's fields apply to each kind (the others are hidden).
KIND_FIELDS = {
    "fixed": ("mean",),
    "uniform": ("low", "high"),
    "normal": ("mean", "std", "low", "high"),
}


def _length_fields(which: str, d: Mapping[str, Any], parts: dict[str, gr.components.Component]):
    kind = d[f"{which}_kind"]
    shown = KIND_FIELDS.get(kind, ())
    with gr.Row():
        parts[f"{which}_kind"] = gr.Radio(
            list(LENGTH_KINDS), value=kind, label=f"{which.title()} length (tokens)"
        )
    with gr.Row():
        parts[f"{which}_mean"] = gr.Number(
            d.get(f"{which}_mean", 32),
            label="tokens (fixed) / mean",
            precision=0,
            min_width=110,
            visible="mean" in shown,
        )
        parts[f"{which}_low"] = gr.Number(
            d[f"{which}_low"], label="min", precision=0, min_width=80, visible="low" in shown
        )
        parts[f"{which}_high"] = gr.Number(
            d[f"{which}_high"], label="max", precision=0, min_width=80, visible="high" in shown
        )
        parts[f"{which}_std"] = gr.Number(
            d.get(f"{which}_std", 8.0), label="std", min_width=80, visible="std" in shown
        )  # fmt: skip
    fields = [parts[f"{which}_{f}"] for f in ("mean", "low", "high", "std")]

    def show(kind: str) -> list:
        on = KIND_FIELDS.get(kind, ())
        return [gr.Number(visible=f in on) for f in ("mean", "low", "high", "std")]

    parts[f"{which}_kind"].change(show, parts[f"{which}_kind"], fields, api_visibility="private")


def _arrival_visibility(parts: dict[str, Any]) -> None:
    """The rate only for timed arrivals, the burstiness only for gamma arrivals."""
    targets = [parts[f] for f in ("request_rate", "burstiness") if f in parts]

    def show(arrival: str) -> list:
        updates = [gr.Number(visible=arrival != "all at once")]
        if "burstiness" in parts:
            updates.append(gr.Number(visible=arrival == "gamma (bursty)"))
        return updates

    parts["arrival"].change(show, parts["arrival"], targets, api_visibility="private")


def workload_form(defaults: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """Builds the components of `fields` (a subset of WORKLOAD_FIELDS), in that order."""
    d = defaults
    parts: dict[str, Any] = {}
    with gr.Row():
        parts["num_prompts"] = gr.Number(
            d["num_prompts"], label="Requests", precision=0, min_width=90
        )
        _number(parts, d, fields, "max_concurrency", "Max concurrent (0 = any)", 0, width=130)
        parts["seed"] = gr.Number(d["seed"], label="Seed", precision=0, min_width=90)
    with gr.Row():
        parts["arrival"] = gr.Radio(list(ARRIVALS), value=d["arrival"], label="Arrivals")
    with gr.Row():
        parts["request_rate"] = gr.Number(
            d.get("request_rate", 8.0), label="Rate (req/s)", min_width=110,
            visible=d["arrival"] != "all at once",
        )  # fmt: skip
        # Short label (a long one wrapped over 4-5 lines); the meaning in the info line.
        _number(
            parts, d, fields, "burstiness", "Burstiness", width=130,
            info="gamma shape: 1 = Poisson, < 1 burstier",
            visible=d.get("arrival") == "gamma (bursty)",
        )  # fmt: skip
    _arrival_visibility(parts)
    _length_fields("input", d, parts)
    _length_fields("output", d, parts)
    row_fields = ("prefix_len", "n", "temperature", "top_p", "top_k", "ignore_eos")
    if any(f in fields for f in row_fields):
        with gr.Row():
            _number(parts, d, fields, "prefix_len", "Shared prefix (tokens)", 0, width=130)
            # n > 1: parallel sampling; the engine's samples share the prompt's KV blocks
            # unless its enable_prompt_sharing is off (Compare's side forms).
            _number(parts, d, fields, "n", "n (samples per prompt)", 0, width=110)
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
    precision: int | None = None, width: int = 90, **more: Any,
) -> None:  # fmt: skip
    """A gr.Number for `name` when the form has that field (`more`: gr.Number's options)."""
    if name in fields:
        parts[name] = gr.Number(d[name], label=label, precision=precision, min_width=width, **more)
