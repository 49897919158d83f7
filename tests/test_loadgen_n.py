"""The load generator's `n` (samples per prompt): validated, a CLI flag, the completions body's
`n` for an OpenAI server, SamplingParams.n for the engine; both targets count every sample's
tokens (as OpenAI's usage does)."""

from __future__ import annotations

import asyncio
import json
import shlex

import httpx
import pytest

from engine import EngineConfig
from playground.loadgen import EngineTarget, GenRequest, OpenAITarget, WorkloadSpec
from playground.loadgen.run import build_parser, spec_from_args
from playground.remote.client import OpenAIClient

PROMPT_IDS = list(range(100, 120))


def _sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_n_is_validated_and_a_cli_flag():
    assert WorkloadSpec().n == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"^n:"):
            WorkloadSpec(n=bad)
    assert spec_from_args(build_parser().parse_args(shlex.split("--n 4"))).n == 4


@pytest.mark.parametrize("with_usage", [True, False])
def test_openai_target_sends_n_and_counts_every_choice(with_usage):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        # Two choices, interleaved as a server streams them: 2 tokens each.
        text = [{"choices": [{"index": i % 2, "text": t, "finish_reason": None}]}
                for i, t in enumerate("abcd")]  # fmt: skip
        ends = [{"choices": [{"index": i, "text": "", "finish_reason": "length"}]} for i in (0, 1)]
        usage = [{"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 4}}]
        return httpx.Response(200, text=_sse(*text, *ends, *(usage if with_usage else [])))

    async def go():
        client = OpenAIClient("http://x:1/v1", transport=httpx.MockTransport(handler))
        target = OpenAITarget("http://x:1/v1", "m", client=client)
        r = await target.send(GenRequest(0, PROMPT_IDS, 20, 2), WorkloadSpec(n=2, output_len=2))
        await target.aclose()
        return r

    r = asyncio.run(go())
    assert seen["body"]["n"] == 2
    assert r.success and r.output_tokens == 4 and len(r.token_times) == 4
    one = OpenAITarget("http://x:1/v1", "m").payload(
        GenRequest(0, PROMPT_IDS, 20, 2), WorkloadSpec()
    )
    assert "n" not in one  # n = 1 is not sent (every server's default)


def test_engine_target_counts_every_sample_of_an_n_request():
    from engine.serving.service import EngineService

    config = EngineConfig(model="random:tiny", dtype="float32", num_kv_blocks=64, block_size=4)
    service = EngineService(config)
    try:
        spec = WorkloadSpec(n=3, output_len=5, temperature=0.8, ignore_eos=True)
        r = asyncio.run(EngineTarget(service).send(GenRequest(0, PROMPT_IDS, 20, 5), spec))
        assert r.success, r.error
        assert r.prompt_tokens == 20 and r.output_tokens == 15 and len(r.output_token_ids) == 15
        assert r.finish_reason == "length"
        assert len(r.token_times) == 15  # one delta per token per sample
        stats = service.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks  # the request is over
    finally:
        service.shutdown()
