"""benchmarks.spec: off, n-gram and draft-model runs per batch size, reported as JSON."""

import json

import pytest

from benchmarks import spec as bench_spec


def test_bench_spec_reports_every_method_and_batch_size(tmp_path, capsys):
    out = tmp_path / "bench_spec.json"
    argv = ["--model", "random:tiny", "--dtype", "float32", "--output-len", "6",
            "--workload", "copy", "--methods", "off,ngram,draft,draft-int8",
            "--batch-sizes", "1,3", "--requests-at-batch-1", "2", "--json", str(out)]  # fmt: skip
    assert bench_spec.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    runs = {(r["method"], r["batch_size"]): r for r in report["runs"]}
    assert set(runs) == {(m, b) for m in ("off", "ngram", "draft", "draft-int8") for b in (1, 3)}
    for (method, batch), run in runs.items():
        assert run["output_tokens"] == 6 * (2 if batch == 1 else 3)
        # float32: verified drafts give one-token decoding's greedy tokens.
        assert run["greedy_identical"] and run["requests_with_same_tokens"] == run["num_requests"]
        if method == "off":
            assert run["draft_tokens"] == 0 and run["speedup"] == 1.0
    self_draft = runs[("draft", 1)]  # the target drafting for itself: all accepted
    assert self_draft["acceptance_rate"] == 1.0
    assert self_draft["acceptance_by_position"] == [1.0] * 4
    assert self_draft["mean_accepted_length"] == 5.0
    assert self_draft["draft_time_share"] > 0
    assert runs[("draft-int8", 3)]["draft_tokens"] > 0


def test_bench_spec_rejects_a_run_without_the_baseline():
    with pytest.raises(ValueError, match="methods"):
        bench_spec.main(["--model", "random:tiny", "--methods", "ngram"])
