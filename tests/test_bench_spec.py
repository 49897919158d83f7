"""benchmarks.spec: the copy-heavy workload runs with drafts off and on and reports them."""

import json

from benchmarks import spec as bench_spec


def test_bench_spec_reports_drafts_and_tokens_per_step(tmp_path, capsys):
    out = tmp_path / "bench_spec.json"
    argv = ["--model", "random:tiny", "--dtype", "float32", "--output-len", "6",
            "--json", str(out)]  # fmt: skip
    assert bench_spec.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    off, on = report["runs"]
    assert off["draft_tokens"] == 0 and off["tokens_per_decode_step"] == 1.0
    assert off["output_tokens"] == on["output_tokens"] == 6 * len(bench_spec.PROMPTS)
    assert on["draft_tokens"] > 0 and on["accepted_tokens"] <= on["draft_tokens"]
    # float32: verified drafts give one-token decoding's greedy tokens.
    assert report["requests_with_same_tokens"] == len(bench_spec.PROMPTS)
