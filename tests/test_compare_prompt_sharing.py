"""Compare's "n=4 with vs without prompt sharing" preset, run as the tab runs it (its form ->
WorkloadSpec, both side configs, BackgroundCompare, the rows) on a tiny random engine: side A
(sharing) holds fewer peak KV blocks and computes fewer prompt tokens than side B, with the
same tokens."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.runner.model_loader import load_tokenizer, resolve_model
from engine.serving.service import EngineService
from playground.handlers.compare import HEADLINE_MARK, BackgroundCompare, compare_rows
from playground.handlers.compare_engine import (
    N_SHARING_PRESET,
    PRESET_DEFAULTS,
    engine_sides,
    preset_form,
    side_config,
    side_label,
)
from playground.handlers.loadtest import spec_from_form
from playground.loadgen import build_requests

BASE = EngineConfig(model="random:tiny", dtype="float32")
HEAD_DIM = resolve_model(BASE.model).arch.head_dim  # the int8 scales' share of the budget


def test_the_preset_holds_fewer_peak_blocks_with_prompt_sharing():
    form = preset_form(N_SHARING_PRESET)
    a_side, b_side = form["A"], form["B"]
    assert a_side["enable_prompt_sharing"] and not b_side["enable_prompt_sharing"]
    workload = form["workload"]
    assert workload["n"] == 4
    spec = spec_from_form(workload, form["max_model_len"])
    sides = [
        (name, side_label(name, side, other),
         side_config(BASE, side, form["kv_budget"], form["max_model_len"], head_dim=HEAD_DIM))
        for name, side, other in (("A", a_side, b_side), ("B", b_side, a_side))
    ]  # fmt: skip
    assert sides[1][1] == "B: enable_prompt_sharing=False"
    requests = build_requests(spec, load_tokenizer(resolve_model(BASE.model)))
    cmp = BackgroundCompare(spec, engine_sides(sides, EngineService), requests, 1).start()
    assert cmp.done.wait(300)
    a, b = cmp.outcomes
    assert a.error is None and b.error is None, cmp.problems()
    headline = PRESET_DEFAULTS[N_SHARING_PRESET].headline
    rows = compare_rows(a, b, headline=headline)
    assert rows[0][0] == HEADLINE_MARK + "Peak KV blocks held"
    peak_a, peak_b = int(rows[0][1]), int(rows[0][2])
    assert peak_a < peak_b and rows[0][4] == "A"
    table = {r[0]: r for r in rows}
    num_prompts, n, prompt_len = spec.num_prompts, spec.n, workload["input_mean"]
    assert table["Successful requests"][1:3] == [str(num_prompts)] * 2
    # Shared: each prompt but its last token once, then the last token per sample.
    prompt_tokens = table["Prompt tokens computed (prefill)"]
    assert int(prompt_tokens[1]) == num_prompts * (prompt_len - 1 + n)
    assert int(prompt_tokens[2]) == num_prompts * n * prompt_len
    assert table["Preemptions"][1:3] == ["0", "0"]
    assert table["Output tokens same as A (%, greedy runs)"][2] == "100.00"
    assert a.steps and max(s.num_block_copies for s in a.steps) > 0  # copy-on-write ran
    assert sum(s.num_block_copies for s in b.steps) == 0
