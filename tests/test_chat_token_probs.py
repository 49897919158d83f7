"""The Chat tab's token-probability view: OpenAI chat logprobs -> TokenProbs, their HTML (one
line, escaped, shaded by probability, top alternatives on hover), the reply's perplexity, and
EngineChat delivering each reply's tokens when the form asks (remote mode: test_ui_remote)."""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from engine import SamplingParams
from engine.serving.logprobs_format import TokenTexts
from playground.handlers.chat import build_messages, render, sampling_params
from playground.handlers.chat_engine import EngineChat
from playground.handlers.token_probs import (
    MAX_ALPHA,
    TOP_LOGPROBS,
    TokenProb,
    engine_token_probs,
    from_openai,
    perplexity,
    probability_html,
    probability_stats,
)

CONTENT = [
    {"token": "<b>", "logprob": math.log(0.5),
     "top_logprobs": [{"token": "<b>", "logprob": math.log(0.5)},
                      {"token": " the", "logprob": math.log(0.25)}]},
    {"token": "\n", "logprob": 0.0, "top_logprobs": []},
    {"token": " *x*", "logprob": math.log(0.125)},
]  # fmt: skip


def test_openai_chat_logprobs_become_token_probs():
    tokens = from_openai(CONTENT)
    assert [t.text for t in tokens] == ["<b>", "\n", " *x*"]
    assert tokens[0].prob == pytest.approx(0.5) and tokens[1].prob == 1.0
    assert tokens[0].top == (("<b>", math.log(0.5)), (" the", math.log(0.25)))
    assert tokens[2].top == ()  # top_logprobs absent (top_logprobs: 0)


def test_entries_a_server_got_wrong_are_left_out_not_fatal():
    bad = [None, {"logprob": -1.0}, {"token": "a", "logprob": "x"}, {"token": "b"},
           {"token": "c", "logprob": float("nan")}, {"token": "d", "logprob": True},
           {"token": "ok", "logprob": -0.5, "top_logprobs": [{"token": 1}, {"token": "ok",
            "logprob": -0.5}]}, {"token": "e", "logprob": -1.0, "top_logprobs": "x"}]  # fmt: skip
    tokens = from_openai(bad)
    assert [(t.text, t.top) for t in tokens] == [("ok", (("ok", -0.5),)), ("e", ())]


def test_perplexity_is_exp_of_minus_the_mean_logprob():
    tokens = from_openai(CONTENT)
    assert perplexity(tokens) == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.125)) / 3))
    assert perplexity(()) is None and probability_stats(()) == ""
    assert probability_stats(tokens) == f" · perplexity {perplexity(tokens):.2f}"


def test_token_html_is_one_escaped_line_shaded_by_probability():
    shown = probability_html(from_openai(CONTENT), cursor=True)
    # One line: a newline would end the Markdown renderer's raw-HTML block mid-reply.
    assert "\n" not in shown and shown.startswith('<div class="pg-tokens">')
    assert shown.endswith(" ▌</div>")
    assert "&lt;b&gt;" in shown and "<b>" not in shown  # a token's text never becomes markup
    assert "↵<br>" in shown  # a newline token: visible, hoverable, then the line break
    assert " *x*" in shown  # raw HTML block: the asterisks stay literal
    alphas = [float(a) for a in re.findall(r"rgba\([^)]*, ([\d.]+)\)", shown)]
    assert alphas == pytest.approx([MAX_ALPHA * 0.5, 0.0, MAX_ALPHA * 0.875], abs=0.006)
    # The hover text: the token quoted with its whitespace visible, p, then the alternatives.
    assert 'title="&quot;&lt;b&gt;&quot;  p 0.500 (logprob -0.69)&#10;top 2:&#10;' in shown
    assert "&quot; the&quot;  0.250" in shown and "&quot;\\n&quot;  p 1.000" in shown


def test_accepted_drafts_are_marked_in_the_view_and_the_hover():
    plain, drafted = (TokenProb("a", -0.1, (), drafted=d) for d in (False, True))
    shown = probability_html([plain, drafted])
    assert shown.count('class="pg-tok"') == 1 and shown.count('class="pg-tok pg-drafted"') == 1
    assert shown.count("an accepted speculative draft") == 1


def test_engine_flags_beyond_an_outputs_tokens_are_later_steps():
    """The engine's flags grow while a stream is read: an output's tokens take the first ones."""
    from engine.request import TokenLogprob

    logprobs = [TokenLogprob(5, -0.1, 1), TokenLogprob(6, -0.2, 1)]
    tokens = engine_token_probs(TokenTexts(None), logprobs, [False, True, True, False])
    assert [t.drafted for t in tokens] == [False, True]
    assert not any(t.drafted for t in engine_token_probs(TokenTexts(None), logprobs, [True]))


def test_a_streaming_reply_converts_only_its_new_entries():
    """TokensSoFar: update by update, the same tokens as converting everything at once, each
    entry converted once (the engine's logprobs and a server's only grow)."""
    from engine.request import TokenLogprob
    from playground.handlers.token_probs import TokensSoFar

    remote = TokensSoFar()
    assert remote.from_openai(CONTENT[:1]) == from_openai(CONTENT[:1])
    assert remote.from_openai(CONTENT) == from_openai(CONTENT) and remote.num_seen == 3
    logprobs = [TokenLogprob(i, -0.1 * i, 1) for i in range(4)]
    drafted = [False, True, True, False]
    engine, texts = TokensSoFar(), TokenTexts(None)
    engine.from_engine(texts, logprobs[:2], drafted[:3])  # the flags run ahead of the output
    assert engine.from_engine(texts, logprobs, drafted) == engine_token_probs(
        texts, logprobs, drafted
    )
    assert engine.num_seen == 4 and [t.drafted for t in engine.tokens] == drafted


def test_a_turn_with_tokens_shows_them_and_keeps_its_text_for_the_model():
    tokens = [list(from_openai(CONTENT))]
    turn = {"role": "assistant", "content": "<b>\n *x*", "stats": "TTFT 5 ms", "tokens": tokens}
    shown = render([turn])[0]["content"]
    assert shown.startswith('<div class="pg-tokens">') and shown.endswith("<sub>TTFT 5 ms</sub>")
    assert build_messages("", [turn], "next")[0]["content"] == "<b>\n *x*"
    two = {**turn, "alternatives": ["other"], "tokens": [*tokens, list(from_openai(CONTENT[:1]))]}
    assert render([two])[0]["content"].count('class="pg-tokens"') == 2  # one per column
    # Asked but none arrived (a server that ignores logprobs): the text, as without the view.
    assert render([], "par", "live", (), [()])[0]["content"].startswith("par ▌")


def test_the_form_asks_for_top_logprobs_only_when_the_box_is_ticked():
    assert sampling_params(0.7, 1.0, -1, 8, -1).logprobs is None
    assert sampling_params(0.7, 1.0, -1, 8, -1, token_probs=True).logprobs == TOP_LOGPROBS


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service


def _replies(service, params: SamplingParams):
    chat = EngineChat(service)

    async def run():
        messages = [{"role": "user", "content": "Say something."}]
        return [r async for r in chat.replies(messages, params, "s")]

    return asyncio.run(run())


def test_engine_chat_gives_each_token_its_probability_and_alternatives(service):
    """Greedy: every token is its position's most likely (rank 1, its p the top's first), the
    tokens spell the reply, and the stats line ends with the reply's perplexity."""
    params = sampling_params(0.0, 1.0, -1, 12, -1, token_probs=True)
    replies = _replies(service, params)
    last = replies[-1]
    assert last.finished and len(last.tokens) == 1
    tokens = last.tokens[0]
    assert last.progress == f"{len(tokens)} tokens"  # one per output token
    assert "".join(t.text for t in tokens).startswith(last.text)  # (+ the EOS token's text)
    for t in tokens:
        assert len(t.top) == TOP_LOGPROBS and t.top[0] == (t.text, pytest.approx(t.logprob))
        assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
    assert last.stats.endswith(probability_stats(tokens))
    assert any(r.tokens and r.tokens[0] for r in replies[:-1])  # the view streams too
    assert not _replies(service, sampling_params(0.0, 1.0, -1, 4, -1))[-1].tokens  # box off


def test_engine_chat_gives_every_one_of_n_replies_its_tokens(service):
    params = SamplingParams(n=2, max_tokens=5, temperature=0.9, seed=3, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)  # fmt: skip
    last = _replies(service, params)[-1]
    assert [len(t) for t in last.tokens] == [5, 5]
    assert "".join(t.text for t in last.tokens[1]) == last.alternatives[0]
    assert all(isinstance(t, TokenProb) for t in last.tokens[1])
