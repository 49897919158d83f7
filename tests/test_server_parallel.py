"""n > 1 through the OpenAI API, read by the official `openai` client: n choices (by index)
that equal single-sequence runs seeded seed, seed + 1, ..., streamed or not, usage counting
every choice's tokens, and 400s naming `n`."""

from __future__ import annotations

import collections

import openai
import pytest
from openai_server import served_client

from engine import EngineConfig, EngineService, SamplingParams

MAX_NUM_SEQS = 8
PROMPT = "The quick brown fox jumps over the lazy dog again"


@pytest.fixture(scope="module")
def service(tiny_hf_folder):
    svc = EngineService(EngineConfig(model=str(tiny_hf_folder), dtype="float32",
                                     max_model_len=256, num_kv_blocks=128, block_size=4,
                                     max_num_seqs=MAX_NUM_SEQS))  # fmt: skip
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def client(service):
    with served_client(service) as c:
        yield c


def _alone(service, prompt, seed: int, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True)
    return service.submit(prompt, params).result().text


def test_completion_n_choices_equal_seeded_single_runs(client, service):
    kwargs = dict(model="m", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=40, n=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
    resp = client.completions.create(**kwargs)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    expected = [_alone(service, PROMPT, 40 + i, 6) for i in range(3)]
    assert [c.text for c in resp.choices] == expected
    assert resp.usage.completion_tokens == 18
    assert resp.usage.prompt_tokens == len(service.tokenizer(PROMPT).input_ids)

    streamed = collections.defaultdict(str)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))  # fmt: skip
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(3)] == expected
    assert chunks[-1].usage.completion_tokens == 18


def test_chat_n_choices_streamed_and_not(client, service):
    messages = [{"role": "user", "content": "Say something."}]
    kwargs = dict(model="m", messages=messages, max_tokens=5, temperature=0.8, seed=7, n=2,
                  logprobs=True, extra_body={"ignore_eos": True})  # fmt: skip
    resp = client.chat.completions.create(**kwargs)
    prompt_ids = service.apply_chat_template(messages)
    expected = [_alone(service, prompt_ids, 7 + i, 5) for i in range(2)]
    assert [c.message.content for c in resp.choices] == expected
    assert all(len(c.logprobs.content) == 5 for c in resp.choices)
    streamed = collections.defaultdict(str)
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(2)] == expected


@pytest.mark.parametrize("n", [0, MAX_NUM_SEQS + 1])
def test_bad_n_gets_400_naming_n(client, n):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2, n=n)
    assert info.value.body["param"] == "n" and "n" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=n
        )
    assert info.value.body["param"] == "n"
