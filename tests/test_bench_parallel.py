"""benchmarks.parallel: n samples as one request share the prompt's blocks and compute it
once; as n requests each computes it; the tokens are the same."""

import json

from benchmarks import parallel as bench_parallel


def test_bench_parallel_reports_sharing(tmp_path, capsys):
    out = tmp_path / "bench_parallel.json"
    argv = ["--model", "random:tiny", "--dtype", "float32", "--n", "3", "--prompt-len", "37",
            "--output-len", "4", "--block-size", "8", "--num-kv-blocks", "64",
            "--json", str(out)]  # fmt: skip
    assert bench_parallel.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    separate, shared = report["runs"]
    assert report["same_tokens"] is True
    assert separate["prompt_tokens_computed"] == 3 * 37 and separate["block_copies"] == 0
    # Sequence 0 computes 36 tokens; each of the 3 computes the last prompt token itself.
    assert shared["prompt_tokens_computed"] == 36 + 3
    # 36 tokens: 4 full blocks + 1 partly filled (4 of 8): the first 2 writers copy it.
    assert shared["block_copies"] == 2
    assert shared["peak_kv_blocks"] < separate["peak_kv_blocks"]
