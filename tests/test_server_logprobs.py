"""Logprobs through the OpenAI API, read by the official `openai` client: completions
`logprobs` + `echo` (the prompt scored too), chat `logprobs` + `top_logprobs`, streaming
chunks carrying their tokens' logprobs, and 400s naming the bad field. Values are checked
against log_softmax of a plain float32 transformers forward of the same tiny random Llama."""

from __future__ import annotations

import openai
import pytest
from openai_server import served_client
from tiny_hf import reference_logprobs

from engine import EngineConfig, EngineService
from engine.serving.protocol import MAX_LOGPROBS

TOL = 2e-4
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def service(tiny_hf_folder):
    svc = EngineService(EngineConfig(model=str(tiny_hf_folder), dtype="float32",
                                     max_model_len=256, num_kv_blocks=64, max_num_seqs=8))  # fmt: skip
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def client(service):
    with served_client(service) as c:
        yield c


def _ids(service, text: str) -> list[int]:
    return list(service.tokenizer(text).input_ids)


def test_completion_echo_scores_prompt_and_output(client, service, tiny_hf_folder):
    resp = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0.0,
                                     logprobs=3, echo=True)  # fmt: skip
    choice = resp.choices[0]
    prompt_ids = _ids(service, PROMPT)
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt_ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text  # every token's text, in order
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ref = reference_logprobs(tiny_hf_folder, prompt_ids)
    for pos in range(1, len(prompt_ids)):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, prompt_ids[pos]]),
                                                       abs=TOL)  # fmt: skip
        assert 3 <= len(lp.top_logprobs[pos]) <= 4  # top 3 plus the token itself
    for pos in range(len(prompt_ids), len(lp.tokens)):  # greedy: each the top alternative
        assert lp.token_logprobs[pos] == pytest.approx(max(lp.top_logprobs[pos].values()))


def test_completion_logprobs_match_the_engine_and_reference(client, service, tiny_hf_folder):
    """Token-id prompt, no echo: logprobs of the generated tokens only, equal to the plain
    forward's at the tokens the engine chose."""
    prompt_ids = _ids(service, PROMPT)
    resp = client.completions.create(model="m", prompt=prompt_ids, max_tokens=5,
                                      temperature=0.0, logprobs=0)  # fmt: skip
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and None not in lp.token_logprobs
    assert all(len(top) == 1 for top in lp.top_logprobs)  # k = 0: only the token itself
    out = service.submit(prompt_ids, _greedy(5)).result()
    ref = reference_logprobs(tiny_hf_folder, prompt_ids + out.token_ids)
    expected = [float(ref[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert lp.token_logprobs == pytest.approx(expected, abs=TOL)


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)


def test_completion_stream_carries_logprobs(client):
    kwargs = dict(model="m", prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]  # fmt: skip
    assert tokens == whole.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])
    assert offsets == whole.logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[0].choices[0].text.startswith(PROMPT)  # echo leads the first chunk


def test_chat_logprobs_and_top_logprobs(client, service, tiny_hf_folder):
    messages = [{"role": "user", "content": "Name a color."}]
    kwargs = dict(model="m", messages=messages, max_tokens=5, temperature=0.0, logprobs=True,
                  top_logprobs=4)  # fmt: skip
    resp = client.chat.completions.create(**kwargs)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        assert bytes(entry.bytes).decode() == entry.token
    prompt_ids = service.apply_chat_template(messages)
    out = service.submit(prompt_ids, _greedy(5)).result()
    ref = reference_logprobs(tiny_hf_folder, prompt_ids + out.token_ids)
    expected = [float(ref[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert [e.logprob for e in content] == pytest.approx(expected, abs=TOL)

    streamed = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    entries = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content])

    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


BAD = [
    ("completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ("chat", {"extra_body": {"echo": True}}, "echo"),
]


@pytest.mark.parametrize(("route", "change", "field"), BAD, ids=[f"{r}-{f}" for r, _, f in BAD])
def test_bad_logprobs_requests_get_400_naming_the_field(client, route, change, field):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "completions":
            client.completions.create(model="m", prompt=PROMPT, max_tokens=2, **change)
        else:
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="m", messages=messages, max_tokens=2, **change)
    assert info.value.status_code == 400 and info.value.body["param"] == field
    assert field in info.value.body["message"]


def test_protocol_cap_is_the_engine_cap():
    from engine.request import MAX_LOGPROBS as ENGINE_MAX

    assert MAX_LOGPROBS == ENGINE_MAX
