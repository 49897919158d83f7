"""benchmarks.throughput end to end on a tiny random model: ours (continuous) vs static, every
request's exact length, and the run's roofline bound from the device ceilings."""

import json

import pytest

from benchmarks import aims, common, throughput
from engine.telemetry.ceilings import DeviceCeilings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_bench_throughput_reports_the_roofline_bound(tmp_path, capsys, monkeypatch):
    # Known ceilings (no measuring in a test): every step's bound can be checked by hand.
    toy = DeviceCeilings(name="toy", peak_flops_per_s={"float32": 1e9}, bandwidth_bytes_per_s=1e9,
                         measured=False, source="test")  # fmt: skip
    monkeypatch.setattr(throughput, "get_ceilings", lambda device: toy)
    monkeypatch.setattr(common, "get_ceilings", lambda device, refresh=False: toy)
    monkeypatch.setattr(common, "measure_ceilings", lambda device: toy)  # the end-of-run one
    monkeypatch.setattr(common, "remember_ceilings", lambda ceilings, device: None)
    out = tmp_path / "bench.json"
    argv = ["--model", "random:tiny", "--dtype", "float32", "--num-requests", "6",
            "--prompt-len", "4", "24", "--output-len", "2", "9", "--skip", "hf",
            "--json", str(out)]  # fmt: skip
    report = throughput.main(argv)
    assert report == json.loads(out.read_text()) == json.loads(capsys.readouterr().out)
    cont = report["results"]["continuous"]
    assert cont["output_tokens"] == report["workload"]["output_tokens"]
    roof = cont["roofline"]
    assert roof["device"] == "toy" and roof["num_steps"] > 0
    # 1 GFLOP/s and 1 GB/s: the bound is the sum of max(flops, bytes) / 1e9 over the steps.
    assert roof["bound_s"] > 0 and 0 < roof["decode_bound_s"] <= roof["bound_s"]
    # Both are rounded to 1 ms in the report and this run lasts a few tens of ms: 10 %.
    assert roof["fraction_of_bound"] == pytest.approx(roof["bound_s"] / cont["duration_s"], 0.1)
    assert "roofline" in report["results"]["static"]
    assert report["ratios"]["continuous_vs_static"] > 0


def test_roofline_report_sums_the_steps_by_hand(monkeypatch):
    from engine.telemetry.stats import StepStats

    toy = DeviceCeilings(name="toy", peak_flops_per_s={"float32": 10.0}, bandwidth_bytes_per_s=1.0,
                         measured=False, source="test")  # fmt: skip
    monkeypatch.setattr(throughput, "get_ceilings", lambda device: toy)

    def step(kind: str, flops: float, nbytes: float, duration_s: float) -> StepStats:
        return StepStats(step_index=0, start_time=0.0, duration_s=duration_s, kind=kind,
                         num_prefill_tokens=0, num_decode_tokens=0, num_prefill_reqs=0,
                         num_decode_reqs=0, batch_size=1, num_running=0, num_waiting=0,
                         num_preemptions=0, num_blocks_used=0, num_blocks_free=0,
                         num_kv_blocks=1, flops=flops, bytes_moved=nbytes)  # fmt: skip

    steps = [step("prefill", 100.0, 2.0, 20.0), step("decode", 10.0, 4.0, 8.0)]
    roof = throughput.roofline_report(steps, "cpu", "float32", duration_s=30.0)
    # prefill: max(100/10, 2/1) = 10 s; decode: max(10/10, 4/1) = 4 s.
    assert roof["bound_s"] == 14.0 and roof["fraction_of_bound"] == round(14 / 30, 3)
    assert roof["decode_bound_s"] == 4.0 and roof["decode_fraction_of_bound"] == 0.5
    assert roof["by_step_kind"] == {
        "decode": {"steps": 1, "time_s": 8.0, "bound_s": 4.0, "fraction_of_bound": 0.5},
        "prefill": {"steps": 1, "time_s": 20.0, "bound_s": 10.0, "fraction_of_bound": 0.5},
    }


def test_bench_throughput_runs_hf_continuous_batching(tiny_hf_folder, monkeypatch):
    """The peer the issue names: transformers' continuous batching on the same workload, every
    request at its exact length, its cache sized to the workload (not to free memory)."""
    toy = DeviceCeilings(name="toy", peak_flops_per_s={"float32": 1e9}, bandwidth_bytes_per_s=1e9,
                         measured=False, source="test")  # fmt: skip
    monkeypatch.setattr(throughput, "get_ceilings", lambda device: toy)
    monkeypatch.setattr(common, "get_ceilings", lambda device, refresh=False: toy)
    monkeypatch.setattr(common, "measure_ceilings", lambda device: toy)  # the end-of-run one
    monkeypatch.setattr(common, "remember_ceilings", lambda ceilings, device: None)
    argv = ["--model", str(tiny_hf_folder), "--dtype", "float32", "--num-requests", "5",
            "--prompt-len", "260", "300", "--output-len", "2", "9", "--skip", "static", "hf"]  # fmt: skip
    report = throughput.main(argv)
    hf = report["results"]["hf_continuous"]
    assert hf["output_tokens"] == report["workload"]["output_tokens"]
    # One page per 256 tokens of each request (2 each here), plus 2 spare.
    assert hf["config"]["num_blocks"] == 2 * 5 + 2
    assert hf["ttft_p50_s"] > 0 and hf["tpot_p50_s"] > 0
    assert report["ratios"]["continuous_vs_hf_continuous"] > 0
    judged = {v["aim"]: v["value"] for v in aims.judge(aims.AIMS, {"chat": report})}
    vs_hf = report["ratios"]["continuous_vs_hf_continuous"]
    assert judged["chat workload, ours over Hugging Face continuous batching"] == vs_hf
    fraction = report["results"]["continuous"]["roofline"]["fraction_of_bound"]
    assert judged["chat workload, fraction of its roofline bound"] == fraction


def test_the_bound_divides_by_the_best_of_the_ceilings_before_and_after(monkeypatch):
    """A roof measured while the host was slow would put steps above it: the end-of-run
    measurement is kept where it is higher, ceiling by ceiling, and cached for the report."""
    import argparse

    start = DeviceCeilings(name="toy", peak_flops_per_s={"float32": 4e9, "bfloat16": 1e9},
                           bandwidth_bytes_per_s=1e9, measured=True, source="start")  # fmt: skip
    end = DeviceCeilings(name="toy", peak_flops_per_s={"float32": 2e9, "bfloat16": 3e9},
                         bandwidth_bytes_per_s=5e9, measured=True, source="end")  # fmt: skip
    remembered = []
    monkeypatch.setattr(common, "get_ceilings", lambda device, refresh=False: start)
    monkeypatch.setattr(common, "measure_ceilings", lambda device: end)
    monkeypatch.setattr(common, "remember_ceilings", lambda c, device: remembered.append(c))
    best = common.end_of_run_ceilings(argparse.Namespace(cached_ceilings=False), "cpu")
    assert best.peak_flops_per_s == {"bfloat16": 3e9, "float32": 4e9}
    assert best.bandwidth_bytes_per_s == 5e9 and "best of 2 runs" in best.source
    assert remembered == [best]
    # --cached-ceilings: the cached roof as it is, nothing measured.
    monkeypatch.setattr(common, "measure_ceilings", lambda device: pytest.fail("measured"))
    assert common.end_of_run_ceilings(argparse.Namespace(cached_ceilings=True), "cpu") is start
