"""The playground: one gr.Blocks with a tab per concept, over one EngineService, or in remote
mode over an OpenAI-compatible server (no engine loaded).

demo = build_app(service)                                  # or build_app(remote=RemoteServer)
launch(demo, host="127.0.0.1", port=7860)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr

from playground.context import AppContext, MakeService
from playground.engine_client import EngineClient
from playground.engine_info import describe
from playground.remote.client import RemoteServer
from playground.tabs import (
    chat,
    compare,
    compare_remote,
    engine_live,
    kv_calculator,
    latency,
    load_test,
    needs_engine,
    roofline,
)

CSS_PATH = Path(__file__).with_name("theme.css")
PLAIN_COPY_JS = Path(__file__).with_name("plain_copy.js")  # the chat's copy buttons copy text

# (tab label, module, elem_id): the order they appear in.
TABS = (
    ("Chat", chat, "tab-chat"),
    ("Engine (live)", engine_live, "tab-engine"),
    ("Roofline", roofline, "tab-roofline"),
    ("Latency", latency, "tab-latency"),
    ("Load test", load_test, "tab-loadtest"),
    ("Compare", compare, "tab-compare"),
    ("KV calculator", kv_calculator, "tab-kv"),
)
# Remote mode: the same tabs; those that read our engine's telemetry say why they are empty.
REMOTE_TABS = (
    ("Chat", chat, "tab-chat"),
    ("Engine (live)", needs_engine.ENGINE_LIVE, "tab-engine"),
    ("Roofline", roofline, "tab-roofline"),
    ("Latency", needs_engine.LATENCY, "tab-latency"),
    ("Load test", load_test, "tab-loadtest"),
    ("Compare", compare_remote, "tab-compare"),
    ("KV calculator", kv_calculator, "tab-kv"),
)


def describe_remote(remote: RemoteServer) -> str:
    length = f"max_model_len {remote.max_model_len}" if remote.max_model_len else "max_model_len?"
    return (
        f"**{remote.model}** served by `{remote.base_url}` (remote mode, OpenAI API) · {length} "
        "· chat, load test and compare are measured by this client; the engine tabs need our "
        "engine"
    )


def build_app(
    service: EngineClient | None = None,
    *,
    remote: RemoteServer | None = None,
    make_service: MakeService | None = None,
    title: str | None = None,
) -> gr.Blocks:
    """The whole UI over `service` (an EngineService), or over `remote` (an OpenAI-compatible
    server; no engine). make_service builds the Compare tab's engines from an EngineConfig
    (default: EngineService)."""
    if (service is None) == (remote is None):
        raise ValueError("build_app: give either an EngineService or a RemoteServer")
    if remote is not None:
        ctx = AppContext.for_remote(remote)
        header, tabs = describe_remote(remote), REMOTE_TABS
    else:
        ctx = AppContext.for_service(service, make_service)
        header, tabs = describe(ctx.info), TABS
    with gr.Blocks(title=title or "Inference playground", analytics_enabled=False) as demo:
        gr.Markdown(f"# Inference playground\n{header}", elem_id="header")
        uis = []
        with gr.Tabs():
            for label, module, elem_id in tabs:
                with gr.Tab(label, elem_id=elem_id) as tab:
                    ui = module.create_ui(ctx)
                ui.tab = tab
                uis.append((module, ui))
        for module, ui in uis:
            module.create_event_handlers(ui, ctx)
        _timers_follow_tabs([ui for _, ui in uis])
    demo.queue(default_concurrency_limit=2)
    demo.playground_context = ctx  # for tests and app.py
    return demo


def _timers_follow_tabs(uis: list[SimpleNamespace]) -> None:
    """Only the open tab's timer ticks: a tab in the background costs the engine nothing."""
    timers = [ui.timer for ui in uis if hasattr(ui, "timer")]

    def activate(own: gr.Timer | None) -> Callable[[], list[gr.Timer]]:
        return lambda: [gr.Timer(active=t is own) for t in timers]

    for ui in uis:
        ui.tab.select(
            activate(getattr(ui, "timer", None)),
            None,
            timers,
            api_visibility="private",
            concurrency_limit=None,
            show_progress="hidden",
        )


def launch(
    demo: gr.Blocks,
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    block: bool = True,
    **kwargs: Any,
) -> Any:
    """demo.launch with the playground's CSS; no public share link unless asked. show_error:
    the handlers turn bad form values into messages of their own, so what reaches Gradio is a
    value no form can send (an API client's string for a slider: "Expected a `float`...") or a
    bug; either is better named to the caller than hidden behind Gradio's "the upstream app
    has raised an exception"."""
    return demo.launch(
        server_name=host,
        server_port=port,
        share=share,
        prevent_thread_lock=not block,
        css_paths=[CSS_PATH],
        js=PLAIN_COPY_JS.read_text(),
        show_error=True,
        quiet=not block,
        **kwargs,
    )
