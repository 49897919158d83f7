"""Chat tab: streaming chat with a system prompt and sampling controls, a Stop button, and each
reply's TTFT / TPOT / tokens/s under it. Every browser tab shares the one engine."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.handlers_chat import (
    build_messages,
    prompt_for,
    render,
    sampling_params,
    stats_line,
    stream_reply,
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."


def stopped_message(request_id: str) -> str:
    return f"Stopped {request_id}: the engine freed its KV blocks at once."


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    with gr.Row():
        with gr.Column(scale=3):
            ui.chatbot = gr.Chatbot(
                label=f"Chat with {ctx.info.model_name}",
                height=460,
                elem_id="chatbot",
                buttons=["copy"],
            )
            with gr.Row():
                ui.message = gr.Textbox(
                    placeholder="Type a message and press Enter",
                    show_label=False,
                    scale=5,
                    elem_id="chat-input",
                    lines=1,
                    max_lines=6,
                )
                ui.send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                ui.stop = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop")
            ui.status = gr.Markdown(elem_id="chat-status")
        with gr.Column(scale=1, min_width=260):
            ui.system_prompt = gr.Textbox(DEFAULT_SYSTEM_PROMPT, label="System prompt", lines=3)
            ui.temperature = gr.Slider(0.0, 2.0, 0.7, step=0.05, label="Temperature (0 = greedy)")
            ui.top_p = gr.Slider(0.05, 1.0, 0.95, step=0.05, label="Top-p")
            ui.top_k = gr.Number(0, label="Top-k (0 = off)", precision=0)
            ui.max_tokens = gr.Slider(1, 1024, 256, step=1, label="Max new tokens")
            ui.seed = gr.Number(-1, label="Seed (-1 = random)", precision=0)
            ui.clear = gr.Button("Clear conversation")
            gr.Markdown(
                "Under each reply: **TTFT** (time to first token, from arrival in the engine), "
                "**TPOT** (mean time per later token), output tokens per second of end-to-end "
                "time, and the token count. Open this page in several browser tabs and chat at "
                "once: they share one engine, and the Engine tab shows their requests batched "
                "together in the same steps."
            )
    ui.turns = gr.State([])
    return ui


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    service = ctx.service

    async def respond(
        message,
        turns,
        system_prompt,
        temperature,
        top_p,
        top_k,
        max_tokens,
        seed,
        request: gr.Request,
    ):
        turns = list(turns or [])
        if not (message or "").strip():
            gr.Warning("Type a message first.")
            yield render(turns), turns, message, "Type a message first."
            return
        try:
            params = sampling_params(temperature, top_p, top_k, max_tokens, seed)
        except ValueError as e:
            gr.Warning(str(e))
            yield render(turns), turns, message, f"**Not sent:** {e}"
            return
        session = request.session_hash or "anonymous"
        if ctx.chats.get(session) is not None:
            busy = "A reply is still streaming: wait for it or press Stop."
            gr.Warning(busy)
            yield gr.skip(), gr.skip(), gr.skip(), busy
            return
        shown = [*turns, {"role": "user", "content": message}]
        yield render(shown, "", "waiting for the engine"), turns, "", ""
        prompt = prompt_for(service, build_messages(system_prompt or "", turns, message))
        last = None
        try:
            async for out in stream_reply(service, prompt, params, ctx.chats, session):
                last = out
                if not out.finished:
                    live = f"{out.request_id} · streaming · {len(out.token_ids)} tokens"
                    yield render(shown, out.text, live), turns, "", gr.skip()
        except (ValueError, RuntimeError) as e:  # refused (too long, ...) or shutting down
            gr.Warning(str(e))
            yield render(turns), turns, message, f"**Not sent:** {e}"
            return
        if last is None:
            yield render(turns), turns, message, "**No reply:** the stream ended without output."
            return
        text = last.text or (
            "(stopped before the first token)" if last.finish_reason == "abort" else ""
        )
        reply = {
            "role": "assistant",
            "content": text,
            "stats": stats_line(last.metrics, len(last.token_ids), last.finish_reason),
        }
        status = ""
        if last.error:
            status = f"**Engine error:** {last.error}"
        elif last.finish_reason == "abort":
            status = stopped_message(last.request_id)
        new_turns = [*shown, reply]
        yield render(new_turns), new_turns, "", status

    def stop(request: gr.Request) -> str:
        request_id = ctx.chats.get(request.session_hash or "anonymous")
        if request_id is None:
            return "Nothing to stop: no reply is streaming."
        service.abort(request_id)
        return stopped_message(request_id)

    inputs = [
        ui.message,
        ui.turns,
        ui.system_prompt,
        ui.temperature,
        ui.top_p,
        ui.top_k,
        ui.max_tokens,
        ui.seed,
    ]
    outputs = [ui.chatbot, ui.turns, ui.message, ui.status]
    # No concurrency limit: replies stream from the engine without holding a worker thread,
    # and every open browser tab must be able to chat at the same time.
    chat_args = {
        "fn": respond,
        "inputs": inputs,
        "outputs": outputs,
        "concurrency_limit": None,
        "show_progress": "hidden",
    }
    ui.send.click(**chat_args, api_name="chat")
    ui.message.submit(**chat_args, api_visibility="private")
    ui.stop.click(stop, None, ui.status, concurrency_limit=None, api_name="stop_chat")
    ui.clear.click(
        lambda: ([], [], ""), None, [ui.chatbot, ui.turns, ui.status], api_visibility="private"
    )
