"""The load generator's runner and CLI: drives the in-process engine or any OpenAI-compatible server with a seeded
workload and measures TTFT / TPOT / ITL / E2E latency, throughput and goodput, like
`vllm bench serve`. The UI's Load test and Compare tabs use the same Python API:

    spec = WorkloadSpec(num_prompts=200, max_concurrency=32, input_len=LengthDist.uniform(16, 64))
    result = await run_load_test(spec, EngineTarget(service), on_progress=cb)
    result.summary()["mean_ttft_ms"], result.per_request[0].itl_s, result.to_json()

CLI: `python -m playground.loadgen --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from playground.loadgen.metrics import (
    LoadTestResult,
    RequestResult,
    parse_slos,
)
from playground.loadgen.targets import EngineTarget, OpenAITarget, Target
from playground.loadgen.workload import (
    GenRequest,
    LengthDist,
    Tokenizer,
    WorkloadSpec,
    arrival_offsets_s,
    build_requests,
    build_warmup_requests,
)
from playground.remote.client import RemoteServer

if TYPE_CHECKING:
    from engine.config import EngineConfig

# on_progress(done, total, last_result); may be a plain function or a coroutine function.
ProgressCallback = Callable[[int, int, RequestResult], Any]


async def _send_all(
    requests: list[GenRequest],
    target: Target,
    spec: WorkloadSpec,
    offsets_s: list[float],
    on_done: Callable[[RequestResult], Any] | None = None,
) -> tuple[float, float, list[RequestResult]]:
    """Sends each request at start + its offset, at most max_concurrency in flight.
    Returns (start, end, results in request order)."""
    limit = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    start = time.perf_counter()

    async def one(request: GenRequest, offset_s: float) -> RequestResult:
        delay_s = start + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        # The send time is taken inside send(), after the semaphore: time waiting for a
        # concurrency slot is the client's queue, not the server's latency (as in vLLM).
        async with limit if limit is not None else contextlib.nullcontext():
            result = await target.send(request, spec)
        if on_done is not None:
            maybe = on_done(result)
            if inspect.isawaitable(maybe):
                await maybe
        return result

    tasks = [asyncio.ensure_future(one(r, o)) for r, o in zip(requests, offsets_s, strict=True)]
    try:
        results = await asyncio.gather(*tasks)
    finally:  # stopped early: cancel what is still running (each aborts its request)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return start, time.perf_counter(), list(results)


async def run_load_test(
    spec: WorkloadSpec,
    target: Target,
    on_progress: ProgressCallback | None = None,
    *,
    requests: list[GenRequest] | None = None,
    slos_ms: Mapping[str, float] | None = None,
) -> LoadTestResult:
    """Runs the workload against the target and returns every request's timeline.

    requests: prebuilt requests (default: build_requests(spec, target.tokenizer)).
    slos_ms: goodput SLOs, e.g. {"ttft": 500, "tpot": 50, "e2el": 10000}.
    Cancelling the returned coroutine stops the test and aborts the requests in flight.
    """
    if requests is None:
        requests = build_requests(spec, target.tokenizer)
    total = len(requests)
    done = 0

    async def progress(result: RequestResult) -> None:
        nonlocal done
        done += 1
        if on_progress is not None:
            maybe = on_progress(done, total, result)
            if inspect.isawaitable(maybe):
                await maybe

    try:
        warmups = build_warmup_requests(spec, target.tokenizer) if spec.num_warmups else []
        if warmups:
            await _send_all(warmups, target, spec, [0.0] * len(warmups))
        offsets_s = arrival_offsets_s(total, spec.request_rate, spec.burstiness, spec.seed)
        start, end, results = await _send_all(requests, target, spec, offsets_s.tolist(), progress)
    finally:
        await target.aclose()
    notes = dict(getattr(target, "notes", {}))  # test fakes may have none
    return LoadTestResult(spec, target.name, start, end, results, dict(slos_ms or {}), notes)


# --- CLI -------------------------------------------------------------------------------------


def _add_length_args(parser: argparse.ArgumentParser, which: str, default: int) -> None:
    parser.add_argument(
        f"--{which}-len", type=int, default=default, help=f"{which} tokens (the normal's mean)"
    )
    parser.add_argument(
        f"--{which}-len-dist",
        choices=("fixed", "uniform", "normal"),
        default=None,
        help="length distribution (default fixed; implied by --*-len-range / --*-len-std)",
    )
    parser.add_argument(
        f"--{which}-len-range",
        default=None,
        metavar="LO:HI",
        help="bounds of a uniform distribution (also clips a normal one), inclusive",
    )
    parser.add_argument(
        f"--{which}-len-std", type=float, default=None, help="std of a normal distribution"
    )


def length_dist_from_args(
    mean: int, dist: str | None, range_: str | None, std: float | None, which: str
) -> LengthDist:
    low = high = None
    if range_ is not None:
        lo, sep, hi = range_.partition(":")
        try:
            low, high = int(lo), int(hi)
        except ValueError:
            raise ValueError(f"--{which}-len-range: expected LO:HI, got {range_!r}") from None
        if not sep:
            raise ValueError(f"--{which}-len-range: expected LO:HI, got {range_!r}")
    if dist is None:
        dist = "uniform" if range_ is not None else "normal" if std is not None else "fixed"
    if dist == "fixed":
        return LengthDist.fixed(mean)
    if dist == "uniform":
        if low is None or high is None:
            raise ValueError(f"--{which}-len-range LO:HI is required with a uniform distribution")
        return LengthDist.uniform(low, high)
    if std is None:
        raise ValueError(f"--{which}-len-std is required with a normal distribution")
    return LengthDist.normal(mean, std, low, high)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m playground.loadgen",
        description="Load generator for OpenAI-compatible servers and the in-process engine "
        "(metrics as `vllm bench serve` defines them).",
    )
    p.add_argument("--target", choices=("openai", "engine"), default="openai")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server")
    p.add_argument("--model", default=None, help="served model name (default: the first listed)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for random prompts: a folder, a GGUF, smollm2-135m or a HF name in the "
        "local cache (default: the served model id, then smollm2-135m, then plain token ids)",
    )
    p.add_argument("--engine-model", default="smollm2-135m", help="model of --target engine")
    p.add_argument(
        "--server-prompt-cache",
        choices=("off", "on"),
        default="off",
        help="llama.cpp's prompt cache (off: each request sends cache_prompt: false, so reruns "
        "are not served from cache); other servers' caches are server flags",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig field for --target engine, e.g. dtype=float32 (repeatable)",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = all at 0")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    _add_length_args(p, "input", 128)
    _add_length_args(p, "output", 64)
    p.add_argument("--prefix-len", type=int, default=0, help="random tokens shared by all")
    p.add_argument("--dataset", default=None, help="JSONL of prompts (ShareGPT-like or prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 = off (an API extension)")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off (an API extension)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (the API's n)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:500 tpot:50 ..."
    )
    p.add_argument("--result-file", default=None, help="write the full result as JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_len=length_dist_from_args(
            args.input_len, args.input_len_dist, args.input_len_range, args.input_len_std, "input"
        ),
        output_len=length_dist_from_args(
            args.output_len,
            args.output_len_dist,
            args.output_len_range,
            args.output_len_std,
            "output",
        ),
        prefix_len=args.prefix_len,
        dataset=args.dataset,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        ignore_eos=args.ignore_eos,
        n=args.n,
        num_warmups=args.num_warmups,
    )


def engine_config_from_args(model: str, items: list[str]) -> EngineConfig:
    """EngineConfig(model=..., KEY=VALUE...), each value parsed as its field's default's type."""
    from engine import EngineConfig

    fields = {f.name: f for f in EngineConfig.__dataclass_fields__.values()}
    changes: dict[str, Any] = {"model": model}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--engine-arg: expected KEY=VALUE with an EngineConfig field: {item}")
        default = fields[key].default
        if raw.lower() == "none":
            changes[key] = None
        elif isinstance(default, bool):
            changes[key] = raw.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, int) or (default is None and raw.lstrip("-").isdigit()):
            changes[key] = int(raw)
        elif isinstance(default, float):
            changes[key] = float(raw)
        else:
            changes[key] = raw
    return EngineConfig(**changes)


def load_tokenizer(name: str) -> Tokenizer:
    """A local tokenizer for a model id, folder, GGUF, the embedded model or a Hugging Face name
    in the local cache (never a download, never torch); ValueError says why not."""
    from playground.remote.tokenizer import tokenizer_from_name

    return tokenizer_from_name(name)


async def _run_cli(args: argparse.Namespace) -> LoadTestResult:
    from tqdm import tqdm

    spec = spec_from_args(args)
    slos_ms = parse_slos(args.goodput)
    service = None
    if args.target == "engine":
        from engine import EngineService

        service = EngineService(engine_config_from_args(args.engine_model, args.engine_arg))
        target: Target = EngineTarget(service)
    else:
        target = await asyncio.to_thread(openai_target_from_args, args, spec)
    for key, note in target.notes.items():
        print(f"{key}: {note}", file=sys.stderr)
    bar = tqdm(total=spec.num_prompts, disable=args.disable_tqdm, file=sys.stderr)
    try:
        return await run_load_test(
            spec, target, on_progress=lambda done, total, last: bar.update(1), slos_ms=slos_ms
        )
    finally:
        bar.close()
        if service is not None:
            service.shutdown()


def openai_target_from_args(args: argparse.Namespace, spec: WorkloadSpec) -> OpenAITarget:
    """GET /v1/models (and llama.cpp's /props), then the tokenizer chain of
    playground/remote/tokenizer.py: --tokenizer or the served id, the embedded model's, ids."""
    from playground.remote.tokenizer import PromptTokenizer, TokenIdPrompts
    from playground.remote.tokenizer import resolve_prompt_tokenizer as resolve

    server = RemoteServer.connect(args.base_url, args.api_key, args.model, args.tokenizer)
    prompts = resolve(args.tokenizer or server.model, server.vocab_size)
    text_only = spec.dataset is not None and not spec.prefix_len
    if text_only and isinstance(prompts.tokenizer, TokenIdPrompts):
        # Text prompts need no tokenizer; lengths are then counted in words until the server's
        # usage report replaces them.
        prompts = PromptTokenizer(_Words(), "dataset text, lengths from the server's usage")
    return OpenAITarget.for_server(server, prompts, prompt_cache=args.server_prompt_cache == "on")


class _Words:
    """Stand-in tokenizer for dataset runs without one: prompt lengths counted in words (the
    server's usage report replaces them)."""

    vocab_size = 0
    all_special_ids: list[int] = []  # noqa: RUF012

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(_run_cli(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.format_table())
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            f.write(result.to_json())
    return 0 if result.summary()["completed"] > 0 else 1
