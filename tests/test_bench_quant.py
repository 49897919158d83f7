"""benchmarks.quant and benchmarks.quant_crossover: the JSON they print has every number the
README table takes, for every format (tiny random model: mechanics, not speed)."""

import json

import pytest

from benchmarks import aims, quant_crossover
from benchmarks import quant as bench_quant


@pytest.mark.slow  # three engines, ~20 s on 2 cores
def test_bench_quant_reports_each_format_against_none(tmp_path, capsys):
    out = tmp_path / "bench_quant.json"
    argv = ["--model", "random:tiny", "--dtype", "float32", "--output-len", "4",
            "--prompt-len", "4", "--quantization-group-size", "32", "--json", str(out),
            "--formats", "none,int8,int4", "--rounds", "2"]  # fmt: skip
    assert bench_quant.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    runs = {r["quantization"]: r for r in report["runs"]}
    assert list(runs) == ["none", "int8", "int4"]
    assert runs["none"]["greedy_token_agreement"] == 1.0
    assert runs["int4"]["group_size"] == 32 and runs["int8"]["group_size"] is None
    # The cost model reads fewer bytes per step as the weights shrink.
    read = [runs[f]["bytes_read_per_step"] for f in ("none", "int8", "int4")]
    assert read[0] > read[1] > read[2]
    for run in runs.values():
        assert run["batch1_tpot_ms"] > 0 and run["batch64_decode_tokens_per_s"] > 0
        assert run["batch64_decode_steps"] > 0 and 0.0 <= run["greedy_token_agreement"] <= 1.0
        assert [len(v) for v in run["rounds"].values()] == [2, 2]  # the formats took turns
    by_round = runs["int4"]["rounds_vs_none"]["batch64_decode_tokens_per_s"]
    assert len(by_round) == 2 and runs["none"]["rounds_vs_none"]["batch1_tpot_ms"] == [1.0, 1.0]
    judged = {v["aim"]: v["value"] for v in aims.judge(aims.AIMS, {"quant": report})}
    assert judged["int4 batch-1 TPOT over bf16's"] == runs["int4"]["batch1_tpot_vs_none"]
    int8_batch64 = runs["int8"]["batch64_decode_vs_none"]
    assert judged["int8 batch-64 decode throughput over bf16's"] == int8_batch64
    assert judged["awq batch-1 TPOT over bf16's"] is None  # not run here


def test_too_few_tokens_to_time_is_an_error_not_a_crash(capsys):
    argv = ["--model", "random:tiny", "--dtype", "float32", "--output-len", "1",
            "--formats", "none", "--rounds", "1"]  # fmt: skip
    assert bench_quant.main(argv) == 2
    assert "--output-len 1: no warm decode step" in capsys.readouterr().err


def test_formats_are_checked(capsys):
    assert bench_quant.main(["--model", "random:tiny", "--formats", "none,int3"]) == 2
    assert "--formats" in capsys.readouterr().err
    assert bench_quant.main(["--model", "random:tiny"]) == 2  # awq by default: needs weights
    assert "awq needs real weights" in capsys.readouterr().err


def test_crossover_reports_every_path_and_the_rule(capsys):
    quant_crossover.main(["--preset", "tiny", "--rows", "1", "8", "--repeats", "1"])
    report = json.loads(capsys.readouterr().out)
    assert [r["rows"] for r in report["results"]] == [1, 8]
    keys = {f"{g}_{p}_us" for g in ("layer", "lm_head")
            for p in ("bf16", "int8_kernel", "int8_dequant", "int4_kernel", "int4_dequant")}  # fmt: skip
    assert keys <= set(report["results"][0])
    rows = [{"rows": m, "layer_int8_dequant_us": d, "layer_int8_kernel_us": k}
            for m, d, k in ((1, 5, 1), (64, 1, 2), (96, 3, 2), (128, 1, 2))]  # fmt: skip
    assert quant_crossover.crossover_rows(rows, "int8") == 128  # a lone win at 64 does not count


def test_the_formats_engines_take_their_steps_in_turn():
    """A shared host's drift within seconds must land on every format alike: the engines take
    turns of a few steps, each running its own requests to the end, and a turn's first step
    (its caches cold from the other engine's weights) is not among the warm ones timed."""
    from engine.llm import LLM
    from engine.request import SamplingParams

    engines = [LLM("random:tiny", dtype="float32", max_num_seqs=4) for _ in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[[5, 6, 7]] * 2, [[8, 9, 10, 11]] * 3]
    turns = bench_quant.steps_in_turn(engines, prompts, params, steps_per_turn=2)
    assert [sum(s.num_decode_tokens for s in t.steps) for t in turns] == [2 * 5, 3 * 5]
    assert [len(t.steps) for t in turns] == [6, 6]  # a prompt step, then 5 decode steps
    order = [e for _, e in sorted((s.start_time, e) for e, t in enumerate(turns) for s in t.steps)]
    assert order == [0, 0, 1, 1] * 3
    for t in turns:
        assert [s.step_index for s in t.warm] == [s.step_index for s in t.steps[1::2]]
    assert not any(llm.engine.has_unfinished() for llm in engines)
