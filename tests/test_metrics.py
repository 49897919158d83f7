"""FLOP/byte accounting against hand counts and the field's seed numbers; KV sizing; buffers."""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import pytest

from engine.telemetry.cost import (
    ModelShape,
    attended_positions,
    kv_cache_bytes,
    linear_flops,
    max_concurrency,
    step_cost,
)
from engine.telemetry.stats import RingBuffer, StepStats, latency_summary, step_kind

GiB = 1 << 30

# Llama-2-7B in fp16: 32 layers, hidden 4096, MLP 11008, 32 heads (MHA), vocab 32000, untied.
LLAMA2_7B = ModelShape(
    num_layers=32,
    hidden_size=4096,
    intermediate_size=11008,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    vocab_size=32000,
    tie_word_embeddings=False,
    weight_bytes_per_param=2,
    kv_bytes_per_element=2,
)

# Small enough to count by hand: 2 layers, hidden 8, MLP 16, 2 heads, 1 KV head, head_dim 4.
TINY = ModelShape(
    num_layers=2,
    hidden_size=8,
    intermediate_size=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=10,
    tie_word_embeddings=True,
    weight_bytes_per_param=2,
    kv_bytes_per_element=2,
)


def test_tiny_param_counts_by_hand():
    # q 8x8=64, k 8x4=32, v 32, o 64 -> 192; gate/up/down 3 x 8x16 = 384 -> 576 per layer.
    assert TINY.layer_linear_params == 576
    # embedding 80 + 2 layers x 576 + norms (2x2+1) x 8 = 40; tied, so no separate lm_head.
    assert TINY.num_params == 80 + 1152 + 40
    assert TINY.num_linear_params_per_token == 1152 + 80
    # read per step: linears 1152 + norms 40 + lm_head (= embedding table, tied) 80, x 2 bytes.
    assert TINY.weight_bytes == (1152 + 40 + 80) * 2
    untied = ModelShape(**{**TINY.__dict__, "tie_word_embeddings": False})
    assert untied.num_params == TINY.num_params + 80
    # Untied: the embedding table is only gathered, the lm_head read in full: same bytes.
    assert untied.weight_bytes == TINY.weight_bytes


def test_tiny_step_cost_by_hand():
    # Request A: prefill chunk of 3 tokens at positions 2,3,4 (context 5 after the step).
    # Request B: decode of 1 token at position 6 (context 7). Both sample -> 2 logit tokens.
    cost = step_cost(TINY, [3, 1], [5, 7], num_logit_tokens=2)
    linear = 2 * 1152 * 4 + 2 * 80 * 2
    attended = (3 + 4 + 5) + 7  # token at position p attends p + 1 tokens
    attention = 2 * 2 * 2 * 4 * attended * 2  # 2 matmuls x 2 FLOP x heads x head_dim x layers
    assert attended_positions(3, 5) == 12
    assert cost.flops == linear + attention
    kv_per_token = 2 * 2 * 1 * 4 * 2  # K,V x layers x kv_heads x head_dim x bytes = 32
    kv = (5 + 7) * kv_per_token + (3 + 1) * kv_per_token  # context read + new written
    assert cost.bytes_moved == TINY.weight_bytes + kv
    assert cost.arithmetic_intensity == pytest.approx(cost.flops / cost.bytes_moved)


def test_step_cost_empty_and_invalid():
    assert step_cost(TINY, [], [], 0).flops == 0
    assert step_cost(TINY, [], [], 0).bytes_moved == 0
    with pytest.raises(ValueError):
        step_cost(TINY, [2], [1], 1)  # more new tokens than context
    with pytest.raises(ValueError):
        step_cost(TINY, [1, 1], [2], 1)


def test_llama2_7b_param_count():
    assert LLAMA2_7B.num_params == 6_738_415_616


def test_llama2_7b_prefill_2048_is_about_2_x_7e9_x_2048():
    seed_number = 2 * 7e9 * 2048  # 28.7 TFLOPs, the field's rule of thumb
    cost = step_cost(LLAMA2_7B, [2048], [2048], num_logit_tokens=1)
    assert cost.flops == pytest.approx(seed_number, rel=0.05)
    # Linear part alone: 2 x 6.48e9 layer params x 2048 tokens = 26.5 TFLOPs; the rule of thumb
    # uses all 6.74e9 params (embedding + lm_head too), hence ~8% above.
    linear = linear_flops(LLAMA2_7B, 2048, 1)
    assert linear == pytest.approx(2 * 32 * LLAMA2_7B.layer_linear_params * 2048 + 2 * 131_072_000)
    assert linear == pytest.approx(seed_number, rel=0.10)
    # Attention adds 4 x 32 layers x 4096 x 2048 x 2049 / 2 = 1.1 TFLOPs (~4%).
    assert cost.flops - linear == pytest.approx(4 * 32 * 4096 * 2048 * 2049 / 2)
    # Prefill is compute-bound: hundreds of FLOP per byte.
    assert cost.arithmetic_intensity > 500


def test_llama2_7b_decode_one_token():
    cost = step_cost(LLAMA2_7B, [1], [1], num_logit_tokens=1)
    assert cost.flops == pytest.approx(14e9, rel=0.07)  # 13.2 GFLOPs = 2 x 6.6e9 matmul params
    # fp16 weights read once: 13.2 GB (embedding table only gathered, so below 2 x 6.74e9).
    assert 13.0e9 < LLAMA2_7B.weight_bytes < 14.0e9
    assert cost.arithmetic_intensity == pytest.approx(1.0, rel=0.05)


def test_decode_batch_raises_intensity_until_kv_dominates():
    one = step_cost(LLAMA2_7B, [1], [128], 1)
    batch = step_cost(LLAMA2_7B, [1] * 64, [128] * 64, 64)
    assert batch.arithmetic_intensity > 30 * one.arithmetic_intensity
    long_ctx = step_cost(LLAMA2_7B, [1] * 64, [4096] * 64, 64)
    assert long_ctx.arithmetic_intensity < batch.arithmetic_intensity


def test_shape_from_the_preset_table_matches_published_sizes():
    """ModelShape.from_arch is the one way from a ModelArch to the cost model: the preset
    table's shapes give the published parameter counts (the KV calculator's weights bar)."""
    from engine.runner.models.presets import MODEL_PRESETS

    assert ModelShape.from_arch(MODEL_PRESETS["llama-2-7b"], 2, 2) == LLAMA2_7B
    published = {"llama-3-8b": 8.03e9, "mistral-7b": 7.24e9, "llama-3-70b": 70.6e9}
    for name, num_params in published.items():
        assert ModelShape.from_arch(MODEL_PRESETS[name]).num_params == pytest.approx(
            num_params, rel=2e-3
        )
    int8 = ModelShape.from_arch(MODEL_PRESETS["llama-3-8b"], 2, kv_bytes_per_element=1)
    # The shape's per-token KV is the one formula's answer for one token.
    assert int8.kv_bytes_per_token() == kv_cache_bytes(32, 8, 128, 1, 1, 1) == 64 * 1024


def test_kv_cache_bytes_seed_numbers():
    # Llama-3-8B-like: 32 layers, 8 KV heads, head_dim 128, fp16.
    assert kv_cache_bytes(32, 8, 128, 4096, 8, 2) == 4 * GiB
    # 128 KiB per token: 8 x 32k tokens = 32 GiB, 16 x 32k tokens = 64 GiB.
    assert kv_cache_bytes(32, 8, 128, 32768, 8, 2) == 32 * GiB
    assert kv_cache_bytes(32, 8, 128, 32768, 16, 2) == 64 * GiB
    # Full multi-head attention (32 KV heads, Llama-2-7B) needs four times as much.
    assert kv_cache_bytes(32, 32, 128, 4096, 8, 2) == 16 * GiB
    assert kv_cache_bytes(32, 32, 128, 32768, 16, 2) == 256 * GiB
    # One token of Llama-2-7B: 2 x 32 x 32 x 128 x 2 = 512 KiB.
    assert LLAMA2_7B.kv_bytes_per_token() == 512 * 1024


def test_max_concurrency():
    assert max_concurrency(4 * GiB, 32, 8, 128, 4096, 2) == 8
    assert max_concurrency(4 * GiB - 1, 32, 8, 128, 4096, 2) == 7
    assert max_concurrency(40 * GiB, 32, 8, 128, 32768, 2) == 10
    # An int8 cache holds twice as many.
    assert max_concurrency(4 * GiB, 32, 8, 128, 4096, 1) == 16
    assert max_concurrency(0, 32, 8, 128, 4096, 2) == 0


def test_step_kind():
    assert step_kind(5, 0) == "prefill"
    assert step_kind(0, 3) == "decode"
    assert step_kind(5, 3) == "mixed"
    assert step_kind(0, 0) == "idle"


def test_step_stats_properties():
    stats = StepStats(
        step_index=3,
        start_time=10.0,
        duration_s=0.5,
        kind=step_kind(100, 4),
        num_prefill_tokens=100,
        num_decode_tokens=4,
        num_prefill_reqs=1,
        num_decode_reqs=4,
        batch_size=5,
        num_running=5,
        num_waiting=2,
        num_preemptions=0,
        num_blocks_used=10,
        num_blocks_free=90,
        num_kv_blocks=100,
        flops=1e9,
        bytes_moved=2e8,
    )
    assert stats.kind == "mixed"
    assert stats.num_tokens == 104
    assert stats.num_blocks_cached == 0
    assert stats.arithmetic_intensity == pytest.approx(5.0)
    assert stats.achieved_flops_per_s == pytest.approx(2e9)
    assert stats.achieved_bytes_per_s == pytest.approx(4e8)


def test_ring_buffer_bound_and_clear():
    buf: RingBuffer[int] = RingBuffer(3)
    for i in range(5):
        buf.append(i)
    assert buf.snapshot() == [2, 3, 4]
    assert len(buf) == 3
    assert buf.total_appended == 5
    snap = buf.snapshot()
    snap.append(99)  # a copy: the buffer is untouched
    assert len(buf) == 3
    buf.clear()
    assert buf.snapshot() == []
    assert buf.total_appended == 5
    with pytest.raises(ValueError):
        RingBuffer(0)


class _SlowDeque(deque):
    """A deque that gives up the GIL inside every append and while being copied. CPython's
    deque does each in one C call under the GIL, which hides a missing lock; this one makes an
    unlocked append land in the middle of a copy ("deque mutated during iteration")."""

    def __init__(self, maxlen: int) -> None:
        super().__init__(maxlen=maxlen)
        self.num_appends = 0
        self.num_copies = 0

    def append(self, item) -> None:
        time.sleep(0)
        super().append(item)
        self.num_appends += 1

    def __iter__(self):
        self.num_copies += 1
        for item in super().__iter__():
            time.sleep(0)
            yield item


def test_ring_buffer_threads():
    capacity = 100
    buf: RingBuffer[tuple[int, int]] = RingBuffer(capacity)
    slow = buf._items = _SlowDeque(capacity)  # white box: widens the windows the lock closes
    num_writers, per_writer = 4, 500
    snapshots_ok = []
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            for i in range(per_writer):
                buf.append((w, i))
        except BaseException as e:
            errors.append(e)

    def read() -> None:
        try:
            for _ in range(20):
                snap = buf.snapshot()
                # Each writer's items appear in order: a copy never sees a half-done append.
                in_order = all(
                    [i for ww, i in snap if ww == w] == sorted(i for ww, i in snap if ww == w)
                    for w in range(num_writers)
                )
                snapshots_ok.append(len(snap) <= capacity and in_order)
        except BaseException as e:  # an unlocked copy raises "deque mutated during iteration"
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(num_writers)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert slow.num_appends == num_writers * per_writer and slow.num_copies >= 40
    assert buf.total_appended == num_writers * per_writer
    assert len(buf) == capacity
    assert len(snapshots_ok) == 40 and all(snapshots_ok)
    # Each writer's items stay in order within the kept window.
    for w in range(num_writers):
        mine = [i for ww, i in buf.snapshot() if ww == w]
        assert mine == sorted(mine)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_latency_summary_matches_numpy(n):
    values = np.random.default_rng(n).exponential(0.05, size=n).tolist()
    got = latency_summary(values)
    assert got["count"] == n
    assert got["mean"] == pytest.approx(np.mean(values))
    assert got["median"] == pytest.approx(np.percentile(values, 50))
    assert got["p90"] == pytest.approx(np.percentile(values, 90))
    assert got["p99"] == pytest.approx(np.percentile(values, 99))
    assert got["min"] == min(values)
    assert got["max"] == max(values)


def test_latency_summary_empty():
    got = latency_summary([])
    assert got["count"] == 0
    assert all(got[k] is None for k in ("mean", "median", "p90", "p99", "min", "max"))
