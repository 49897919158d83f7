"""The Chat tab's n control: EngineChat streams the n replies of one request (reply 1
continues the conversation, the others come as alternatives), they render side by side with
their text escaped, and the form refuses n outside [1, MAX_CHAT_N] naming the field."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, SamplingParams
from playground.handlers.chat import MAX_CHAT_N, render, sampling_params, side_by_side
from playground.handlers.chat_engine import EngineChat


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service


def test_engine_chat_streams_n_replies_as_alternatives(service):
    chat = EngineChat(service)
    messages = [{"role": "user", "content": "Say something."}]
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=21, n=3, ignore_eos=True)

    async def run():
        return [r async for r in chat.replies(messages, params, "s1")]

    replies = asyncio.run(run())
    last = replies[-1]
    assert last.finished and not any(r.finished for r in replies[:-1])
    assert len(last.alternatives) == 2 and last.progress == "18 tokens in 3 replies"
    prompt = service.apply_chat_template(messages)
    alone = [
        service.submit(prompt, SamplingParams(max_tokens=6, temperature=0.9, seed=21 + i,
                                              ignore_eos=True)).result().text
        for i in range(3)
    ]  # fmt: skip
    assert [last.text, *last.alternatives] == alone
    assert chat.active.get("s1") is None  # the request is over
    stats = service.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_side_by_side_rendering_escapes_and_keeps_the_first_as_the_turn():
    turn = {"role": "assistant", "content": "a <b>", "stats": "TTFT 5 ms",
            "alternatives": ["x\ny", "z"]}  # fmt: skip
    shown = render([turn])[0]["content"]
    assert shown.count('class="pg-reply"') == 3 and "a &lt;b&gt;" in shown and "x<br>y" in shown
    assert "Reply 1 (continues)" in shown and shown.endswith("<sub>TTFT 5 ms</sub>")
    live = render([], "par", "live", ["tial"])[0]["content"]
    assert live.count("▌") == 2 and 'class="pg-replies"' in live
    assert render([], "par", "live")[0]["content"].startswith("par ▌")  # n = 1: as before
    assert side_by_side(["one"]).count('pg-reply"') == 1


@pytest.mark.parametrize("n", [0, MAX_CHAT_N + 1, 1.5])
def test_form_refuses_bad_n(n):
    with pytest.raises(ValueError, match=r"^n:"):
        sampling_params(0.7, 1.0, -1, 8, -1, n)
    assert sampling_params(0.7, 1.0, -1, 8, -1, 2).n == 2


def test_the_reply_finishes_whichever_sequence_ends_last():
    """request_finished comes on the last delta of the request, which may be sequence 0's
    while sequence 1 ended earlier: the reply still gets its final stats line."""
    from engine.request import RequestMetrics, RequestOutput

    def delta(index: int, text: str, finished: bool, last: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], [5], text, [5], text, finished,
                             "length" if finished else None, RequestMetrics(arrival_time=0.0),
                             index=index, request_finished=last)  # fmt: skip

    class Stream:
        request_id = "r"

        async def __aiter__(self):
            for out in (delta(0, "a", False, False), delta(1, "b", True, False),
                        delta(0, "ab", True, True)):  # fmt: skip
                yield out

    class Service:
        config = EngineConfig()  # the stats line asks about prefix caching and drafts

        def apply_chat_template(self, messages):
            return [1]

        def submit(self, prompt, params):
            return Stream()

        def abort(self, request_id):
            raise AssertionError("a finished request is not aborted")

    async def run():
        chat = EngineChat(Service())
        params = SamplingParams(max_tokens=2, n=2)
        return [r async for r in chat.replies([{"role": "user", "content": "x"}], params, "s")]

    last = asyncio.run(run())[-1]
    assert last.finished and last.text == "ab" and last.alternatives == ("b",)
