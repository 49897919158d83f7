"""benchmarks.kv_quant: 16-bit vs int8 KV at one budget runs end to end and reports it."""

import json

from benchmarks import kv_quant as bench_kvq
from engine.cli import config_from_args


def test_bench_kvq_reports_more_tokens_held_and_agreement(tmp_path, capsys):
    out = tmp_path / "bench_kvq.json"
    # random:tiny's head_dim is 16: int8 costs 1 + 2/16 bytes per value, 1.78x the tokens.
    argv = ["--model", "random:tiny", "--dtype", "float32", "--num-requests", "3",
            "--prompt-len", "40", "--output-len", "3", "--block-size", "8",
            "--kv-budget-bytes", str(60 * 8 * 2 * 2 * 2 * 16 * 4), "--json", str(out)]  # fmt: skip
    assert bench_kvq.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    auto, int8 = report["runs"]
    assert (auto["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("auto", "int8")
    assert auto["num_kv_blocks"] == 60  # float32: 4 bytes per value
    assert int8["tokens_held"] >= 3.5 * auto["tokens_held"]  # 4 / 1.125 = 3.56x
    assert auto["greedy_agreement"] == 1.0  # the reference agrees with itself
    assert 0.0 <= int8["greedy_agreement"] <= 1.0
    assert report["vs_first"]["int8"]["tokens_held_ratio"] >= 3.5
    for run in (auto, int8):
        assert 0 < run["peak_blocks_used"] <= run["num_kv_blocks"]
        assert run["max_running_requests"] >= 1 and run["output_tokens_per_s"] > 0


def test_calculated_fp8_scales_apply_to_the_fp8_run_only():
    """EngineConfig refuses calculate_kv_scales outside fp8, so the benchmark gives the scale
    flags to its fp8 run and resets them for the others."""
    args = bench_kvq.build_parser().parse_args(
        ["--calculate-kv-scales", "--kv-scale-granularity", "head"]
    )
    base = config_from_args(args, kv_cache_dtype="fp8")
    auto, int8, fp8 = (bench_kvq.run_config(base, kv) for kv in ("auto", "int8", "fp8"))
    assert (auto.calculate_kv_scales, int8.calculate_kv_scales) == (False, False)
    assert (auto.kv_scale_granularity, int8.kv_scale_granularity) == ("tensor", "tensor")
    assert (fp8.kv_cache_dtype, fp8.calculate_kv_scales, fp8.kv_scale_granularity) == (
        "fp8",
        True,
        "head",
    )
