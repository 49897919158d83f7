"""min_tokens (vLLM's): no stop token or stop string ends a request before it has that many
tokens, and the stop tokens are masked out of what it samples until then; with speculative
decoding too."""

from __future__ import annotations

import pytest
import torch
from test_output import CharTokenizer, ids

from engine import LLM, SamplingParams
from engine.core import spec_decode
from engine.core.block_manager import BlockManager
from engine.core.output import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.request import Request
from engine.runner import model_runner
from engine.runner.sampler import sample

PROMPT = [101, 2021, 7, 99, 4000, 31]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_tokens": -1}, r"^min_tokens: must be an integer >= 0"),
        ({"min_tokens": True}, r"^min_tokens: must be an integer >= 0"),
        ({"min_tokens": 9, "max_tokens": 8}, r"^min_tokens: 9 exceeds max_tokens=8"),
    ],
)
def test_bad_min_tokens_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def _stop_heavy_logits(vocab: int = 300, stop: int = 5) -> torch.Tensor:
    """Four rows whose most likely token by far is `stop` (~99.99 % of the mass)."""
    logits = torch.zeros(4, vocab)
    logits[:, stop] = 20.0
    return logits


@pytest.mark.parametrize("fused", [False, True], ids=["torch path", "fused op"])
def test_masked_stop_tokens_are_never_sampled(fused):
    sample_rows = None
    if fused:
        from engine.runner.models.layer_ops import CpuFusedOps
        from kernels import cpu_fused_ops

        if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
            pytest.skip(f"CPU fused ops unavailable: {why}")
        sample_rows = CpuFusedOps().sample_rows
    logits = _stop_heavy_logits()
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    params.append(SamplingParams(temperature=0.0))  # greedy: the argmax skips it too
    for trial in range(20):
        generators = [torch.Generator().manual_seed(trial * 10 + i) for i in range(3)] + [None]
        masked = [[5], [5, 7], [5], [5]]
        tokens = sample(logits, params, generators, sample_rows=sample_rows,
                        masked_token_ids=masked)  # fmt: skip
        assert all(t not in m for t, m in zip(tokens, masked, strict=True))
    # Unmasked, the same rows pick the stop token: the mask is what kept it out.
    tokens = sample(logits, params, [None] * 4, sample_rows=sample_rows)
    assert tokens[3] == 5 and tokens.count(5) >= 3
    assert float(logits[0, 5]) == 20.0  # the caller's logits are not modified


def test_stop_tokens_wait_for_min_tokens_end_to_end(tiny_llm):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = tiny_llm.generate([PROMPT], greedy)[0].token_ids[0]
    stopped = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[first])  # fmt: skip
    assert tiny_llm.generate([PROMPT], stopped)[0].token_ids == [first]
    held = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                          stop_token_ids=[first], min_tokens=4)  # fmt: skip
    out = tiny_llm.generate([PROMPT], held)[0]
    assert len(out.token_ids) >= 5 and first not in out.token_ids[:4]
    # After min_tokens the stop token ends it again, when it comes.
    if len(out.token_ids) < 12:
        assert out.token_ids[-1] == first and out.finish_reason == "stop"
    # min_tokens = max_tokens: exactly max_tokens, none of them the stop token.
    full = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first], min_tokens=6)
    out = tiny_llm.generate([PROMPT], full)[0]
    assert len(out.token_ids) == 6 and first not in out.token_ids


def test_eos_waits_for_min_tokens_unless_ignored():
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=32, max_model_len=128)
    first = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0,
                                                  ignore_eos=True))[0].token_ids[0]  # fmt: skip
    llm.engine.eos_token_ids = (first,)  # make the greedy first token the model's EOS
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    assert llm.generate([PROMPT], plain)[0].token_ids == [first]
    held = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3)
    out = llm.generate([PROMPT], held)[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:3]
    # ignore_eos: EOS is no stop, so min_tokens masks nothing and the argmax stays first.
    ignored = SamplingParams(max_tokens=3, temperature=0.0, min_tokens=3, ignore_eos=True)
    assert llm.generate([PROMPT], ignored)[0].token_ids[0] == first


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_verification_rejects_masked_drafts(temperature):
    """Drafts of the stop token, which the target favours at every position: below min_tokens
    (the masked rows) they are rejected and the token drawn instead is another."""
    logits = _stop_heavy_logits()  # 4 rows: 3 drafts plus one
    params = SamplingParams(temperature=temperature, seed=1)
    generator = None if temperature == 0.0 else torch.Generator().manual_seed(1)
    out = spec_decode.verify(logits, [5, 5, 5], params, generator,
                             masked_token_ids=[[5], [5], [], []])  # fmt: skip
    assert len(out) == 1 and out[0] != 5
    # Where min_tokens is already met (no row masked), the same drafts are accepted.
    out = spec_decode.verify(logits, [5, 5, 5], SamplingParams(temperature=0.0), None,
                             masked_token_ids=[[], [], [], []])  # fmt: skip
    assert out == [5, 5, 5, 5]


def test_speculative_decoding_passes_each_rows_mask(monkeypatch):
    """The runner gives verification one mask per row: the stop tokens for the rows whose token
    still falls below min_tokens, none after. Every step here drafts the stop token (the n-gram
    lookup replaced by one that always proposes it); greedy tokens equal one-token decoding's
    with the same mask."""
    kwargs = {"model": "random:tiny", "dtype": "float32", "num_kv_blocks": 64,
              "max_model_len": 128}  # fmt: skip
    plain = LLM(**kwargs)
    probe = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    stop = plain.generate([PROMPT], probe)[0].token_ids[0]
    monkeypatch.setattr(spec_decode, "propose_ngram", lambda ids, k, lo, hi: [stop] * k)
    masks = []
    real_verify = model_runner.verify

    def verify(logits, draft, params, generator, history, draft_probs, masked):
        masks.append([list(m) for m in masked])
        return real_verify(logits, draft, params, generator, history, draft_probs, masked)

    monkeypatch.setattr(model_runner, "verify", verify)
    spec = LLM(**kwargs, speculative_method="ngram", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                            stop_token_ids=[stop], min_tokens=3)  # fmt: skip
    want = plain.generate([PROMPT], params)[0].token_ids
    got = spec.generate([PROMPT], params)[0].token_ids
    assert got == want and stop not in want[:3]
    # The first verification runs with 1 token out: rows for tokens 2 and 3 masked, 4 and 5 not.
    assert masks[0] == [[stop], [stop], [], []]
    for step in masks:  # each: the rows still below min_tokens, then unmasked ones
        below = sum(1 for m in step if m)
        assert step == [[stop]] * below + [[]] * (len(step) - below)
    assert not any(masks[-1])  # by the last step, min_tokens is met


def test_stop_strings_wait_for_min_tokens():
    """'ab' completes at the 2nd token, below min_tokens=3: the request goes on; the next 'ab'
    (tokens 4-5) ends it."""
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    processor = OutputProcessor(CharTokenizer(), sched)
    params = SamplingParams(max_tokens=10, stop="ab", min_tokens=3, ignore_eos=True)
    request = Request("r", ids("xy"), params, arrival_time=0.0, max_total_tokens=64)
    processor.start(request)
    sched.add_request(request)
    deltas = []
    for token in ids("abcabd"):
        out = sched.schedule()
        deltas += processor.process(sched.update(out, {"r": [token]}, now=1.0))
        if request.finished:
            break
    assert request.finished and deltas[-1].finish_reason == "stop"
    assert request.output_token_ids == ids("abcab") and deltas[-1].text == "abc"
