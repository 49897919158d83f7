"""What the benchmark scripts (bench.py, bench_prefix.py, bench_spec.py) share: the common
flags, running prompts one at a time, and printing the JSON report (writing it with --json)."""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.core.engine import Prompt
from engine.llm import LLM
from engine.request import RequestOutput, SamplingParams
from engine.telemetry.stats import StepStats


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with --model, --device, --dtype and --json; the script adds its own flags.
    --help prints the script's whole docstring (what it measures and how)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p


def emit(report: dict, path: Path | None) -> None:
    """Print the report as JSON; also write it to `path` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


@dataclass
class SequentialRun:
    outputs: list[RequestOutput]
    duration_s: float  # wall time of all prompts, warm-up excluded
    steps: list[StepStats]  # the engine steps of this run (warm-up excluded)


def run_one_at_a_time(
    config: dict, prompts: Sequence[Prompt], params: SamplingParams
) -> SequentialRun:
    """Build an engine from `config`, warm it up, then send each prompt when the previous one
    has finished (a chat user, an agent loop); the engine is released after."""
    llm = LLM(**config)
    llm.generate([[101, 102, 103, 104]], SamplingParams(max_tokens=2))  # warm-up
    first_step = llm.engine.num_steps
    outputs: list[RequestOutput] = []
    start = time.perf_counter()
    for prompt in prompts:
        outputs += llm.generate([prompt], params)
    duration_s = time.perf_counter() - start
    steps = [s for s in llm.stats().steps if s.step_index >= first_step]
    del llm
    gc.collect()
    return SequentialRun(outputs, duration_s, steps)
