"""Remote mode: the playground over an OpenAI-compatible server instead of its own engine. The
"remote" is our own server with a small engine, in-process on 127.0.0.1; the app is built with
build_app(remote=...) and driven through its handlers and gradio_client."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from engine import EngineConfig
from engine.serving.http_server import BackgroundServer
from engine.serving.server import create_app
from engine.serving.service import EngineService
from playground.handlers.chat import ActiveRequests, sampling_params
from playground.handlers.chat_remote import RemoteChat
from playground.handlers.loadtest import WORKLOAD_FIELDS
from playground.remote.chat import ChatStream, chat_body
from playground.remote.client import RemoteServer
from playground.tabs.compare import WORKLOAD_FIELDS as COMPARE_FIELDS

pytestmark = [
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting'"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

NUM_KV_BLOCKS = 256
SMALL_ENGINE = {"model": "smollm2-135m", "dtype": "bfloat16", "num_kv_blocks": NUM_KV_BLOCKS,
                "max_model_len": 1024}  # fmt: skip
LONG = "Write a long story about a dragon."


@pytest.fixture(scope="module")
def service():
    svc = EngineService(EngineConfig(**SMALL_ENGINE))
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def server(service):
    srv = BackgroundServer(create_app(service), port=0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def remote(server):
    return RemoteServer.connect(server.url, tokenizer_name="smollm2-135m")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(remote):
    from gradio_client import Client

    from playground.app import build_app, launch

    demo = build_app(remote=remote)
    port = _free_port()
    launch(demo, port=port, block=False)
    yield demo, Client(f"http://127.0.0.1:{port}/", verbose=False)
    demo.close()


def wait_all_blocks_free(service, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = service.stats()
        if s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == s.num_waiting == 0:
            return
        assert time.monotonic() < deadline, f"{s.num_kv_blocks - s.num_free_kv_blocks} held"
        time.sleep(0.05)


def _wait_running(service, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while service.stats().num_running == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)


# --- the client module ----------------------------------------------------------------------


def test_connect_reads_the_served_model_and_says_what_is_wrong(server, remote):
    import app as entry

    assert remote.model == "smollm2-135m" and remote.max_model_len == 1024
    assert RemoteServer.connect(f"{server.url}/v1/").base_url == f"{server.url}/v1"
    with pytest.raises(ValueError, match="no OpenAI server answers"):
        RemoteServer.connect(f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(ValueError, match="expected http://host:port"):
        RemoteServer.connect("localhost:8000")
    assert entry.main(["--base-url", f"http://127.0.0.1:{_free_port()}"]) == 2


def test_chat_body_sends_the_form_fields():
    body = chat_body("m", [{"role": "user", "content": "hi"}], sampling_params(0.5, 0.9, 5, 32, 7))
    assert body["top_k"] == 5 and body["seed"] == 7 and body["max_tokens"] == 32
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    off = chat_body("m", [], sampling_params(0.5, 0.9, -1, 32, -1))
    assert "top_k" not in off and "seed" not in off
    assert "frequency_penalty" not in off and "presence_penalty" not in off
    penalized = chat_body("m", [], sampling_params(0.5, 0.9, -1, 32, -1, 1, 1.5, -0.5))
    assert penalized["frequency_penalty"] == 1.5 and penalized["presence_penalty"] == -0.5


def _chat_text(backend, params, prompt: str = LONG) -> str:
    async def chat():
        last = None
        async for reply in backend.replies([{"role": "user", "content": prompt}], params, "p"):
            last = reply
        return last

    last = asyncio.run(chat())
    assert last.error is None, last.error
    return last.text


def test_remote_penalties_reach_the_server_and_match_the_engine_chat(remote, service):
    """The Chat tab's frequency and presence penalties, sent over HTTP, change a greedy reply
    exactly as they change the in-process engine's: the server applied them, not dropped."""
    from playground.handlers.chat_engine import EngineChat

    plain = sampling_params(0.0, 1.0, -1, 32, -1)
    penalized = sampling_params(0.0, 1.0, -1, 32, -1, 1, 1.5, 0.5)
    over_http = _chat_text(RemoteChat(remote), penalized)
    assert over_http == _chat_text(EngineChat(service), penalized)
    assert over_http != _chat_text(RemoteChat(remote), plain)  # so the test can tell


def _last_reply(backend, params, prompt: str = "Name three colors."):
    async def chat():
        return [
            r async for r in backend.replies([{"role": "user", "content": prompt}], params, "t")
        ][-1]

    return asyncio.run(chat())


def test_remote_token_probabilities_match_the_engine_chats(remote, service, monkeypatch):
    """The token view in remote mode: chat_body asks for logprobs, the stream's entries are
    collected (also from chunks whose text is held back), and they equal what EngineChat reads
    from the engine for the same greedy reply."""
    import playground.handlers.chat_remote as chat_remote
    from playground.handlers.chat_engine import EngineChat
    from playground.handlers.token_probs import TOP_LOGPROBS

    params = sampling_params(0.0, 1.0, -1, 16, -1, token_probs=True)
    body = chat_body("m", [], params)
    assert body["logprobs"] is True and body["top_logprobs"] == TOP_LOGPROBS
    over_http = _last_reply(RemoteChat(remote), params)
    local = _last_reply(EngineChat(service), params)
    assert over_http.text == local.text and len(over_http.tokens[0]) == len(local.tokens[0]) > 0
    for a, b in zip(over_http.tokens[0], local.tokens[0], strict=True):
        assert a.text == b.text and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert "perplexity" in over_http.stats and "measured by the client" in over_http.stats

    # A server that ignores `logprobs: true` (here: the request never asks) sends none: the
    # reply is text, and the stats line says the probabilities are missing.
    def without_logprobs(*args):
        return {k: v for k, v in chat_body(*args).items() if "logprobs" not in k}

    monkeypatch.setattr(chat_remote, "chat_body", without_logprobs)
    bare = _last_reply(RemoteChat(remote), params)
    assert bare.text == local.text and bare.tokens == ()
    assert bare.stats.endswith(chat_remote.NO_LOGPROBS)


def test_remote_chat_refuses_what_it_cannot_send(app, service):
    """n > 1 and the repetition penalty have no portable OpenAI field: 'Not sent', with the
    reason, instead of a reply to a different request."""
    _, client = app
    for extra, field in (((2,), "n:"), ((1, 0.0, 0.0, 1.3), "repetition_penalty")):
        chatbot, _, status = client.predict("Hi", "", 0.7, 1.0, -1, 8, -1, *extra, api_name="/chat")
        assert "Not sent" in status and field in status and chatbot == []
    wait_all_blocks_free(service)


def test_remote_chat_streams_with_client_measured_metrics(remote):
    async def chat():
        active = ActiveRequests()
        backend = RemoteChat(remote, active)
        params = sampling_params(0.0, 1.0, -1, 12, 1)
        replies, handles = [], []
        msgs = [{"role": "user", "content": "Count to ten."}]
        async for reply in backend.replies(msgs, params, "s1"):
            replies.append(reply)
            handles.append(active.get("s1"))
        return replies, handles, active

    replies, handles, active = asyncio.run(chat())
    last = replies[-1]
    assert last.finished and not last.stopped and last.error is None and last.text
    assert isinstance(handles[0], ChatStream) and active.get("s1") is None
    assert last.request_id.startswith("chatcmpl-")
    assert "TTFT" in last.stats and "measured by the client" in last.stats
    assert " tokens" in last.stats and "≥" not in last.stats  # counted from the usage report


def test_stop_closes_the_stream_and_the_server_frees_its_blocks(remote, service):
    async def chat_and_stop():
        backend = RemoteChat(remote, ActiveRequests())
        params = sampling_params(0.0, 1.0, -1, 400, 1)
        last = None
        async for reply in backend.replies([{"role": "user", "content": LONG}], params, "s"):
            last = reply
            if not reply.finished and reply.text:
                assert "Nothing" not in await asyncio.to_thread(backend.stop, "s")
        return last

    last = asyncio.run(chat_and_stop())
    assert last.finished and last.stopped and "stopped" in last.stats
    wait_all_blocks_free(service)
    assert service.stats().num_free_kv_blocks == NUM_KV_BLOCKS


# --- the app in remote mode, through gradio_client -----------------------------------------


def test_app_chat_streams_and_stop_frees_the_servers_blocks(app, service):
    _, client = app
    chatbot, message, status = client.predict(
        "Say hello.", "Be brief.", 0.0, 1.0, -1, 8, 1, api_name="/chat"
    )
    reply = chatbot[-1]["content"][0]["text"]
    assert chatbot[-1]["role"] == "assistant" and message == "" and status == ""
    assert "TTFT" in reply and "measured by the client" in reply
    job = client.submit(LONG, "", 0.0, 1.0, -1, 400, 1, api_name="/chat")
    _wait_running(service)
    time.sleep(0.3)
    assert "closed the stream" in client.predict(api_name="/stop_chat")
    chatbot, _, status = job.result(timeout=30)
    assert "stopped" in chatbot[-1]["content"][0]["text"] and "Stopped" in status
    wait_all_blocks_free(service)
    assert service.stats().num_free_kv_blocks == NUM_KV_BLOCKS


def test_app_load_test_against_the_server(app, service):
    _, client = app
    args = dict(num_prompts=8, max_concurrency=0, seed=0, arrival="all at once",
                request_rate=1, burstiness=1, input_kind="fixed", input_mean=16, input_low=1,
                input_high=16, input_std=1, output_kind="fixed", output_mean=4, output_low=1,
                output_high=4, output_std=1, prefix_len=0, temperature=0, top_p=1, top_k=-1, ignore_eos=True, n=1)  # fmt: skip
    progress, status, rate, queues, gantt, table, download = client.predict(
        *(args[k] for k in WORKLOAD_FIELDS), api_name="/load_test"
    )
    rows = {r[0]: r[1] for r in table["data"]}
    assert rows["Successful requests"] == "8" and rows["Total generated tokens"] == "32"
    assert float(rows["Output token throughput (tok/s)"]) > 0
    assert "Done" in status and "8 / 8 requests done" in progress
    names = {t["name"] for t in json.loads(gantt["plot"])["data"]}
    assert names == {"send → first token", "first token → end"}  # no queue segment remotely
    assert "seen by the client" in rate["plot"] and "does not expose" in queues["plot"]
    with open(download["value"], encoding="utf-8") as f:
        assert json.load(f)["summary"]["completed"] == 8
    wait_all_blocks_free(service)


def test_engine_tabs_show_why_they_are_empty(app):
    demo, client = app
    texts = {
        c["props"].get("elem_id"): c["props"].get("value")
        for c in demo.config["components"]
        if c["type"] == "markdown"
    }
    for elem_id in ("live-needs-engine", "latency-needs-engine"):
        assert "engine's own telemetry" in texts[elem_id]
        assert "does not expose it" in texts[elem_id] and "without `--base-url`" in texts[elem_id]
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert "/live_refresh" not in endpoints and "/latency" not in endpoints
    figure, caption = client.predict("H100 SXM", api_name="/roofline")
    assert "step points need our engine" in caption and "NVIDIA H100 SXM" in caption
    assert "roof: min(peak" in figure["plot"]
    formula, _, _, pool = client.predict(api_name="/kv_calc")
    assert "17,179,869,184" in formula  # Llama-3-8B, 4096 tokens, batch 32, bf16: presets work
    assert "needs our engine" in pool


def test_app_compare_two_servers(app, server):
    _, client = app
    work = dict(num_prompts=3, seed=0, arrival="all at once", request_rate=1,
                input_kind="fixed", input_mean=16, input_low=1, input_high=16, input_std=1,
                output_kind="fixed", output_mean=3, output_low=1, output_high=3, output_std=1,
                prefix_len=8, n=1)  # fmt: skip
    values = [work[k] for k in COMPARE_FIELDS]
    _, status, *_ = client.predict("", "", "", 1, *values, api_name="/compare")
    assert "Not started" in status and "B base URL" in status
    _, status, *_ = client.predict(server.url, "", "", 6, *values, api_name="/compare")
    assert "Not started" in status and "runs per side: at most 5" in status
    progress, status, table, _, _, download = client.predict(
        server.url, "", "", 2, *values, api_name="/compare"
    )
    rows = {r[0]: r for r in table["data"]}
    assert rows["Successful requests"][1:3] == ["3", "3"], status
    assert "Engine steps" not in rows and "Peak KV blocks held" not in rows
    assert "Done" in status and "2 run(s) per side" in status, status
    assert "3 / 3 requests done" in progress and "ran them 2 time(s)" in progress, progress
    with open(download["value"], encoding="utf-8") as f:  # the whole compare, as a file
        saved = json.load(f)
    assert saved["kind"] == "compare" and saved["runs_per_side"] == 2
    assert saved["table"]["rows"] == table["data"] and saved["spec"]["num_prompts"] == 3
    for side in saved["sides"]:
        assert side["config"] is None and side["error"] is None  # remote: the label says which
        assert [run["summary"]["completed"] for run in side["runs"]] == [3, 3]
        assert len(side["runs"][0]["per_request"]) == 3
