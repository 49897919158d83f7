"""EngineService: one LLMEngine looping in a background thread, shared by chat, load tests
and the HTTP server. Callers submit from any thread and read their request's deltas from a
RequestStream, synchronously or with `async for`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.core.block_manager import BlockSnapshot
from engine.core.engine import LLMEngine, Prompt
from engine.request import Request, RequestOutput, SamplingParams
from engine.telemetry.prom_null import new_metrics_registry
from engine.telemetry.stats import EngineStats, RequestProgress

logger = logging.getLogger(__name__)

# How long after the last snapshot request the engine keeps publishing fresh ones.
_WATCH_S = 3.0


class RequestStream:
    """The deltas of one request. The engine thread pushes; one consumer pulls (sync or async)."""

    def __init__(self, request_id: str, service: EngineService) -> None:
        self.request_id = request_id
        self._service = service
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._cond = threading.Condition()
        self._done = False  # the final output has been pushed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    # --- engine side ---
    def push(self, output: RequestOutput) -> None:
        with self._cond:
            self._items.append(output)
            self._done = self._done or output.request_finished  # all n sequences are over
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            # RuntimeError: the consumer's loop has closed; nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    # --- consumer side ---
    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        with self._cond:
            while not self._items:
                if self._done:
                    raise StopIteration
                self._cond.wait()
            return self._items.popleft()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            with self._cond:
                if self._loop is None:
                    self._loop = asyncio.get_running_loop()
                    self._event = asyncio.Event()
                if self._items:
                    return self._items.popleft()
                if self._done:
                    raise StopAsyncIteration
                self._event.clear()
            await self._event.wait()

    def abort(self) -> None:
        self._service.abort(self.request_id)

    def result(self) -> RequestOutput:
        """Block until the request finishes; returns its final (cumulative) output."""
        last = None
        for last in self:  # noqa: B007 (the last delta carries the full text)
            pass
        assert last is not None
        return last


class EngineService:
    def __init__(self, config: EngineConfig | None = None, **config_fields: object) -> None:
        self.config = config or EngineConfig(**config_fields)  # type: ignore[arg-type]
        self.engine = LLMEngine(self.config, make_metrics=new_metrics_registry)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.metrics_registry = self.engine.metrics_registry
        # What the UI's roofline and KV calculator need, without reaching into the engine.
        self.model_shape = self.engine.shape  # ModelShape: layers, heads, widths, bytes/param
        self.device = self.engine.runner.device.type  # "cpu" | "cuda" (resolved)
        self.dtype = str(self.engine.runner.dtype).removeprefix("torch.")  # e.g. "bfloat16"
        # Bytes of the weights as stored (quantized: values + scales + zeros; engine/runner/quant).
        self.weight_bytes = self.engine.runner.weight_bytes
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # held by the engine thread while it steps
        self._stopping = False
        # The latest (block map, queues) and the engine step count when they were taken.
        self._published: tuple[tuple[BlockSnapshot, list[RequestProgress]] | None, int] = (
            None,
            0,
        )
        self._watch_until = 0.0  # publish snapshots after each step until then (monotonic s)
        # Of the block maps published so far (after every step while someone watches), the one
        # with the most blocks held: exact at step granularity, where a poller misses a peak
        # that lasts less than its interval (Compare's peak map on a fast engine).
        self.peak_block_snapshot: BlockSnapshot | None = None
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # --- callers ---
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        """Validate (raises ValueError naming the field) and enqueue; returns the stream."""
        if self._stopping:
            raise RuntimeError("engine: shutting down")
        request = self.engine.make_request(prompt, params, request_id)
        stream = RequestStream(request.group_id, self)
        self._inbox.put(("add", (request, stream)))
        self._wakeup.set()
        return stream

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.engine.apply_chat_template(messages)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def block_snapshot(self) -> BlockSnapshot:
        """The block map, never more than one step old, without waiting for a long step."""
        return self._snapshots()[0]

    def queue_snapshot(self) -> list[RequestProgress]:
        return self._snapshots()[1]

    def _snapshots(self) -> tuple[BlockSnapshot, list[RequestProgress]]:
        # A CPU prefill step can take a second; rather than block the UI on the engine lock,
        # ask the engine thread to publish snapshots after each step for a while, and serve
        # the latest one. When the engine is idle the lock is free and the snapshot is fresh.
        self._watch_until = time.monotonic() + _WATCH_S
        if self._lock.acquire(blocking=False):
            try:
                self._publish_snapshots()
            finally:
                self._lock.release()
        published, at_step = self._published
        if published is None or at_step < self.engine.num_steps - 1:  # too old: wait a step
            with self._lock:
                self._publish_snapshots()
                published, _ = self._published
        assert published is not None
        return published

    def _publish_snapshots(self) -> None:
        """Called with the lock held (the engine thread holds it while it steps)."""
        snapshots = (self.engine.block_snapshot(), self.engine.queue_snapshot())
        self._published = (snapshots, self.engine.num_steps)
        block, peak = snapshots[0], self.peak_block_snapshot
        if peak is None or block.num_blocks - block.num_free > peak.num_blocks - peak.num_free:
            self.peak_block_snapshot = block

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def is_alive(self) -> bool:
        """Whether the engine thread runs (False once it has died or been shut down)."""
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    def __enter__(self) -> EngineService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- the engine thread ---
    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            num_steps = self.engine.num_steps
            try:
                with self._lock:
                    outputs = self.engine.step()
                    if time.monotonic() < self._watch_until:
                        self._publish_snapshots()
            except Exception as exc:  # keep the thread alive; fail what was in flight
                logger.exception("engine step failed")
                with self._lock:
                    outputs = self.engine.abort_all(f"engine error: {exc}")
            self._publish(outputs)
            if not outputs and self.engine.num_steps == num_steps:
                # Nothing was schedulable: wait for a submit or an abort rather than spin.
                self._wakeup.wait(timeout=0.05)
                self._wakeup.clear()
        with self._lock:
            self._drain_inbox()
            self._publish(self.engine.abort_all("engine shut down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request, stream = payload  # type: ignore[misc]
                assert isinstance(request, Request)
                try:
                    self.engine.add(request)
                except ValueError as exc:  # e.g. a request_id already in flight
                    stream.push(_rejected(request, str(exc)))
                    continue
                self._streams[request.group_id] = stream
            elif kind == "abort":
                out = self.engine.abort(payload)  # type: ignore[arg-type]
                if out is not None:
                    self._publish([out])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.push(out)
        for out in outputs:  # after the loop: n sequences may finish in one step
            if out.request_finished:
                self._streams.pop(out.request_id, None)
        if any(out.finished for out in outputs):
            self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        """Queue and KV-usage gauges as of now. Steps set them too, but after an abort, the
        last request's finish or an engine error no step may follow for a long time, and
        /metrics would keep showing load that is gone."""
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        self.metrics_registry.observe_queues(
            len(scheduler.running), len(scheduler.waiting), blocks.num_used_blocks,
            blocks.num_blocks,
        )  # fmt: skip


def _rejected(request: Request, error: str) -> RequestOutput:
    """The only output of a request the engine refused once it reached the engine thread."""
    request.metrics.finish_time = time.perf_counter()
    return RequestOutput(
        request_id=request.group_id, prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids, token_ids=[], text="", new_token_ids=[],
        new_text="", finished=True, finish_reason="abort", metrics=request.metrics, error=error,
        request_finished=True,
    )  # fmt: skip


def wait_until_idle(service: EngineService, timeout_s: float = 30.0) -> bool:
    """Poll until no request is running or waiting (tests, load-test teardown)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = service.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and service._inbox.empty():
            return True
        time.sleep(0.02)
    return False
