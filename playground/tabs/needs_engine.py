"""A tab that reads our engine's own telemetry, shown in remote mode as an empty state saying
why: an OpenAI-compatible server exposes no block map, step stats or per-request engine metrics.
Used in place of a tab module (same create_ui / create_event_handlers)."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext


def needs_engine_markdown(what: str, base_url: str) -> str:
    return (
        f"### Needs our engine\n\n{what} read the engine's own telemetry; a remote OpenAI server "
        f"(here `{base_url}`) does not expose it. Run the playground with our engine to see "
        "them: `make run`, or `.venv/bin/python app.py --model ...`, without `--base-url`.\n\n"
        "What works against the remote server: **Chat**, **Load test** and **Compare** (all "
        "measured by the client), the **Roofline**'s datasheet roofs and the **KV calculator**'s "
        "presets."
    )


class NeedsEngine:
    def __init__(self, what: str, elem_id: str) -> None:
        self.what = what  # e.g. "The block map, request queues and batch composition"
        self.elem_id = elem_id

    def create_ui(self, ctx: AppContext) -> SimpleNamespace:
        base_url = ctx.remote.base_url if ctx.remote is not None else "none"
        md = gr.Markdown(needs_engine_markdown(self.what, base_url), elem_id=self.elem_id)
        return SimpleNamespace(message=md)

    def create_event_handlers(self, ui: SimpleNamespace, ctx: AppContext) -> None:
        pass  # nothing to refresh: there is no engine to read


ENGINE_LIVE = NeedsEngine(
    "The KV block map, the KV usage gauge, the running / waiting queues and the per-step batch "
    "composition",
    "live-needs-engine",
)
LATENCY = NeedsEngine(
    "The engine-side latency distributions (TTFT from arrival in the engine, TPOT, ITL of "
    "recently finished requests) and the per-step throughput",
    "latency-needs-engine",
)
