"""The playground over a quantized KV pool: the header, the block-map summary and the KV
calculator name the format and the pool size; Compare's "KV 16-bit vs int8" preset gives both
sides the same bytes, and on its workload the 16-bit side waits or preempts while int8 runs
every request at once."""

import pytest

from engine import EngineConfig
from playground.engine_info import describe, engine_info
from playground.handlers.compare import BackgroundCompare, compare_rows
from playground.handlers.compare_engine import (
    KV_QUANT_PRESET,
    PRESET_DEFAULTS,
    engine_sides,
    preset_sides,
    preset_workload,
    side_config,
    side_label,
)
from playground.handlers.kv import engine_pool_markdown
from playground.handlers.live import summary_markdown
from playground.handlers.loadtest import spec_from_form
from playground.loadgen import build_requests

# random:tiny with SmolLM2's head_dim: int8 then costs what it costs on the embedded model.
BASE = EngineConfig(model="random:tiny,head_dim=64", dtype="bfloat16", kv_cache_dtype="int8",
                    num_kv_blocks=64, max_model_len=512)  # fmt: skip


@pytest.fixture(scope="module")
def service():
    from engine.serving.service import EngineService

    svc = EngineService(BASE)
    yield svc
    svc.shutdown()


def test_header_summary_and_calculator_name_the_kv_format(service):
    info = engine_info(service)
    assert info.kv_cache_dtype == "int8"
    header = describe(info)
    assert "64 blocks x 16 tokens" in header and "of int8 K/V" in header
    assert f"{info.kv_cache_bytes / 2**20:,.1f} MiB" in header
    stats = service.stats()
    assert "of int8 K/V + a float16 scale per token and KV head" in summary_markdown(stats, 0)
    pool = engine_pool_markdown(info, 256)
    # 1 byte + 2 bytes of scale per 64 values: the formula at 1.03125 B is the real pool.
    assert "x 1.03125 B" in pool and "which matches the allocation" in pool
    assert "stored as int8" in pool


def test_kv_preset_gives_both_sides_the_same_bytes():
    bf16, int8 = preset_sides(KV_QUANT_PRESET)
    budget = PRESET_DEFAULTS[KV_QUANT_PRESET].kv_budget_tokens
    a = side_config(BASE, bf16, budget, 512, head_dim=64)
    b = side_config(BASE, int8, budget, 512, head_dim=64)
    assert (a.kv_cache_dtype, b.kv_cache_dtype) == ("auto", "int8")
    assert a.num_kv_blocks == budget // 16 == 72
    assert b.num_kv_blocks == int(budget * 2 / 1.03125) // 16 == 139


def test_kv_preset_int8_runs_every_request_at_once(service):
    """The preset's own workload and budget on two engines: 8 requests x (224 + 32) tokens
    need 128 blocks; bfloat16's 72 hold 4 requests at a time, int8's 139 all 8."""
    from engine.serving.service import EngineService

    d = PRESET_DEFAULTS[KV_QUANT_PRESET]
    spec = spec_from_form(preset_workload(KV_QUANT_PRESET), d.max_model_len)
    bf16, int8 = preset_sides(KV_QUANT_PRESET)
    sides = [
        (n, side_label(n, side, other),
         side_config(BASE, side, d.kv_budget_tokens, d.max_model_len, head_dim=64))
        for n, side, other in (("A", bf16, int8), ("B", int8, bf16))
    ]  # fmt: skip
    requests = build_requests(spec, service.tokenizer)
    cmp = BackgroundCompare(spec, engine_sides(sides, EngineService), requests)
    assert cmp.start().done.wait(300)
    a, b = cmp.outcomes
    assert a.error is None and b.error is None
    rows = {r[0]: r for r in compare_rows(a, b, headline=d.headline)}
    headline = rows["★ Most requests running at once"]
    assert int(headline[1]) <= 5 and headline[2] == "8" and headline[4] == "B"
    assert rows["Preemptions"][2] == "0"
    assert rows["KV pool (blocks)"][1:3] == ["72", "139"]
    assert rows["Successful requests"][1:3] == ["8", "8"]


def test_compare_gives_the_engines_fp8_scale_settings_to_fp8_sides_only():
    """An app started with --kv-cache-dtype fp8 --calculate-kv-scales: a 16-bit or int8 side
    must not inherit settings EngineConfig refuses there; an fp8 side keeps them."""
    base = BASE.replace(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_scale_granularity="head")
    bf16, int8 = preset_sides(KV_QUANT_PRESET)
    a = side_config(base, bf16, 1152, 512, head_dim=64)
    fp8 = side_config(base, {**int8, "kv_cache_dtype": "fp8"}, 1152, 512, head_dim=64)
    assert (a.kv_cache_dtype, a.calculate_kv_scales, a.kv_scale_granularity) == (
        "auto",
        False,
        "tensor",
    )
    assert (fp8.calculate_kv_scales, fp8.kv_scale_granularity) == (True, "head")
