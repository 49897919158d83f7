"""Device ceilings: roofline math, datasheet presets, measurement and its two caches."""

from __future__ import annotations

import json
import re

import pytest

from engine.telemetry import ceilings as dc
from engine.telemetry.ceilings import (
    CACHE_FILE_NAME,
    GPUS,
    PRESETS,
    DeviceCeilings,
    get_ceilings,
    roof_fraction,
    roofline,
    roofline_bound_s,
    roofline_curve,
)

TOY = DeviceCeilings(
    name="toy",
    peak_flops_per_s={"bfloat16": 100.0, "float32": 10.0},
    bandwidth_bytes_per_s=10.0,
    measured=False,
    source="test",
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAYGROUND_CACHE_DIR", str(tmp_path))
    dc.clear_memory_cache()
    yield tmp_path
    dc.clear_memory_cache()


def test_roofline_is_min_of_roofs():
    assert TOY.ridge_point("bfloat16") == 10.0
    assert roofline(TOY, "bfloat16", 1.0) == 10.0  # memory-bound: I x bandwidth
    assert roofline(TOY, "bfloat16", 10.0) == 100.0  # at the ridge both roofs meet
    assert roofline(TOY, "bfloat16", 1000.0) == 100.0  # compute-bound: the peak
    assert roofline(TOY, "bfloat16", [0.5, 5, 50]) == [5.0, 50.0, 100.0]
    assert roofline(TOY, "float32", [0.5, 5]) == [5.0, 10.0]


def test_dtype_names_and_missing_dtype():
    torch = pytest.importorskip("torch")
    assert TOY.peak(torch.bfloat16) == 100.0
    with pytest.raises(KeyError, match="float16"):
        TOY.peak("float16")


def test_roof_fraction():
    # 20 FLOP over 4 bytes in 1 s: intensity 5 -> attainable 50 FLOP/s, achieved 20.
    assert roof_fraction(TOY, "bfloat16", 20.0, 4.0, 1.0) == pytest.approx(0.4)
    # Compute-bound: 1000 FLOP / 1 byte in 20 s = 50 FLOP/s of a 100 peak.
    assert roof_fraction(TOY, "bfloat16", 1000.0, 1.0, 20.0) == pytest.approx(0.5)
    assert roof_fraction(TOY, "bfloat16", 0.0, 0.0, 0.1) == 0.0


def test_roofline_bound_sums_each_steps_slower_roof():
    # (FLOPs, bytes): 100 FLOP / 1 byte is compute-bound (1 s > 0.1 s); 10 FLOP / 50 bytes
    # is memory-bound (5 s > 0.1 s); an empty step costs nothing.
    steps = [(100.0, 1.0), (10.0, 50.0), (0.0, 0.0)]
    assert roofline_bound_s(TOY, "bfloat16", steps) == pytest.approx(1.0 + 5.0)
    assert roofline_bound_s(TOY, "float32", steps) == pytest.approx(10.0 + 5.0)
    assert roofline_bound_s(TOY, "bfloat16", []) == 0.0


def test_roofline_curve_has_sharp_ridge():
    xs, ys = roofline_curve(TOY, "bfloat16", 0.1, 1000.0, 4)
    assert len(xs) == 5  # 4 log-spaced points (10^-1, 10^(1/3), ...) + the ridge at 10
    assert xs == sorted(xs)
    assert xs[0] == pytest.approx(0.1)
    assert xs[-1] == pytest.approx(1000.0)
    assert 10.0 in xs
    assert ys == [min(100.0, x * 10.0) for x in xs]


def test_presets():
    a100 = PRESETS["A100 80GB"]
    assert a100.ridge_point("bfloat16") == pytest.approx(156.0)
    assert a100.ridge_point("float16") == pytest.approx(156.0)
    assert PRESETS["H100 SXM"].ridge_point("bfloat16") == pytest.approx(295, rel=0.01)
    assert PRESETS["H200"].ridge_point("bfloat16") == pytest.approx(206, rel=0.01)
    for preset in PRESETS.values():
        assert not preset.measured
        assert set(preset.peak_flops_per_s) == {"float32", "bfloat16", "float16"}
        assert preset.peak("float32") < preset.peak("bfloat16")
    # One GPU table: the roofline's presets are its ceilings, the KV calculator its memory.
    assert set(PRESETS) == set(GPUS)
    assert PRESETS["H200"] == GPUS["H200"].ceilings() and GPUS["H200"].memory_gb == 141
    assert a100.bandwidth_bytes_per_s == GPUS["A100 80GB"].bandwidth_bytes_per_s == 2.0e12


def test_dict_round_trip():
    assert DeviceCeilings.from_dict(json.loads(json.dumps(TOY.to_dict()))) == TOY


def test_measure_and_cache_on_cpu(cache_dir, monkeypatch):
    first = get_ceilings("cpu")
    assert first.measured
    assert re.search(r"measured on cpu \d{4}-\d\d-\d\d \d\d:\d\d UTC", first.source), first.source
    assert first.bandwidth_bytes_per_s > 0
    # int8: torch._int_mm's products, the roof of int8 activations (EngineConfig.int8_activations)
    assert set(first.peak_flops_per_s) == {"float32", "bfloat16", "float16", "int8"}
    assert all(v > 0 for v in first.peak_flops_per_s.values())
    assert first.ridge_point("float32") > 0

    path = cache_dir / CACHE_FILE_NAME
    assert dc.cache_key("cpu") in json.loads(path.read_text())

    def no_measuring(*args, **kwargs):
        raise AssertionError("should have come from a cache")

    monkeypatch.setattr(dc, "measure_ceilings", no_measuring)
    assert get_ceilings("cpu") is first  # in-process cache
    dc.clear_memory_cache()
    assert get_ceilings("cpu") == first  # from the JSON file


def test_refresh_and_bad_cache_file(cache_dir, monkeypatch):
    calls = []

    def fake_measure(device="cpu", dtypes=dc.DTYPES):
        calls.append(device)
        return DeviceCeilings(dc.device_name(device), {"float32": 1.0}, 2.0, True, "fake")

    monkeypatch.setattr(dc, "measure_ceilings", fake_measure)
    (cache_dir / CACHE_FILE_NAME).write_text("{not json")
    get_ceilings("cpu")
    get_ceilings("cpu")
    assert len(calls) == 1
    get_ceilings("cpu", refresh=True)
    assert len(calls) == 2
    assert json.loads((cache_dir / CACHE_FILE_NAME).read_text())  # rewritten, valid again


def test_a_roof_from_another_machine_or_version_is_measured_again(cache_dir, monkeypatch):
    """The disk cache is keyed by what decides the roof, not the CPU's model name alone: cloud
    guests of different generations share "Intel(R) Xeon(R) Processor", and a roof measured the
    way an older version did (a CPU's bf16 roof below float32's) must not be shown again."""
    calls = []

    def fake_measure(device="cpu", dtypes=dc.DTYPES):
        calls.append(device)
        return DeviceCeilings(dc.device_name(device), {"float32": 3.0}, 4.0, True, "fresh")

    monkeypatch.setattr(dc, "measure_ceilings", fake_measure)
    monkeypatch.setattr(dc, "cpu_features", lambda: ["avx2", "avx512f"])
    stale = DeviceCeilings(dc.device_name("cpu"), {"float32": 1.0}, 2.0, True, "stale")
    key = dc.cache_key("cpu")
    assert "avx512f" in key and f"v{dc.MEASUREMENT_VERSION}" in key
    older = key.replace(f"v{dc.MEASUREMENT_VERSION}", f"v{dc.MEASUREMENT_VERSION - 1}")
    entries = {stale.name: stale.to_dict(), older: stale.to_dict()}  # keys older versions wrote
    (cache_dir / CACHE_FILE_NAME).write_text(json.dumps(entries))
    assert get_ceilings("cpu").source == "fresh" and len(calls) == 1

    # The same model name on a CPU with AMX is another machine: its own roof.
    monkeypatch.setattr(dc, "cpu_features", lambda: ["avx2", "avx512f", "amx_bf16", "amx_int8"])
    assert dc.cache_key("cpu") != key
    assert get_ceilings("cpu").source == "fresh" and len(calls) == 2
    monkeypatch.setattr(dc, "cpu_features", lambda: ["avx2", "avx512f"])
    dc.clear_memory_cache()
    assert get_ceilings("cpu").source == "fresh" and len(calls) == 2  # each kept on disk
    assert set(json.loads((cache_dir / CACHE_FILE_NAME).read_text())) >= {key, older}


def test_cpu_bfloat16_roof_is_at_least_float32s(monkeypatch):
    """Where torch's bf16 matmul is emulated (a CPU without AVX512-BF16) it measures far below
    float32, yet a bf16 product can always run at float32's rate (the C++ kernels do): the roof
    is the higher one. On a GPU the measured peaks stand as they are."""
    peaks = {"float32": 300e9, "bfloat16": 55e9}
    monkeypatch.setattr(dc, "measure_bandwidth", lambda device: 25e9)
    monkeypatch.setattr(dc, "measure_matmul_flops", lambda device, dtype: peaks[dtype])
    cpu = dc.measure_ceilings("cpu", ["float32", "bfloat16"])
    assert cpu.peak("bfloat16") == cpu.peak("float32") == 300e9
    monkeypatch.setattr(dc, "device_name", lambda device: "a GPU")
    gpu = dc.measure_ceilings("cuda", ["float32", "bfloat16"])
    assert gpu.peak("bfloat16") == 55e9
    peaks["bfloat16"] = 900e9  # AMX / AVX512-BF16: bf16 already the higher roof
    assert dc.measure_ceilings("cpu", ["float32", "bfloat16"]).peak("bfloat16") == 900e9
