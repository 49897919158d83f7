"""benchmarks.aims: each aim read from its benchmark's JSON and judged against its bound, a
missing field said rather than guessed, and a run end to end (one tiny benchmark in its own
process). The field paths are also checked against the real benchmarks' reports in their own
tests (test_bench_batch1, _throughput, _cpu_attention, _quant, _perplexity)."""

from __future__ import annotations

import json

import pytest

from benchmarks import aims
from kernels.cpu_attention import cpu_kernel_status


def verdicts_by_aim(reports: dict[str, dict]) -> dict[str, dict]:
    return {v["aim"]: v for v in aims.judge(aims.AIMS, reports)}


def test_each_aim_is_judged_against_its_bound():
    def run(fmt: str, batch1: float, batch64: float) -> dict:
        by_round = {"batch1_tpot_ms": [batch1, 0.5], "batch64_decode_tokens_per_s": [batch64, 1.1]}
        return {"quantization": fmt, "batch1_tpot_vs_none": batch1,
                "batch64_decode_vs_none": batch64, "rounds_vs_none": by_round}  # fmt: skip

    quant_runs = [run("none", 1.0, 1.0), run("int8", 0.55, 0.99), run("int4", 0.35, 1.02)]
    ppl = [{"quantization": q, "perplexity": p} for q, p in
           (("none", 25.0), ("int8", 25.2), ("int4", 32.0), ("awq", 32.0))]  # fmt: skip
    verdicts = verdicts_by_aim({"quant": {"runs": quant_runs}, "perplexity": {"runs": ppl}})
    assert verdicts["int8 batch-1 TPOT over bf16's"]["met"] is True  # 0.55 <= 0.6
    assert verdicts["int4 batch-1 TPOT over bf16's"]["met"] is True
    assert verdicts["int8 batch-64 decode throughput over bf16's"]["met"] is False  # < 1.0
    assert verdicts["int4 batch-64 decode throughput over bf16's"]["value"] == 1.02
    # Each round's ratio is shown beside the verdict (the noise), not judged.
    assert verdicts["int4 batch-64 decode throughput over bf16's"]["rounds"] == [1.02, 1.1]
    assert verdicts["int8 batch-1 TPOT over bf16's"]["rounds"] == [0.55, 0.5]
    assert verdicts["int8 perplexity over bf16's"] == {
        "issue": 13, "aim": "int8 perplexity over bf16's", "benchmark": "perplexity",
        "field": "runs[int8].perplexity / runs[none].perplexity", "bound": "<= 1.01",
        "value": 1.008, "met": True,
    }  # fmt: skip
    # "Better than round-to-nearest" is strict: a tie does not meet it.
    assert verdicts["awq perplexity over int4 round-to-nearest's (same group size)"]["met"] is False
    # awq not in the quant run: said, not guessed; benchmarks that did not run: no verdicts.
    awq = verdicts["awq batch-1 TPOT over bf16's"]
    assert awq["value"] is None and awq["met"] is None and "not in the report" in awq["why"]
    assert {v["benchmark"] for v in verdicts.values()} == {"quant", "perplexity"}


def test_unknown_benchmarks_are_refused(capsys):
    with pytest.raises(SystemExit):
        aims.main(["--only", "batch1,nope"])
    assert "unknown nope" in capsys.readouterr().err


def test_a_run_end_to_end_and_judged_again_from_its_reports(tmp_path, capsys, monkeypatch):
    if (why := cpu_kernel_status()) is not None:
        pytest.skip(f"CPU kernel unavailable: {why}")
    tiny = ["benchmarks.cpu_attention", "--batch", "4", "--context", "40", "--spread", "8",
            "--layers", "2", "--repeats", "1", "--decoded", "8"]  # fmt: skip
    monkeypatch.setitem(aims.BENCHMARKS, "attention", tiny)
    report = aims.main(["--only", "attention", "--out", str(tmp_path)])
    assert report == json.loads(capsys.readouterr().out)
    assert report == json.loads((tmp_path / "aims.json").read_text())
    assert report["machine_before"]["cpu"] and report["machine_after"]["torch_threads"] >= 1
    (verdict,) = report["aims"]
    attention = json.loads((tmp_path / "attention.json").read_text())
    assert verdict["value"] == round(attention["cpu_kernel_over_floor"], 3)
    assert verdict["met"] is (attention["cpu_kernel_over_floor"] <= 1.5)
    assert report["met"] + len(report["missed"]) == 1
    again = aims.main(["--from", str(tmp_path)])  # the other benchmarks' files are absent
    assert again["aims"] == report["aims"] and again["reports"] == str(tmp_path)


def test_a_failing_benchmark_is_reported_and_the_others_still_judged(tmp_path, monkeypatch):
    if (why := cpu_kernel_status()) is not None:
        pytest.skip(f"CPU kernel unavailable: {why}")
    tiny = ["benchmarks.cpu_attention", "--batch", "2", "--context", "20", "--spread", "4",
            "--layers", "1", "--repeats", "1", "--decoded", "4"]  # fmt: skip
    monkeypatch.setitem(aims.BENCHMARKS, "attention", tiny)
    monkeypatch.setitem(aims.BENCHMARKS, "batch1", ["benchmarks.batch1", "--model", "nope:x"])
    report = aims.main(["--only", "batch1,attention", "--out", str(tmp_path)])
    assert "batch1" in report["failed"] and "exited" in report["failed"]["batch1"]
    assert [v["benchmark"] for v in report["aims"]] == ["attention"]


def test_several_finished_runs_say_in_how_many_each_aim_was_met(tmp_path, capsys):
    """An aim on its bound crosses it from run to run on a shared host: --from with several
    runs lists each aim's values and in how many of the runs that measured it it was met."""

    def write(folder: str, attention: float, chat: float | None) -> str:
        run = tmp_path / folder
        run.mkdir()
        (run / "attention.json").write_text(json.dumps({"cpu_kernel_over_floor": attention}))
        if chat is not None:
            report = {"results": {"continuous": {"roofline": {"fraction_of_bound": chat}}},
                      "ratios": {"continuous_vs_hf_continuous": 12.0}}  # fmt: skip
            (run / "chat.json").write_text(json.dumps(report))
        return str(run)

    runs = [write("a", 1.43, 0.64), write("b", 1.72, None), write("c", 1.45, 0.55)]
    report = aims.main(["--from", *runs])
    assert report == json.loads(capsys.readouterr().out)
    rows = {r["aim"]: r for r in report["across_runs"]}
    attention = rows["batch-64 decode attention over its KV-read floor (blocks anywhere)"]
    assert attention["values"] == [1.43, 1.72, 1.45] and attention["met_in"] == "2 of 3"
    chat = rows["chat workload, fraction of its roofline bound"]
    assert chat["values"] == [0.64, 0.55] and chat["met_in"] == "1 of 2"  # b ran no chat
    assert rows["chat workload, ours over Hugging Face continuous batching"]["met_in"] == "2 of 2"
    assert report["met_in_every_run"] == 1 and report["reports"] == runs
