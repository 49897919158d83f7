"""benchmarks.packed_linear on the tiny preset: every path (bf16 kernel, oneDNN, and with
--quantized the int8 and int4 kernels) timed per row count, the shapes the kernel cannot read
listed instead of timed."""

from __future__ import annotations

import json

import pytest
import torch

from engine.runner.models.prepack import can_prepack, packed_layout_matches
from kernels.cpu_fused_ops import cpu_fused_ops_status


def test_tiny_run_times_both_paths(tmp_path):
    if (why := cpu_fused_ops_status()) is not None:
        pytest.skip(f"CPU fused ops unavailable: {why}")
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 linear here")
    from benchmarks import packed_linear

    out = tmp_path / "packed.json"
    report = packed_linear.main(["--preset", "tiny", "--layers", "1", "--rows", "1", "5",
                                 "--repeats", "1", "--quantized", "--json", str(out)])  # fmt: skip
    assert report == json.loads(out.read_text())
    timed, left_out = report["shapes"], report["shapes_left_out"]
    assert set(timed) | set(left_out) == {"qkv", "o", "gate_up", "down"}
    assert all(packed_layout_matches(*s, torch.bfloat16) for s in timed.values())
    assert report["weight_bytes_per_pass"] == sum(n * k * 2 for n, k in timed.values())
    if timed:
        assert set(report["per_rows"]) == {"1", "5"}
        assert report["paths"][:3] == ["kernel", "onednn", "int8"]
        assert all(r[f"{path}_min_ms"] > 0 for r in report["per_rows"].values()
                   for path in report["paths"])  # fmt: skip
        assert all(r["int8_over_kernel"] > 0 for r in report["per_rows"].values())
