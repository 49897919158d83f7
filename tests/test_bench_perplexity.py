"""benchmarks.perplexity: windows of the local held-out text scored through prompt_logprobs, one
engine per value of the varied field, NLL consistent with the engine's own logprobs."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import aims
from benchmarks import perplexity as bench_ppl
from engine import LLM, SamplingParams
from engine.quality import held_out_text, windows_of

ARGS = ["--model", "random:tiny", "--dtype", "float32", "--context-len", "24",
        "--num-windows", "2"]  # fmt: skip


def test_perplexity_reports_each_value_of_the_varied_field(tmp_path, capsys):
    out = tmp_path / "ppl.json"
    argv = [*ARGS, "--vary", "quantization=none,int8", "--json", str(out)]
    assert bench_ppl.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    none, int8 = report["runs"]
    assert (none["quantization"], int8["quantization"]) == ("none", "int8")
    assert none["tokens_scored"] == int8["tokens_scored"] == 2 * 23
    assert none["perplexity"] == pytest.approx(math.exp(none["nll"]), rel=1e-4)
    assert none["perplexity_change_pct"] == 0.0 and int8["nll"] != none["nll"]
    judged = {v["aim"]: v["value"] for v in aims.judge(aims.AIMS, {"perplexity": report})}
    ratio = int8["perplexity"] / none["perplexity"]
    assert judged["int8 perplexity over bf16's"] == pytest.approx(ratio, abs=1e-3)

    # The NLL is the mean of the engine's prompt logprobs over the same windows.
    from engine.runner.model_loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("random:tiny"))
    ids = tokenizer.encode(held_out_text(), add_special_tokens=False)
    windows = windows_of(ids, 24, 2)
    llm = LLM(model="random:tiny", dtype="float32")
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [lp.logprob for o in outs for lp in o.prompt_logprobs if lp]
    assert none["nll"] == pytest.approx(-sum(logprobs) / len(logprobs), abs=1e-4)


def test_bad_arguments_are_one_error_line(capsys):
    assert bench_ppl.main([*ARGS, "--vary", "nope=1,2"]) == 2
    assert "not an EngineConfig field" in capsys.readouterr().err
    assert bench_ppl.main([*ARGS, "--num-windows", "100000"]) == 2
    assert "num_windows" in capsys.readouterr().err


def test_varying_the_kv_format_keeps_fp8_scale_flags_for_fp8_only():
    from benchmarks.common import bench_parser, vary_configs

    args = bench_parser("doc").parse_args(["--model", "random:tiny", "--calculate-kv-scales"])
    auto, int8, fp8 = vary_configs(args, "kv_cache_dtype", ["auto", "int8", "fp8"])
    assert (auto.kv_cache_dtype, int8.kv_cache_dtype, fp8.kv_cache_dtype) == ("auto", "int8", "fp8")
    assert fp8.calculate_kv_scales and not auto.calculate_kv_scales and not int8.calculate_kv_scales
    (block8,) = vary_configs(bench_parser("doc").parse_args([]), "block_size", ["8"])
    assert block8.block_size == 8
