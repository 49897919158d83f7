"""benchmarks.batch1 end to end on a tiny random model: one engine per --vary value, the same
greedy tokens, TPOT against the bandwidth floor from the device ceilings."""

import dataclasses
import json

import pytest

from benchmarks import aims, batch1, common
from engine.telemetry.ceilings import DeviceCeilings


def test_bench_batch1_varies_a_field_and_reports_the_floor(tmp_path, capsys, monkeypatch):
    toy = DeviceCeilings(name="toy", peak_flops_per_s={"bfloat16": 1e12}, bandwidth_bytes_per_s=1e9,
                         measured=False, source="test")  # fmt: skip
    asked = []  # the ceilings are measured at the start of the run, not read from the cache

    def ceilings(device, refresh=False):
        asked.append((device, refresh))
        return toy

    monkeypatch.setattr(common, "get_ceilings", ceilings)
    # Measured again at the end, faster: the floor divides by the higher bandwidth.
    faster = dataclasses.replace(toy, bandwidth_bytes_per_s=2e9)
    monkeypatch.setattr(common, "measure_ceilings", lambda device: faster)
    monkeypatch.setattr(common, "remember_ceilings", lambda ceilings, device: None)
    out = tmp_path / "b1.json"
    argv = ["--model", "random:tiny", "--prompt-len", "12", "--output-len", "5",
            "--num-prompts", "2", "--vary", "prepack_weights=true,false", "--json", str(out)]  # fmt: skip
    report = batch1.main(argv)
    assert report == json.loads(out.read_text()) == json.loads(capsys.readouterr().out)
    on, off = (
        report["runs"]["ours prepack_weights=true"],
        report["runs"]["ours prepack_weights=false"],
    )
    assert "hf generate" not in report["runs"]  # random weights: no checkpoint for HF to load
    assert off["prepacked_linears"] == 0 and on["same_tokens_as_baseline"] is True
    assert off["same_tokens_as_baseline"] is True  # prepacking changes no number
    assert on["tpot_over_baseline"] == 1.0 and on["tpot_ms"] > 0
    # 2 GB/s at the end: the floor is the bytes a step reads, in ms = bytes / 2e6.
    assert on["floor_tpot_ms"] == pytest.approx(on["weight_bytes_read_per_step"] / 2e6, abs=0.01)
    # Rounded to 2 decimals in the JSON: a ratio of 0.14 is 0.135-0.145.
    assert on["tpot_over_floor"] == pytest.approx(
        on["tpot_ms"] / on["floor_tpot_ms"], rel=0.02, abs=0.0051
    )
    assert report["vary"] == "prepack_weights" and report["config"]["dtype"] == "bfloat16"
    judged = {v["aim"]: v["value"] for v in aims.judge(aims.AIMS, {"batch1": report})}
    assert judged["batch-1 bf16 TPOT over the bandwidth floor"] == on["tpot_over_floor"]
    assert asked == [("cpu", True), ("cpu", False)]  # measured at the start; then the best of both
    asked.clear()
    batch1.main([*argv[:-2], "--skip-hf", "--cached-ceilings", "--vary", "prepack_weights=true"])
    assert asked == [("cpu", False), ("cpu", False)]


def test_bench_batch1_times_the_decode_step_on_and_off(monkeypatch):
    from kernels import cpu_attention, cpu_fused_ops

    if cpu_fused_ops.cpu_fused_ops_status() or cpu_attention.cpu_kernel_status():
        pytest.skip("CPU kernels unavailable")
    toy = DeviceCeilings(name="toy", peak_flops_per_s={"bfloat16": 1e12}, bandwidth_bytes_per_s=1e9,
                         measured=False, source="test")  # fmt: skip
    monkeypatch.setattr(common, "get_ceilings", lambda device, refresh=False: toy)
    monkeypatch.setattr(common, "measure_ceilings", lambda device: toy)
    monkeypatch.setattr(common, "remember_ceilings", lambda ceilings, device: None)
    argv = ["--model", "random:tiny", "--prompt-len", "12", "--output-len", "5", "--num-prompts",
            "2", "--vary", "quantization=int8", "--skip-hf", "--decode-step-ab", "2"]  # fmt: skip
    ab = batch1.main(argv)["decode_step_ab"]
    assert ab["requests_each"] == 4 and ab["same_tokens"] is True
    assert ab["step_tpot_ms"] > 0 and ab["layers_tpot_ms"] > 0
    assert 0 <= ab["step_faster_in_pairs"] <= 4
    # Where no step is built (enforce_eager), it says so instead of timing one path twice.
    eager = batch1.main([*argv, "--enforce-eager"])["decode_step_ab"]
    assert "skipped" in eager


def test_bench_batch1_sampled_uses_the_chat_tabs_defaults(monkeypatch):
    from playground.handlers.chat import CHAT_TEMPERATURE, CHAT_TOP_P

    toy = DeviceCeilings(name="toy", peak_flops_per_s={"bfloat16": 1e12}, bandwidth_bytes_per_s=1e9,
                         measured=False, source="test")  # fmt: skip
    monkeypatch.setattr(common, "get_ceilings", lambda device, refresh=False: toy)
    monkeypatch.setattr(common, "measure_ceilings", lambda device: toy)
    monkeypatch.setattr(common, "remember_ceilings", lambda ceilings, device: None)
    seen: list = []  # every request the engines run, warm-up included
    real_generate = batch1.LLM.generate

    def generate(self, prompts, params=None):
        seen.append(params)
        return real_generate(self, prompts, params)

    monkeypatch.setattr(batch1.LLM, "generate", generate)
    argv = ["--model", "random:tiny", "--prompt-len", "12", "--output-len", "6", "--num-prompts",
            "3", "--vary", "prepack_weights=true,false", "--skip-hf", "--sampled"]  # fmt: skip
    report = batch1.main(argv)
    assert report["sampling"] == {"temperature": CHAT_TEMPERATURE, "top_p": CHAT_TOP_P}
    assert all(p.temperature == CHAT_TEMPERATURE and p.top_p == CHAT_TOP_P for p in seen)
    timed = [p for p in seen if p.max_tokens == 6]
    assert [p.seed for p in timed] == [0, 1, 2, 0, 1, 2]  # both engines draw from the same seeds
    # Seeded: prepacking changes no number, so the second engine samples the same tokens.
    assert report["runs"]["ours prepack_weights=false"]["same_tokens_as_baseline"] is True
    assert batch1.hf_sampling_kwargs(True)["top_k"] == 0  # HF's default top-k 50 off, as ours
    assert batch1.hf_sampling_kwargs(False) == {"do_sample": False}
