"""The fused sampling op (kernels/cpu_sample_rows.h, `CpuFusedOps.sample_rows`) against the
torch path's distribution (benchmarks.sampling.reference_probs: softmax, a full sort, top-k,
top-p, min-p): for a grid of uniforms, the token the op draws is the reference's inverse CDF
at that uniform (up to a uniform within 2e-6 of a boundary between two tokens); bad rows raise
naming the row; and the engine's sampled steps go through it."""

from __future__ import annotations

import pytest
import torch

from benchmarks.sampling import reference_probs
from engine import LLM, SamplingParams
from engine.runner import sampler
from engine.runner.models.layer_ops import CpuFusedOps
from kernels import cpu_fused_ops

# Per row: temperature, top_k, top_p, min_p. Rows that filter and rows that do not, top-k
# below and above the op's 256 candidates, a top-p reaching far down a flat row.
TEMPERATURE = [1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 0.9, 0.7]
TOP_K = [-1, 40, -1, 300, -1, 1000, 7, -1]
TOP_P = [1.0, 1.0, 0.9, 0.95, 0.5, 1.0, 0.99, 0.95]
MIN_P = [0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.05]
BOUNDARY = 2e-6  # a uniform this close to a step of the reference CDF may pick the neighbour


@pytest.fixture(scope="module")
def fused() -> CpuFusedOps:
    if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
        pytest.skip(f"CPU fused ops unavailable: {why}")
    return CpuFusedOps()


def filters(rows: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(TEMPERATURE[:rows]),
        torch.tensor(TOP_K[:rows]),
        torch.tensor(TOP_P[:rows]),
        torch.tensor(MIN_P[:rows]),
    )


def language_like_logits(spread: float, rows: int = len(TOP_K), vocab: int = 5000):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen) * spread
    logits[:, :5] += 6 * spread  # a few likely tokens, as a language model has
    return logits


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference token for each row's uniform, and whether u is clear of every boundary."""
    cdf = probs.double().cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    token = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1)
    clear = (cdf - u.unsqueeze(1)).abs().min(dim=-1).values > BOUNDARY
    return token, clear


@pytest.mark.parametrize("spread", [2.0, 0.05], ids=["peaked", "flat: past the candidates"])
def test_draws_follow_the_reference_distribution(fused, spread):
    logits = language_like_logits(spread)
    args = filters(logits.shape[0])
    probs = reference_probs(logits, *args)
    near = draws = 0
    for u_value in torch.linspace(0, 1, 1001)[:-1].tolist():
        u = torch.full((logits.shape[0],), u_value, dtype=torch.float64)
        drawn = fused.sample_rows(logits, *args, u)
        expected, clear = inverse_cdf(probs, u)
        assert torch.equal(drawn[clear], expected[clear]), f"u={u_value}"
        assert bool((probs[torch.arange(len(drawn)), drawn] > 0).all())  # never outside the set
        near += int((~clear).sum())
        draws += len(drawn)
    assert near < draws / 10  # most draws are compared (a flat row's boundaries are dense)


def test_16_bit_logits_are_read_as_they_are(fused):
    logits = language_like_logits(2.0).bfloat16()
    args = filters(logits.shape[0])
    u = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected, clear = inverse_cdf(reference_probs(logits.float(), *args), u)
    assert torch.equal(fused.sample_rows(logits, *args, u)[clear], expected[clear])
    half = logits.half()
    expected, clear = inverse_cdf(reference_probs(half.float(), *args), u)
    assert torch.equal(fused.sample_rows(half, *args, u)[clear], expected[clear])


def test_tokens_without_mass_are_never_drawn(fused):
    """-inf logits, min-p's and top-k's dropped tokens, at both ends of [0, 1)."""
    logits = torch.full((3, 1000), float("-inf"))
    logits[:, [3, 517, 998]] = torch.tensor([0.0, 1.0, 0.0])
    logits[2, 600] = -8.0  # under row 2's min-p
    logits[1, 700] = -0.5  # past row 1's top-k of 3
    args = (torch.ones(3), torch.tensor([-1, 3, -1]), torch.ones(3), torch.tensor([0.0, 0.0, 0.01]))
    for u, expected in [(0.0, 3), (1.0 - 2.0**-53, 998)]:
        drawn = fused.sample_rows(logits, *args, torch.full((3,), u, dtype=torch.float64))
        assert drawn.tolist() == [expected] * 3


def test_bad_rows_raise_naming_the_row(fused):
    logits = torch.zeros(3, 64)
    u = torch.zeros(3, dtype=torch.float64)
    args = (torch.ones(3), torch.full((3,), -1), torch.ones(3), torch.zeros(3))
    logits[1, 5] = float("nan")
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        fused.sample_rows(logits, *args, u)
    logits[1, 5] = 0.0
    logits[2] = float("-inf")
    with pytest.raises(ValueError, match="row 2 gives no token"):
        fused.sample_rows(logits, *args, u)
    logits[2] = 0.0
    with pytest.raises(ValueError, match="temperature: row 0"):
        fused.sample_rows(logits, torch.tensor([0.0, 1.0, 1.0]), *args[1:], u)
    with pytest.raises(ValueError, match="uniforms"):
        fused.sample_rows(logits, *args, torch.zeros(3))  # float32, not float64
    with pytest.raises(ValueError, match="top_k"):
        fused.sample_rows(logits, args[0], torch.full((2,), -1), *args[2:], u)


def test_sample_draws_each_generators_uniform_through_the_op(fused):
    """sampler.sample with the op: greedy rows still take the argmax, sampled rows consume one
    uniform of their own generator (the same stream as the torch path) and land where the
    reference distribution puts that uniform."""
    logits = language_like_logits(2.0, rows=4, vocab=3000)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.7, min_p=0.05),
    ]
    seeds = [None, 11, 12, 13]
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    copies = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    tokens = sampler.sample(logits, params, gens, argmax=fused.argmax_rows,
                            sample_rows=fused.sample_rows)  # fmt: skip
    assert tokens[0] == int(logits[0].argmax())
    u = torch.tensor([sampler.uniform(g) for g in copies[1:]], dtype=torch.float64)
    rows = logits[1:]
    args = (
        torch.tensor([p.temperature for p in params[1:]]),
        torch.tensor([p.top_k for p in params[1:]]),
        torch.tensor([p.top_p for p in params[1:]]),
        torch.tensor([p.min_p for p in params[1:]]),
    )
    expected, clear = inverse_cdf(reference_probs(rows, *args), u)
    assert torch.equal(torch.tensor(tokens[1:])[clear], expected[clear])
    # Each sampled row's generator moved by exactly one draw.
    assert all(
        g.get_state().equal(c.get_state()) for g, c in zip(gens[1:], copies[1:], strict=True)
    )


def test_the_engine_samples_through_the_op(fused, monkeypatch):
    calls = []
    real = CpuFusedOps.sample_rows

    def counting(self, logits, *args):
        calls.append(logits.shape[0])
        return real(self, logits, *args)

    monkeypatch.setattr(CpuFusedOps, "sample_rows", counting)
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=48, block_size=8,
              max_model_len=128, fused_ops=True)  # fmt: skip
    assert llm.engine.runner.layer_ops.name == "cpu"
    params = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    first = llm.generate([[1, 2, 3], [4, 5]], params)
    assert calls and max(calls) == 2  # both requests' rows in one call
    assert [len(o.token_ids) for o in first] == [5, 5]
    again = llm.generate([[1, 2, 3], [4, 5]], params)  # seeded: the same tokens
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
