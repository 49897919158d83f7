"""lm-evaluation-harness against our server: its `local-completions` backend (completions
with `echo` + `logprobs`, the legacy scoring protocol) runs a 32-item loglikelihood task
(tests/lm_eval_tasks/tiny_facts.yaml, local text) against `python -m engine.serving.server`,
and scores exactly as lm-eval's own `hf` backend does on the same weights: the same accuracy
and, item by item, the same loglikelihoods."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "lm_eval_tasks"
TASK = "tiny_facts"
LOGLIKELIHOOD_TOL = 1e-3  # summed over a few tokens, float32 paged vs eager attention


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(folder: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.serving.server", "--model", str(folder), "--port",
         str(port), "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
         "--served-model-name", "tiny"],
        cwd=REPO, env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.5)


def _evaluate(model: str, model_args: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=1,
        log_samples=True,
    )


def _loglikelihoods(results: dict) -> list[list[float]]:
    """Per item (in doc order), the loglikelihood of each choice."""
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


@pytest.mark.slow
def test_local_completions_equals_hf_backend(tiny_hf_folder, tmp_path, monkeypatch):
    # Offline, and nothing written into the repo or the user's dataset cache.
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)  # the task's data_files path is relative to the repo root
    port = _free_port()
    proc = _start_server(tiny_hf_folder, port)
    try:
        ours = _evaluate(
            "local-completions",
            f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,"
            f"tokenizer={tiny_hf_folder},tokenizer_backend=huggingface,tokenized_requests=True,"
            "num_concurrent=1,max_retries=1",
        )
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    reference = _evaluate("hf", f"pretrained={tiny_hf_folder},dtype=float32,device=cpu")

    ours_ll, ref_ll = _loglikelihoods(ours), _loglikelihoods(reference)
    assert len(ours_ll) == len(ref_ll) == 32
    for i, (a, b) in enumerate(zip(ours_ll, ref_ll, strict=True)):
        assert a == pytest.approx(b, abs=LOGLIKELIHOOD_TOL), f"item {i}"
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][TASK][metric] == reference["results"][TASK][metric], metric
