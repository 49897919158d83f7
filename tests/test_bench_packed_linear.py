"""benchmarks.packed_linear on the tiny preset: every path (bf16 kernel, oneDNN, and with
--quantized the int8 and int4 kernels) timed per row count, the shapes the kernel cannot read
listed instead of timed."""

from __future__ import annotations

import json

import pytest

from kernels.cpu_fused_ops import cpu_fused_ops_status


def test_tiny_run_times_both_paths(tmp_path):
    if (why := cpu_fused_ops_status()) is not None:
        pytest.skip(f"CPU fused ops unavailable: {why}")
    from benchmarks import packed_linear

    shapes = packed_linear.preset_shapes("tiny", lm_head=True)
    assert set(shapes) == {"qkv", "o", "gate_up", "down", "lm_head"}
    if not any(packed_linear.kernel_layout(*s) for s in shapes.values()):
        pytest.skip("the kernel reads none of the tiny shapes' packed layouts on this CPU")

    out = tmp_path / "packed.json"
    report = packed_linear.main(["--preset", "tiny", "--layers", "1", "--rows", "1", "5",
                                 "--repeats", "1", "--quantized", "--lm-head",
                                 "--json", str(out)])  # fmt: skip
    assert report == json.loads(out.read_text())
    timed, left_out = report["shapes"], report["shapes_left_out"]
    assert set(timed) | set(left_out) == set(shapes) and timed
    assert {tuple(s) for s in timed.values()} <= set(shapes.values())
    assert all(report["layouts"][k] == packed_linear.kernel_layout(*s) for k, s in timed.items())
    assert report["weight_bytes_per_pass"] == 2 * sum(n * k for n, k in timed.values())
    assert set(report["per_rows"]) == {"1", "5"}
    assert report["paths"][:3] == ["kernel", "onednn", "int8"]
    assert all(r[f"{path}_min_ms"] > 0 for r in report["per_rows"].values()
               for path in report["paths"])  # fmt: skip
    assert all(r["int8_over_kernel"] > 0 for r in report["per_rows"].values())
