"""benchmarks.sampling on a small vocabulary: both samplers timed per case, the logits' shape
reported."""

from __future__ import annotations

import json

from benchmarks import sampling


def test_tiny_run_times_both_samplers(tmp_path):
    out = tmp_path / "sampling.json"
    report = sampling.main(["--rows", "1", "3", "--vocab", "600", "--repeats", "1",
                            "--json", str(out)])  # fmt: skip
    assert report == json.loads(out.read_text())
    assert set(report["per_case"]) == {f"{r} rows, {m}" for r in (1, 3) for m in sampling.MODES}
    for case in report["per_case"].values():
        assert case["engine_min_ms"] > 0 and case["plain_torch_min_ms"] > 0
    shape = report["logits_at_temperature_0.7"]["3 rows"]
    assert 0 < shape["top1_mean"] <= shape["top_candidates_mass_mean"] <= 1
