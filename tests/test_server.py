"""The OpenAI-compatible server with the embedded model, driven by the official `openai` client:
parity with LLM.generate, usage, streaming, 400s per bad parameter, auth, 404/503, disconnects
freeing their KV blocks, and a bounded load test through the load generator."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine import LLM, EngineConfig, EngineService, SamplingParams
from engine.serving.http_server import BackgroundServer
from engine.serving.server import create_app
from playground.loadgen import (
    EngineTarget,
    LengthDist,
    OpenAITarget,
    WorkloadSpec,
    run_load_test,
)
from playground.loadgen import main as loadgen_main

MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 256  # 4096 tokens: enough for 32 concurrent short requests
CONFIG = dict(
    dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=32
)
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def service():
    svc = EngineService(EngineConfig(model="smollm2-135m", **CONFIG))
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", **CONFIG)


@pytest.fixture(scope="module")
def server(service):
    srv = BackgroundServer(create_app(service)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def wait_all_blocks_free(service, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = service.stats()
        if s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == s.num_waiting == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"blocks still held: {s.num_kv_blocks - s.num_free_kv_blocks}, "
                f"running {s.num_running}, waiting {s.num_waiting}"
            )
        time.sleep(0.05)


# --- discovery, health, metrics --------------------------------------------------------------


def test_models_health_and_metrics(server, client, service, model):
    assert model == service.model_name
    card = client.models.retrieve(model)
    assert card.id == model
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "playground:" in metrics.text


# --- parity and usage ------------------------------------------------------------------------


def test_completion_matches_llm_generate(client, model, llm):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0]
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")

    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_and_max_completion_tokens(client, model, llm, service):
    ids = service.tokenizer(PROMPT).input_ids
    ref = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
    resp = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert resp.choices[0].text == ref.text
    assert resp.usage.prompt_tokens == len(ids)


def test_chat_completion_matches_llm_chat(client, model, llm):
    messages = [{"role": "user", "content": "Name a fruit."}]
    ref = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0))[0]
    resp = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=12, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_sampling_options(client, model):
    seeded = [
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.9, seed=7,
            extra_body={"top_k": 50, "min_p": 0.05},
        ).choices[0].text
        for _ in range(2)
    ]  # fmt: skip
    assert seeded[0] == seeded[1]
    exact = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert exact.usage.completion_tokens == 20 and exact.choices[0].finish_reason == "length"
    full = exact.choices[0].text
    stop = full.strip().split()[1]  # a word the greedy output is known to contain
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text and full.startswith(cut.choices[0].text)


def test_logit_bias_and_openai_penalties_are_honored(client, model, llm):
    """OpenAI's own sampling fields: logit_bias with token-id string keys, presence and
    frequency penalties, each giving what the engine gives for the same SamplingParams."""
    greedy = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    forced = client.completions.create(**greedy, logit_bias={"314": 100})
    assert forced.choices[0].logprobs.tokens == [llm.tokenizer.decode([314])] * 8
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    first = plain[0].token_ids[0]
    fields = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={str(first): -100})
    served = client.completions.create(**greedy, **fields).choices[0].text
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **fields)
    assert served == llm.generate([PROMPT], params)[0].text
    assert served != plain[0].text  # the first greedy token was banned


# --- errors ----------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"extra_body": {"top_k": 0}}, "top_k"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 33}, "n"),  # above max_num_seqs (n <= 32 is served: test_server_parallel.py)
    ({"model": "no-such-model"}, "model"),
    ({"prompt": [7] * (MAX_MODEL_LEN + 10)}, "prompt"),  # too long
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),  # outside the vocabulary
    ({"prompt": ["a", "b"]}, "prompt"),  # batches are not served
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"seed": "abc"}}, "seed"),
    ({"logprobs": 21}, "logprobs"),  # above MAX_LOGPROBS (tests/test_server_logprobs.py)
    ({"presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range: [-2, 2]
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),  # keys are token ids
    ({"logit_bias": {"5": 101}}, "logit_bias"),  # biases in [-100, 100]
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"suffix": "x"}, "suffix"),
    # vLLM extensions we do not implement: refused, never silently ignored.
    ({"extra_body": {"min_tokens": 5}, "max_tokens": 4}, "min_tokens"),  # more than max_tokens
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"skip_special_tokens": False}}, "skip_special_tokens"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
]


@pytest.mark.parametrize(("change", "field"), BAD_COMPLETIONS, ids=[f for _, f in BAD_COMPLETIONS])
def test_bad_completion_parameters_get_400(client, model, change, field):
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 4} | change
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    err = info.value.body
    assert info.value.status_code == 400
    assert err["type"] == "invalid_request_error" and field in err["message"]
    assert err["param"] == field and set(err) == {"message", "type", "param", "code"}


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x " * MAX_MODEL_LEN}]}, "prompt"),
    ({"extra_body": {"add_generation_prompt": False}}, "add_generation_prompt"),
    ({"extra_body": {"bad_words": ["x"]}}, "bad_words"),
]


@pytest.mark.parametrize(("change", "field"), BAD_CHATS, ids=[f for _, f in BAD_CHATS])
def test_bad_chat_parameters_get_400(client, model, change, field):
    kwargs = {"model": model, "messages": [{"role": "user", "content": "hi"}]} | change
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs)
    assert info.value.status_code == 400 and field in info.value.body["message"]


def test_vllm_extensions_at_their_neutral_values_are_served(client, model):
    """A vLLM client often sends these with their defaults: that is no request to refuse."""
    neutral = {"min_tokens": 0, "skip_special_tokens": True, "use_beam_search": False,
               "include_stop_str_in_output": False, "bad_words": [], "some_vendor_field": 1}  # fmt: skip
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=neutral)
    assert out.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"add_generation_prompt": True, "continue_final_message": False},
    )  # fmt: skip
    assert chat.choices[0].message.role == "assistant"


def test_malformed_bodies_unknown_routes_and_methods(server):
    json_type = {"Content-Type": "application/json"}  # else 415 (see test_server_hardening)
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=json_type)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(f"{server.url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /v1/nope)"
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405


def test_api_key_and_shutdown_503(service):
    app = create_app(service, api_key="sekret", served_model_name="my-model")
    srv = BackgroundServer(app).start()
    try:
        anon = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anon.models.list()
        authed = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in authed.models.list().data] == ["my-model"]
        # The engine's own model spec is accepted as an alias of the served name.
        resp = authed.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=2)
        assert resp.model == "my-model"
        app.state.server.draining = True
        with pytest.raises(openai.InternalServerError) as info:
            authed.completions.create(model="my-model", prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 503
        assert httpx.get(f"{srv.url}/health").status_code == 503
    finally:
        srv.stop()


# --- disconnects free their blocks -----------------------------------------------------------


def test_client_disconnect_mid_stream_frees_blocks(server, service, model):
    body = {
        "model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        num_chunks = 0
        for line in resp.iter_lines():  # a few chunks, then hang up mid-stream
            num_chunks += line.startswith("data: {")
            if num_chunks == 3:
                break
        assert service.stats().num_running == 1
    wait_all_blocks_free(service)
    last = service.stats().finished[-1]
    assert last.finish_reason == "abort"


def test_client_disconnect_while_waiting_non_streaming_frees_blocks(server, service, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    wait_all_blocks_free(service)
    assert service.stats().finished[-1].finish_reason == "abort"


# --- the load generator against the server and the engine ------------------------------------


@pytest.mark.slow
def test_load_test_through_the_server(server, service, model):
    spec = WorkloadSpec(
        num_prompts=200,
        max_concurrency=32,
        input_len=LengthDist.uniform(16, 64),
        output_len=LengthDist.uniform(8, 16),
        seed=1,
    )
    target = OpenAITarget(server.url, model, tokenizer=service.tokenizer)
    calls = []
    result = asyncio.run(
        run_load_test(
            spec, target, on_progress=lambda d, t, r: calls.append(d), slos_ms={"e2el": 6e5}
        )
    )
    s = result.summary()
    assert s["completed"] == 200 and s["failed"] == 0, s["errors"]
    assert calls == list(range(1, 201))
    for r in result.per_request:
        assert 16 <= r.prompt_tokens <= 64 and 8 <= r.output_tokens <= 16  # server's usage
        assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s and len(r.itl_s) == len(r.token_times) - 1
    for key in ("mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_itl_ms", "mean_e2el_ms"):
        assert s[key] is not None and s[key] > 0
    assert s["total_output_tokens"] == sum(r.output_tokens for r in result.per_request)
    assert s["good_requests"] == 200 and s["request_throughput"] > 0
    wait_all_blocks_free(service)


def test_engine_target(service):
    spec = WorkloadSpec(
        num_prompts=8, max_concurrency=4, input_len=24, output_len=LengthDist.uniform(3, 6),
        num_warmups=1,
    )  # fmt: skip
    result = asyncio.run(run_load_test(spec, EngineTarget(service)))
    s = result.summary()
    assert s["completed"] == 8 and s["total_input_tokens"] == 8 * 24
    assert all(r.queue_s is not None and r.queue_s >= 0 for r in result.per_request)
    assert s["mean_queue_ms"] is not None and s["mean_tpot_ms"] > 0
    wait_all_blocks_free(service)


def test_loadgen_cli_against_the_server(server, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = loadgen_main(
        [
            "--base-url", server.url, "--tokenizer", "smollm2-135m", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "4", "--request-rate", "50",
            "--goodput", "e2el:600000", "--result-file", str(out), "--disable-tqdm",
        ]
    )  # fmt: skip
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["summary"]["completed"] == 4 and saved["summary"]["good_requests"] == 4
    assert len(saved["per_request"]) == 4


@pytest.mark.slow
def test_server_cli_starts_serves_and_stops(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.serving.server", "--port", str(port), "--dtype", "float32",
         "--num-kv-blocks", "64", "--max-model-len", "256"],
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["max_model_len"] == 256
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_every_engine_config_field_is_a_server_flag():
    from engine.config import EngineConfig
    from engine.serving.server import build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["--speculative-method", "ngram", "--batching", "static", "--num-kv-blocks", "64",
         "--enable-prefix-caching", "--gpu-memory-utilization", "0.5"]
    )  # fmt: skip
    fields = {k: v for k, v in vars(args).items() if k in EngineConfig.field_names()}
    assert fields == {"speculative_method": "ngram", "batching": "static", "num_kv_blocks": 64,
                      "enable_prefix_caching": True, "gpu_memory_utilization": 0.5}  # fmt: skip
    assert EngineConfig(**fields).speculative_method == "ngram"
    help_text = parser.format_help()
    for name in EngineConfig.field_names():
        assert f"--{name.replace('_', '-')}" in help_text
    with pytest.raises(SystemExit):  # a Literal field's choices are checked by argparse
        parser.parse_args(["--speculative-method", "medusa"])
