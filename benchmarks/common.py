"""What the benchmark scripts (throughput, prefix, spec) share: the engine flags, running
prompts one at a time, and printing the JSON report (writing it with --json)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.cli import add_engine_args, config_from_args
from engine.config import EngineConfig
from engine.core.engine import Prompt
from engine.llm import LLM
from engine.request import RequestOutput, SamplingParams
from engine.runner.model_runner import resolve_device
from engine.telemetry.ceilings import (
    DeviceCeilings,
    best_of_runs,
    get_ceilings,
    measure_ceilings,
    remember_ceilings,
)
from engine.telemetry.stats import StepStats

# Every benchmark measures in bfloat16 unless told otherwise (EngineConfig's "auto" is the same
# on the engine, but a benchmark's JSON and HF's side need the name).
BENCH_DEFAULTS = {"dtype": "bfloat16"}
# Engine fields no benchmark takes as a flag: a benchmark's own --seed seeds its workload, and
# its greedy outputs need no sampling seed (the engine keeps EngineConfig's).
BENCH_EXCLUDED = ("seed",)


def bench_parser(doc: str, exclude: Sequence[str] = ()) -> argparse.ArgumentParser:
    """A parser with every EngineConfig flag (engine/cli.py) except `exclude` (the fields the
    benchmark varies itself), plus --json; the script adds its own flags.
    --help prints the script's whole docstring (what it measures and how)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p, defaults=BENCH_DEFAULTS, exclude=(*BENCH_EXCLUDED, *exclude))
    p.add_argument("--json", type=Path, help="also write the JSON here")
    return p


def add_ceilings_flag(p: argparse.ArgumentParser) -> None:
    """--cached-ceilings, for the benchmarks that divide by the device's ceilings."""
    p.add_argument(
        "--cached-ceilings",
        action="store_true",
        help="take the device ceilings (bandwidth, peak FLOP/s) from the cache instead of "
        "measuring them at the start of this run (~2 s); a shared machine's bandwidth moves by "
        "10-15%% from one hour to the next, and a floor from another hour says little",
    )


def run_ceilings(args: argparse.Namespace, device: str) -> DeviceCeilings:
    """The ceilings this run divides by: measured now (and cached for later), unless
    --cached-ceilings. `device`: an EngineConfig device ("auto" = CUDA when available)."""
    resolved = str(resolve_device(device).type)
    return get_ceilings(resolved, refresh=not args.cached_ceilings)


def end_of_run_ceilings(args: argparse.Namespace, device: str) -> DeviceCeilings:
    """The ceilings measured at the run's start against a measurement now, each ceiling's best
    kept (and cached); with --cached-ceilings, the cached ones. A shared host's speed moves over
    a run's minutes: a roof measured in a slow moment put steps above it (a chat workload's
    prefill at 102 % of its bound, 2-core cloud Xeon, 2026-12-07)."""
    resolved = str(resolve_device(device).type)
    if args.cached_ceilings:
        return get_ceilings(resolved)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    best = best_of_runs([get_ceilings(resolved), measure_ceilings(resolved)], stamp)
    remember_ceilings(best, resolved)
    return best


def config_report(config: EngineConfig) -> dict:
    """The engine settings of a run, for the JSON report (the model is reported apart)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}


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
    config: EngineConfig, prompts: Sequence[Prompt], params: SamplingParams
) -> SequentialRun:
    """Build an engine from `config`, warm it up, then send each prompt when the previous one
    has finished (a chat user, an agent loop); the engine is released after."""
    llm = LLM(**dataclasses.asdict(config))
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


def parse_vary(text: str) -> tuple[str, list[str]]:
    """ "field=a,b,c" -> ("field", ["a", "b", "c"]); the field must be an EngineConfig field."""
    name, sep, values = text.partition("=")
    if not sep or not values:
        raise ValueError(f"--vary: expected FIELD=V1,V2,..., got {text!r}")
    if name not in EngineConfig.field_names():
        raise ValueError(f"--vary: {name!r} is not an EngineConfig field")
    return name, [v.strip() for v in values.split(",") if v.strip()]


def typed_field_value(base: EngineConfig, field: str, value: str) -> object:
    """A --vary value in its EngineConfig field's type (int fields such as block_size; else the string)."""
    current = getattr(base, field)
    if isinstance(current, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    return value


def vary_configs(args: argparse.Namespace, field: str, values: Sequence[str]) -> list[EngineConfig]:
    """One EngineConfig per value of `field` over the parsed flags. Varying kv_cache_dtype
    keeps fp8's scale flags (--calculate-kv-scales, ...) for the fp8 run only, as bench-kvq and
    Compare do (EngineConfig.with_kv_cache_dtype): the other formats refuse them."""
    if field == "kv_cache_dtype":
        base = config_from_args(args, kv_cache_dtype="fp8")
        return [base.with_kv_cache_dtype(v) for v in values]
    base = config_from_args(args)
    return [base.replace(**{field: typed_field_value(base, field, v)}) for v in values]
