"""The Engine tab's draft-acceptance chart (issue 15): per draft position, the share of drafts
the target accepted, from the engine's own counters; drawn only for an engine that drafts."""

from __future__ import annotations

import dataclasses

import pytest

from engine import EngineConfig, SamplingParams
from engine.serving.service import EngineService
from engine.telemetry.stats import EngineStats
from playground.figures.engine import ACCEPTANCE_EMPTY_HINT, acceptance_figure
from playground.handlers.live import live_view

pytestmark = [
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting'"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]


def _stats(**counters) -> EngineStats:
    fields = {f.name: f for f in dataclasses.fields(EngineStats)}
    needed = {name: 0 for name, f in fields.items() if f.default is dataclasses.MISSING
              and f.default_factory is dataclasses.MISSING}  # fmt: skip
    return EngineStats(**{**needed, **counters})


def test_acceptance_bars_are_the_per_position_counters():
    stats = _stats(num_spec_proposals_total=10, num_draft_tokens_total=24,
                   num_accepted_tokens_total=14, num_draft_tokens_by_position=(10, 8, 6),
                   num_accepted_tokens_by_position=(8, 4, 2))  # fmt: skip
    fig = acceptance_figure(stats)
    (bars,) = fig.data
    assert list(bars.x) == ["draft 1", "draft 2", "draft 3"]
    assert list(bars.y) == pytest.approx([80.0, 50.0, 100 / 3])
    assert [list(c) for c in bars.customdata] == [[8, 10], [4, 8], [2, 6]]
    assert "2.40 tokens per verify step" in fig.layout.title.text  # 1 + 14 / 10


def test_no_draft_verified_yet_says_so():
    fig = acceptance_figure(_stats())
    assert not fig.data and fig.layout.annotations[0].text == ACCEPTANCE_EMPTY_HINT


def test_live_view_draws_acceptance_only_for_an_engine_that_drafts():
    config = EngineConfig(model="random:tiny", dtype="float32", num_kv_blocks=64,
                          max_model_len=256, speculative_method="ngram")  # fmt: skip
    service = EngineService(config)
    try:
        # A repeating prompt: the n-gram drafter finds its continuation in it.
        prompt = [11, 12, 13, 14, 15, 16] * 6
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        service.submit(prompt, params).result()
        stats = service.stats()
        assert stats.num_spec_proposals_total > 0
        _, view = live_view(service, speculative=True)
        (bars,) = view.acceptance.data
        assert len(bars.x) == len(stats.num_draft_tokens_by_position)
        _, off = live_view(service, speculative=False)
        assert off.acceptance is None
    finally:
        service.shutdown()
