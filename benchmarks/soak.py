"""Soak: many mixed requests against one in-process engine, with random aborts and client
disconnects, at a fixed concurrency. Prints JSON: sent/ok/failed/aborted/disconnected, the
KV blocks still held at the end (must be 0), resident memory (RSS) after every
--rss-every requests (must level off, issue 11 item 5) with glibc's malloc'd bytes in use at
the same points (RSS growth that is not in them is freed memory malloc keeps, not a leak),
and p50/p99 end-to-end latency. docs/serving.md, "Memory", explains the numbers.

Most requests go straight to EngineService (as the UI does); --http-fraction of them go
through the OpenAI server (engine/serving/server.py) on 127.0.0.1 as streaming completions,
and some of those clients hang up after the first chunks (the server must abort them).

  python -m benchmarks.soak --num-requests 300 --model random:tiny
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.common import bench_parser, config_report, emit
from engine.cli import config_from_args
from engine.request import SamplingParams
from engine.runner.onednn_cache import CACHE_CAPACITY_ENV_VARS
from engine.serving.service import EngineService, wait_until_idle

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES


_MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")  # fmt: skip


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def malloc_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (glibc mallinfo2: uordblks + hblkhd, all
    arenas); None where that is not glibc >= 2.33. Python's small objects live in pymalloc's
    own arenas and are not counted; tensors and native caches are."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0  # finished with an engine error
    aborted: int = 0  # we aborted it mid-stream
    disconnected: int = 0  # an HTTP client hung up mid-stream
    latencies_s: list[float] = field(default_factory=list)  # ok requests, end to end
    rss_mb: dict[int, float] = field(default_factory=dict)  # requests done -> RSS (MiB)
    malloc_mb: dict[int, float] = field(default_factory=dict)  # requests done -> in use (MiB)
    http_errors: list[str] = field(default_factory=list)  # transport errors, first few kept
    done: int = 0


def _params(rng: random.Random, max_tokens: int) -> SamplingParams:
    greedy = rng.random() < 0.5
    return SamplingParams(
        max_tokens=rng.randint(1, max_tokens),
        temperature=0.0 if greedy else 0.8,
        top_p=1.0 if greedy else 0.95,
        seed=None if greedy else rng.randrange(2**32),
        ignore_eos=rng.random() < 0.5,
    )


async def _direct(svc: EngineService, rng: random.Random, args, tally: Tally) -> None:
    prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(4, args.max_prompt_len))]
    abort_after = rng.randint(1, 4) if rng.random() < args.abort_fraction else None
    start = time.perf_counter()
    stream = svc.submit(prompt, _params(rng, args.max_tokens))
    num_deltas, last = 0, None
    async for out in stream:
        num_deltas, last = num_deltas + 1, out
        if abort_after is not None and num_deltas == abort_after and not out.finished:
            stream.abort()  # keep reading: the final (aborted) output still comes
    if last is None or last.error:
        tally.failed += 1
    elif last.finish_reason == "abort":
        tally.aborted += 1
    else:
        tally.ok += 1
        tally.latencies_s.append(time.perf_counter() - start)


async def _http(
    client: httpx.AsyncClient, url: str, rng: random.Random, args, tally: Tally
) -> None:
    hang_up = rng.random() < args.abort_fraction
    body = {
        "prompt": [rng.randrange(100, 30000) for _ in range(rng.randint(4, args.max_prompt_len))],
        "max_tokens": rng.randint(1, args.max_tokens), "temperature": 0, "stream": True,
    }  # fmt: skip
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                tally.failed += 1
                return
            async for line in resp.aiter_lines():
                if hang_up and line.startswith("data: {"):
                    tally.disconnected += 1  # leaving the block closes the connection
                    return
    except httpx.HTTPError as exc:  # the server dropped the connection: a failure, counted
        tally.failed += 1
        tally.http_errors.append(repr(exc))
        return
    tally.ok += 1
    tally.latencies_s.append(time.perf_counter() - start)


async def _soak(svc: EngineService, url: str | None, args) -> Tally:
    rng = random.Random(args.seed)
    tally = Tally()
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client) -> None:
        async with gate:
            tally.sent += 1
            if url is not None and rng.random() < args.http_fraction:
                await _http(client, url, rng, args, tally)
            else:
                await _direct(svc, rng, args, tally)
            tally.done += 1
            if tally.done % args.rss_every == 0:
                tally.rss_mb[tally.done] = round(rss_bytes() / 2**20, 1)
                in_use = malloc_in_use_bytes()
                if in_use is not None:
                    tally.malloc_mb[tally.done] = round(in_use / 2**20, 1)

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(one(client) for _ in range(args.num_requests)))
    return tally


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args) -> dict:
    from engine.serving.http_server import BackgroundServer
    from engine.serving.server import create_app

    config = config_from_args(args)
    svc = EngineService(config)
    server = BackgroundServer(create_app(svc)).start() if args.http_fraction > 0 else None
    rss_start, malloc_start = rss_bytes(), malloc_in_use_bytes()
    start = time.perf_counter()
    try:
        tally = asyncio.run(_soak(svc, server.url if server else None, args))
        idle = wait_until_idle(svc, timeout_s=60)
        duration_s = time.perf_counter() - start
        stats = svc.stats()
    finally:
        if server is not None:
            server.stop()
        svc.shutdown()
    # With prefix caching, freed blocks stay cached (reusable); they are not held.
    held = stats.num_kv_blocks - stats.num_free_kv_blocks
    return {
        "model": config.model,
        "config": config_report(config),
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "duration_s": round(duration_s, 2),
        "sent": tally.sent,
        "ok": tally.ok,
        "failed": tally.failed,
        "aborted": tally.aborted,
        "disconnected": tally.disconnected,
        "http_errors": tally.http_errors[:5],
        "idle_at_end": idle,
        "blocks_held_at_end": held,
        "rss_mb_start": round(rss_start / 2**20, 1),
        "rss_mb_by_requests": tally.rss_mb,
        "malloc_mb_start": None if malloc_start is None else round(malloc_start / 2**20, 1),
        "malloc_mb_by_requests": tally.malloc_mb,
        # oneDNN's per-shape caches, the bound on native growth (engine/runner/onednn_cache.py)
        "onednn_cache_capacity": {name: os.environ.get(name) for name in CACHE_CAPACITY_ENV_VARS},
        "latency_p50_s": _percentile(tally.latencies_s, 0.50),
        "latency_p99_s": _percentile(tally.latencies_s, 0.99),
    }


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--num-requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16, help="outputs are 1..this long")
    p.add_argument("--max-prompt-len", type=int, default=64, help="prompts are 4..this long")
    p.add_argument("--abort-fraction", type=float, default=0.1, help="aborted / hung up")
    p.add_argument("--http-fraction", type=float, default=0.1, help="sent through HTTP")
    p.add_argument("--rss-every", type=int, default=1000, help="sample RSS every N requests")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload")
    args = p.parse_args(argv)
    report = run(args)
    emit(report, args.json)
    ok = report["blocks_held_at_end"] == 0 and report["idle_at_end"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
