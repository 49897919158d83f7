"""scripts/gpu_check.py --cpu: the GPU check's kernel correctness part, run under the interpreter."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # > 5 s: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode_passes_and_prints_table():
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("check "))
    assert "rel err" in lines[header] and lines[header + 1].startswith("-----")
    body = lines[header + 2 :]
    for kernel in ("kv_store", "decode", "prefill", "w8a16", "w4a16"):
        kernel_rows = [line for line in body if line.startswith(kernel)]
        assert kernel_rows and all(" ok " in line for line in kernel_rows), result.stdout
    assert any(line.startswith("e2e") and "skipped" in line for line in body)


def test_graphs_parity_row_reports_a_difference():
    """The GPU run's graphs-vs-eager token check, with a stand-in engine: a mismatch fails."""
    import importlib.util

    from engine import SamplingParams

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    class FakeLLM:
        def __init__(self, enforce_eager: bool, **_):
            self.shift = 0 if enforce_eager else self.graph_shift

        def generate(self, prompts, params):
            return [type("Out", (), {"token_ids": [len(p) + self.shift]}) for p in prompts]

    for graph_shift, failed in ((0, False), (1, True)):
        FakeLLM.graph_shift = graph_shift
        rows = []
        assert gpu_check.graphs_parity(FakeLLM, SamplingParams, rows) is failed
        assert rows[0]["ok"] is not failed and rows[0]["case"].startswith("graphs parity")


def test_gpu_tune_cpu_mode_checks_launch_candidates(tmp_path):
    """scripts/gpu_tune.py --cpu: a few weight-only launch candidates of each format against
    the first launch's output under the interpreter (the GPU parts need CUDA)."""
    import json

    out = tmp_path / "tune.json"
    result = subprocess.run(
        [sys.executable, "scripts/gpu_tune.py", "--cpu", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["sweep"]
    assert {r["kind"] for r in rows} == {"w4a16", "w8a16"}
    assert all(r["ok"] and r["rel_err"] < 1e-5 for r in rows), rows
