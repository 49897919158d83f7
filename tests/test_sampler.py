"""Sampling functions in isolation, including statistical checks."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from engine.runner.sampler import apply_repetition_penalty, greedy_tokens, logits_to_probs, sample


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
    out = apply_repetition_penalty(logits, [[0, 1]], [2.0])
    assert out.tolist() == [[1.0, -4.0, 1.0]]


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
