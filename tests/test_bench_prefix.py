"""benchmarks.prefix: the shared-prefix benchmark runs end to end and reports what it measured."""

import json

from benchmarks import prefix as bench_prefix


def test_bench_prefix_reports_cached_prompt_tokens_and_same_tokens(tmp_path, capsys):
    out = tmp_path / "bench_prefix.json"
    argv = ["--model", "random:tiny", "--dtype", "float32", "--num-requests", "3",
            "--prefix-len", "40", "--suffix-len", "4", "8", "--output-len", "3",
            "--block-size", "8", "--json", str(out)]  # fmt: skip
    assert bench_prefix.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    off, on = report["runs"]
    assert report["same_tokens"] is True
    assert off["prefix_caching"] is False and off["prompt_tokens_cached"] == 0
    assert off["prompt_tokens_computed"] == off["prompt_tokens"]
    # Requests 2 and 3 find the 40-token prefix's 5 full blocks (8 tokens each).
    assert on["prompt_tokens_cached"] == 2 * 40
    assert on["prompt_tokens_computed"] == on["prompt_tokens"] - 80
    assert report["prompt_tokens_computed_ratio_on_vs_off"] < 1
