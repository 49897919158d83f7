"""Sampling functions in isolation, including statistical checks."""

from __future__ import annotations

import pytest
import torch

from benchmarks.sampling import reference_probs
from engine.request import SamplingParams
from engine.runner import sampler
from engine.runner.sampler import (
    NO_HISTORY,
    TokenHistory,
    apply_penalties,
    greedy_tokens,
    logits_to_probs,
    sample,
)


def probs_for(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    return logits_to_probs(
        torch.tensor([logits]),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )[0]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    assert sample(logits, params, [None, None]) == [1, 0]


def test_top_k_keeps_k_tokens():
    p = probs_for([1.0, 2.0, 3.0, 4.0], top_k=2)
    assert (p[:2] == 0).all() and p[2:].sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probs_for(logits.tolist(), top_p=0.7)  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert p[2:].sum().item() == 0
    assert p[0].item() == pytest.approx(0.5 / 0.8)


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    p = probs_for(logits.tolist(), min_p=0.2)  # threshold 0.12
    assert p[2].item() == 0 and p[:2].sum().item() == pytest.approx(1.0)


def test_temperature_sharpens():
    flat = probs_for([1.0, 2.0], temperature=2.0)
    sharp = probs_for([1.0, 2.0], temperature=0.5)
    assert sharp[1] > flat[1]


def test_repetition_penalty_signs():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_penalties(
        logits, [SamplingParams(repetition_penalty=2.0)], [TokenHistory([0, 1], 2)]
    )
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_logit_bias_then_frequency_and_presence_on_the_output_only():
    """OpenAI's definitions: logit - frequency x count - presence x (count > 0), counted over
    the output so far (token 3 is only in the prompt); the bias is added first."""
    logits = torch.zeros(2, 6)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, logit_bias={"4": 2.0}),
        SamplingParams(),  # untouched
    ]
    history = TokenHistory([3, 3, 1, 2, 1, 1], output_start=2)  # output: 1, 2, 1, 1
    out = apply_penalties(logits, params, [history, NO_HISTORY])
    assert out[0].tolist() == [0.0, -2.5, -1.5, 0.0, 2.0, 0.0]  # 1: 3 x 0.5 + 1; 2: 0.5 + 1
    assert out[1].tolist() == [0.0] * 6
    assert apply_penalties(logits, [SamplingParams()] * 2) is logits  # nothing to do: no copy
    presence = apply_penalties(logits[:1], [SamplingParams(presence_penalty=1.0)], [history])
    assert presence[0].tolist() == [0.0, -1.0, -1.0, 0.0, 0.0, 0.0]  # once, whatever the count
    negative = SamplingParams(frequency_penalty=-1.0)  # encourages repeats
    assert apply_penalties(logits[:1], [negative], [history])[0, 1] == 3.0


def test_logit_bias_forces_and_bans_in_sampling():
    logits = torch.tensor([[5.0, 0.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias={2: 100})], [None]) == [2]
    banned = SamplingParams(temperature=1.0, logit_bias={0: -100}, seed=0)
    gen = torch.Generator().manual_seed(0)
    assert all(sample(logits, [banned], [gen])[0] != 0 for _ in range(50))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias: keys must be token ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias: keys must be token ids"),
        ({"logit_bias": {5: 100.5}}, "logit_bias: token 5's bias"),
        ({"logit_bias": {5: True}}, "logit_bias: token 5's bias"),
        ({"logit_bias": [1, 2]}, "logit_bias: must map token ids to biases"),
    ],
)
def test_penalty_and_bias_fields_are_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)
    assert SamplingParams(logit_bias={"7": -1, 3: 2.5}).logit_bias == ((3, 2.5), (7, -1.0))


def test_seeded_draw_ignores_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=1.0, seed=123)

    def draw(batch_logits, row):
        gens = [torch.Generator().manual_seed(123) for _ in range(batch_logits.shape[0])]
        return sample(batch_logits, [params] * batch_logits.shape[0], gens)[row]

    alone = draw(logits[2:3], 0)
    in_batch = draw(logits, 2)
    assert alone == in_batch


def test_sampling_frequencies_match_probabilities():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0)]
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, params, [gen])[0]] += 1
    freqs = counts / counts.sum()
    assert torch.allclose(freqs, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_greedy_tokens_are_argmax_with_its_tie_and_nan_rules():
    """greedy_tokens goes through max(dim) for speed: the same first index on ties (a flat row,
    two equal maxima, two infinities) and NaN counted as the max, as torch.argmax."""
    x = torch.zeros(5, 49152)
    x[0, 5] = x[0, 40000] = 1.0
    x[1, 7] = x[1, 9] = float("nan")
    x[3, 100] = x[3, 200] = float("inf")
    x[4] = torch.randint(0, 3, (49152,)).float()
    assert greedy_tokens(x) == x.argmax(dim=-1).tolist() == [5, 7, 0, 100, x[4].argmax().item()]


@pytest.mark.parametrize("spread", [2.0, 0.05], ids=["peaked", "flat: past the candidates"])
def test_top_k_top_p_from_candidates_match_a_full_sort(spread):
    """logits_to_probs ranks from the top TOP_CANDIDATES (topk) and sorts a whole row only
    when its top-p prefix reaches past them: the same distribution as sorting every row, with
    rows that filter, rows that do not, and per-row top-k / top-p / min-p in one batch."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 7, 5000
    logits = torch.randn(rows, vocab, generator=gen) * spread
    logits[:, :5] += 6 * spread  # a few likely tokens, as a language model has
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 0.9])
    top_k = torch.tensor([-1, 40, -1, 300, -1, 1000, 7])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.95, 0.5, 1.0, 0.99])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0])
    args = (logits, temperature, top_k, top_p, min_p)
    assert torch.allclose(logits_to_probs(*args), reference_probs(*args), rtol=1e-5, atol=1e-8)
    only_k = (logits[:2], temperature[:2], torch.tensor([5, 40]), torch.ones(2), torch.zeros(2))
    assert torch.allclose(logits_to_probs(*only_k), reference_probs(*only_k), atol=1e-8)


def test_draws_never_land_on_a_token_without_mass(monkeypatch):
    """Inverse transform sampling at the ends of [0, 1): u = 0 takes the first token with
    mass, u just below 1 the last one, never the zero-mass tokens around them or the padding
    past the vocabulary (1,000 tokens: two blocks of DRAW_BLOCK, the second part padding)."""
    probs = torch.zeros(2, 1000)
    probs[:, 3] = 0.25
    probs[:, 517] = 0.5
    probs[:, 998] = 0.25
    for u, expected in [(0.0, 3), (1.0 - 2.0**-53, 998), (0.3, 517), (0.8, 998)]:
        monkeypatch.setattr(sampler, "uniform", lambda generator, u=u: u)
        assert sampler.draw_tokens(probs, [None, None]) == [expected, expected]


def test_draw_frequencies_match_probabilities_across_blocks():
    """A token in each of three DRAW_BLOCK blocks and one with 2 % of the mass: drawn as often
    as its probability says (3 sigma)."""
    probs = torch.zeros(1, 2000)
    probs[0, [10, 700, 1500, 1999]] = torch.tensor([0.5, 0.3, 0.18, 0.02])
    gen = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.zeros(2000)
    for _ in range(n):
        counts[sampler.draw_token(probs[0], gen)] += 1
    expected = probs[0] * n
    sigma = (expected * (1 - probs[0])).sqrt()
    assert counts.sum() == counts[[10, 700, 1500, 1999]].sum()
    assert ((counts - expected).abs() <= 3 * sigma + 1).all()
