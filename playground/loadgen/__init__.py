"""Load generator: a seeded workload against the in-process engine or any OpenAI-compatible
server, measured like `vllm bench serve`. `python -m playground.loadgen --help` for the CLI;
the Load test and Compare tabs use the same Python API (see run.py)."""

from playground.loadgen.metrics import (
    LoadTestResult,
    RequestResult,
    compute_summary,
    format_summary_table,
    parse_slos,
)
from playground.loadgen.run import load_tokenizer, main, run_load_test
from playground.loadgen.targets import EngineTarget, OpenAITarget, Target
from playground.loadgen.workload import (
    GenRequest,
    LengthDist,
    WorkloadSpec,
    arrival_offsets_s,
    build_requests,
    load_dataset,
)

__all__ = [
    "EngineTarget",
    "GenRequest",
    "LengthDist",
    "LoadTestResult",
    "OpenAITarget",
    "RequestResult",
    "Target",
    "WorkloadSpec",
    "arrival_offsets_s",
    "build_requests",
    "compute_summary",
    "format_summary_table",
    "load_dataset",
    "load_tokenizer",
    "main",
    "parse_slos",
    "run_load_test",
]
