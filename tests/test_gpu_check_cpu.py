"""scripts/gpu_check.py --cpu: the GPU check's kernel correctness part, run under the interpreter."""

import subprocess
import sys
from pathlib import Path

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
    for kernel in ("kv_store", "decode", "prefill"):
        kernel_rows = [line for line in body if line.startswith(kernel)]
        assert kernel_rows and all(" ok " in line for line in kernel_rows), result.stdout
    assert any(line.startswith("e2e") and "skipped" in line for line in body)
