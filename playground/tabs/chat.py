"""Chat tab: streaming chat with a system prompt and sampling controls, a Stop button, and each
reply's TTFT / TPOT / tokens/s under it. Every browser tab shares the one engine (or, in remote
mode, the one OpenAI-compatible server)."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

import gradio as gr

from playground.context import AppContext
from playground.handlers.chat import (
    CHAT_TEMPERATURE,
    CHAT_TOP_P,
    MAX_CHAT_N,
    TOP_LOGPROBS,
    ChatBackend,
    ChatSessions,
    build_messages,
    render,
    sampling_params,
)
from playground.handlers.chat_engine import EngineChat
from playground.handlers.chat_remote import RemoteChat

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
SEND_LABEL = "Send"
SEND_BUSY_LABEL = "Streaming… (Stop to send again)"
BUSY = (
    "A reply is still streaming: Send is off until it ends or you press Stop "
    "(your draft stays in the box)."
)

ENGINE_NOTE = (
    "Under each reply: **TTFT** (time to first token, from arrival in the engine), "
    "**TPOT** (mean time per later token), output tokens per second of end-to-end "
    "time, and the token count. Open this page in several browser tabs and chat at "
    "once: they share one engine, and the Engine tab shows their requests batched "
    "together in the same steps."
)
REMOTE_NOTE = (
    "Replies stream from `{url}` (POST /v1/chat/completions; the server applies its chat "
    "template). Under each reply, **measured by the client** (this playground, over HTTP): "
    "**TTFT** from sending the request to the first content chunk (network, queueing and "
    "prefill together), **TPOT** = (end-to-end - TTFT) / (tokens - 1), output tokens per "
    "second of end-to-end time, and the token count from the server's usage report. Top-k is "
    "sent as vLLM's `top_k` extension. **Stop** closes the stream."
)


TOKEN_PROBS_INFO = (
    "Shades each token by the model's probability of it (darker = less likely; raw logits, "
    f"before temperature and penalties); hover a token for its top {TOP_LOGPROBS}. The stats "
    "line adds the reply's perplexity."
)
DRAFTS_INFO = " Underlined: accepted speculative drafts."


def _drafts_on(ctx: AppContext) -> bool:
    """The in-process engine verifies drafts (the token view can mark the accepted ones)."""
    return ctx.service is not None and ctx.service.config.speculative_method != "off"


def create_ui(ctx: AppContext) -> SimpleNamespace:
    ui = SimpleNamespace()
    with gr.Row():
        with gr.Column(scale=3):
            ui.chatbot = gr.Chatbot(
                label=f"Chat with {ctx.remote.label if ctx.remote else ctx.info.model_name}",
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
                ui.send = gr.Button(SEND_LABEL, variant="primary", scale=1, elem_id="chat-send")
                ui.stop = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop")
            ui.status = gr.Markdown(elem_id="chat-status")
        with gr.Column(scale=1, min_width=260):
            ui.system_prompt = gr.Textbox(DEFAULT_SYSTEM_PROMPT, label="System prompt", lines=3)
            ui.temperature = gr.Slider(
                0.0, 2.0, CHAT_TEMPERATURE, step=0.05, label="Temperature (0 = greedy)"
            )
            ui.top_p = gr.Slider(0.05, 1.0, CHAT_TOP_P, step=0.05, label="Top-p")
            # precision=None: Gradio would round 2.5 silently; sampling_params refuses it.
            ui.top_k = gr.Number(-1, label="Top-k (-1 = off)", elem_id="chat-top-k")
            ui.max_tokens = gr.Slider(1, 1024, 256, step=1, label="Max new tokens")
            # -1: our engine draws the reply's seed from its own --seed (as vLLM does), so a
            # restarted app replays the same conversation; a remote server gets no seed.
            ui.seed = gr.Number(
                -1, label="Seed (-1 = random)", elem_id="chat-seed",
                info="-1 sends no seed: the server picks" if ctx.remote else
                "-1 takes the next seed from the engine's --seed (the same after a restart)",
            )  # fmt: skip
            # Parallel sampling: n replies from one prompt, sharing its KV blocks (engine
            # only; a remote server's n support varies, so remote mode keeps n = 1).
            ui.n = gr.Slider(
                1, MAX_CHAT_N, 1, step=1, label="Replies (n, side by side)", elem_id="chat-n",
                info="n > 1 shares the prompt's KV blocks; needs a temperature > 0 to differ",
                visible=ctx.remote is None,
            )  # fmt: skip
            ui.token_probs = gr.Checkbox(
                False, label="Show token probabilities", elem_id="chat-token-probs",
                info=TOKEN_PROBS_INFO + (DRAFTS_INFO if _drafts_on(ctx) else ""),
            )  # fmt: skip
            # The 135M model loops ("the hornet's hornet's ..."); these are the usual cure.
            with gr.Accordion("Repetition penalties", open=False, elem_id="chat-penalties"):
                ui.frequency_penalty = gr.Slider(
                    -2.0, 2.0, 0.0, step=0.1, label="Frequency penalty",
                    info="logit -= penalty x times the token appeared in the reply so far",
                    elem_id="chat-frequency-penalty",
                )  # fmt: skip
                ui.presence_penalty = gr.Slider(
                    -2.0, 2.0, 0.0, step=0.1, label="Presence penalty",
                    info="logit -= penalty once the token appeared in the reply",
                    elem_id="chat-presence-penalty",
                )  # fmt: skip
                # Not an OpenAI field: remote mode would have no portable way to send it.
                ui.repetition_penalty = gr.Slider(
                    1.0, 2.0, 1.0, step=0.05, label="Repetition penalty (1 = off)",
                    info="divides a seen token's positive logit (multiplies a negative one); "
                    "counts the prompt too",
                    elem_id="chat-repetition-penalty", visible=ctx.remote is None,
                )  # fmt: skip
            ui.clear = gr.Button("Clear conversation", elem_id="chat-clear")
            gr.Markdown(REMOTE_NOTE.format(url=ctx.remote.base_url) if ctx.remote else ENGINE_NOTE)
    ui.turns = gr.State([])
    ui.api_trigger = gr.Button(visible=False)  # carries the /chat API (create_event_handlers)
    return ui


# Seconds Clear waits after stopping a streaming reply before it answers (clear() says why).
CLEAR_SETTLE_S = 0.5


def create_event_handlers(ui: SimpleNamespace, ctx: AppContext) -> None:
    backend: ChatBackend = (
        RemoteChat(ctx.remote) if ctx.remote is not None else EngineChat(ctx.service)
    )
    sessions = ChatSessions()

    async def respond(
        message,
        turns,
        system_prompt,
        temperature,
        top_p,
        top_k,
        max_tokens,
        seed,
        n,
        frequency_penalty,
        presence_penalty,
        repetition_penalty,
        token_probs,
        request: gr.Request,
    ):
        # Streaming updates never write the input box (gr.skip()): what the user types while
        # a reply streams is the next draft and stays.
        turns = list(turns or [])
        if not (message or "").strip():
            gr.Warning("Type a message first.")
            yield render(turns), turns, message, "Type a message first.", gr.skip()
            return
        try:
            params = sampling_params(temperature, top_p, top_k, max_tokens, seed, n,
                                     frequency_penalty, presence_penalty, repetition_penalty,
                                     bool(token_probs))  # fmt: skip
        except ValueError as e:
            gr.Warning(str(e))
            yield gr.skip(), gr.skip(), gr.skip(), f"**Not sent:** {e}", gr.skip()
            return
        session = request.session_hash or "anonymous"
        conversation = sessions.begin(session)
        if conversation is None:
            gr.Warning(BUSY)
            yield gr.skip(), gr.skip(), gr.skip(), f"**Not sent:** {BUSY}", gr.skip()
            return
        # Send is off while the reply streams (its label says why), on again with the last
        # update; every update after _stream's loop is a last one (done).
        try:
            async for *update, done in _stream(message, turns, system_prompt, params, session):
                if not sessions.current(session, conversation):
                    return  # cleared meanwhile: the reply was stopped, show nothing of it
                if done:
                    sessions.end(session, conversation)
                    yield *update, gr.Button(SEND_LABEL, interactive=True)
                else:
                    yield *update, gr.Button(SEND_BUSY_LABEL, interactive=False)
        finally:
            sessions.end(session, conversation)

    async def _stream(message, turns, system_prompt, params, session):
        shown = [*turns, {"role": "user", "content": message}]
        yield render(shown, "", backend.waiting), turns, "", BUSY, False
        messages = build_messages(system_prompt or "", turns, message)
        last = None
        try:
            async for reply in backend.replies(messages, params, session):
                last = reply
                if not reply.finished:
                    live = f"{reply.request_id or 'reply'} · streaming · {reply.progress}"
                    view = render(shown, reply.text, live, reply.alternatives, reply.tokens)
                    yield view, turns, gr.skip(), gr.skip(), False
        except (ValueError, RuntimeError) as e:  # refused (too long, ...) or shutting down
            gr.Warning(str(e))
            yield render(turns), turns, message, f"**Not sent:** {e}", True
            return
        if last is None:
            no_reply = "**No reply:** the stream ended without output."
            yield render(turns), turns, message, no_reply, True
            return
        if last.error and not last.text:  # refused by the server (HTTP 400, ...): not sent
            gr.Warning(last.error)
            yield render(turns), turns, message, f"**{backend.error_label}:** {last.error}", True
            return
        text = last.text or ("(stopped before the first token)" if last.stopped else "")
        turn = {"role": "assistant", "content": text, "stats": last.stats}
        if last.alternatives:  # n > 1: shown beside the reply; only the first continues
            turn["alternatives"] = list(last.alternatives)
        if any(last.tokens):  # the token view; "content" stays the text the model sees next
            turn["tokens"] = [list(t) for t in last.tokens]
        status = ""
        if last.error:
            status = f"**{backend.error_label}:** {last.error}"
        elif last.stopped:
            status = backend.stopped_message(last.request_id)
        new_turns = [*shown, turn]
        yield render(new_turns), new_turns, gr.skip(), status, True

    @functools.wraps(respond)  # respond's signature: Gradio passes the gr.Request it names
    async def respond_api(*form_and_request):
        async for chatbot, turns, message, status, _ in respond(*form_and_request):
            yield chatbot, turns, "" if message == gr.skip() else message, status

    def stop(request: gr.Request) -> str:
        return backend.stop(request.session_hash or "anonymous")

    async def clear(request: gr.Request):
        """A new conversation: the kept turns go, and a streaming reply stops."""
        session = request.session_hash or "anonymous"
        streaming = sessions.streaming(session)
        sessions.reset(session)
        if streaming:
            await asyncio.to_thread(backend.stop, session)
            # An update the reply yielded just before the reset travels on its own event
            # stream and could reach the browser after this one, redrawing the old
            # conversation (seen under load in test_browser_chat). Answer after it has landed.
            await asyncio.sleep(CLEAR_SETTLE_S)
        status = "Cleared; the streaming reply was stopped." if streaming else ""
        return [], [], status, gr.Button(SEND_LABEL, interactive=True)

    def check_field(name: str):
        def check(value):
            try:
                if name == "top_k":
                    sampling_params(0.7, 1.0, value, 1, -1)
                else:
                    sampling_params(0.7, 1.0, -1, 1, value)
            except ValueError as e:
                return f"**Fix before sending:** {e}"
            return ""

        return check

    inputs = [
        ui.message,
        ui.turns,
        ui.system_prompt,
        ui.temperature,
        ui.top_p,
        ui.top_k,
        ui.max_tokens,
        ui.seed,
        ui.n,
        ui.frequency_penalty,
        ui.presence_penalty,
        ui.repetition_penalty,
        ui.token_probs,
    ]
    outputs = [ui.chatbot, ui.turns, ui.message, ui.status, ui.send]
    # No concurrency limit: replies stream without holding a worker thread, and every open
    # browser tab must be able to chat at the same time. trigger_mode "multiple": a send while
    # a reply streams reaches respond and is refused visibly ("once" dropped it silently).
    chat_args = {
        "fn": respond,
        "inputs": inputs,
        "outputs": outputs,
        "concurrency_limit": None,
        "show_progress": "hidden",
        "trigger_mode": "multiple",
        "api_visibility": "private",
    }
    quiet = {"api_visibility": "private", "show_progress": "hidden", "concurrency_limit": None}
    replies = [ui.send.click(**chat_args), ui.message.submit(**chat_args)]
    # The /chat API on its own hidden trigger: an API caller has neither a draft to keep nor
    # a Send button, so its last output clears the message ("" where the browser's events
    # leave the box alone).
    api_args = {**chat_args, "fn": respond_api, "outputs": outputs[:4], "api_visibility": "public"}
    ui.api_trigger.click(**api_args, api_name="chat")
    ui.stop.click(stop, None, ui.status, concurrency_limit=None, api_name="stop_chat")
    # cancels: the browser drops the stale reply's updates still in flight, which would
    # otherwise redraw the old conversation after the clear.
    clear_args = {"fn": clear, "outputs": [ui.chatbot, ui.turns, ui.status, ui.send],
                  "cancels": replies, **quiet}  # fmt: skip
    ui.clear.click(**clear_args)
    ui.chatbot.clear(**clear_args)  # the chatbot's own trash icon: the same new conversation
    ui.top_k.blur(check_field("top_k"), ui.top_k, ui.status, **quiet)
    ui.seed.blur(check_field("seed"), ui.seed, ui.status, **quiet)
