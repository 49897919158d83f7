"""The bound on native memory growth (issue 11, item 5) is wired: every engine's model runner
(the service's and the offline LLM's) caps oneDNN's per-shape caches before its first forward
pass, and a user's own setting wins."""

from __future__ import annotations

import os

import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.runner.onednn_cache import (
    CACHE_CAPACITY_ENV_VARS,
    DEFAULT_CACHE_CAPACITY,
    bound_onednn_caches,
)
from engine.serving.service import EngineService

TINY = dict(model="random:tiny", dtype="float32", max_model_len=256, num_kv_blocks=16)


@pytest.fixture
def no_cache_env(monkeypatch):
    for name in CACHE_CAPACITY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_bound_sets_both_capacities_when_unset(no_cache_env):
    assert bound_onednn_caches() == dict.fromkeys(
        CACHE_CAPACITY_ENV_VARS, str(DEFAULT_CACHE_CAPACITY)
    )
    assert all(os.environ[name] == str(DEFAULT_CACHE_CAPACITY) for name in CACHE_CAPACITY_ENV_VARS)


def test_user_setting_wins(no_cache_env, monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "2048")
    in_effect = bound_onednn_caches()
    assert in_effect["LRU_CACHE_CAPACITY"] == "2048"
    assert in_effect["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(DEFAULT_CACHE_CAPACITY)


def test_zero_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):  # ideep segfaults on 0
        bound_onednn_caches(0)


@pytest.mark.parametrize("entry", ["service", "llm"])
def test_every_engine_caps_the_caches_before_its_runner_builds_anything(
    entry, no_cache_env, monkeypatch
):
    """The service's engine and the offline LLM's alike: the runner sets the caps first."""
    import engine.runner.model_runner as runner_module

    seen: list[dict[str, str | None]] = []
    real_resolve_device = runner_module.resolve_device

    def resolve_device_spy(*args, **kwargs):  # the runner's first step after the bound
        seen.append({name: os.environ.get(name) for name in CACHE_CAPACITY_ENV_VARS})
        return real_resolve_device(*args, **kwargs)

    monkeypatch.setattr(runner_module, "resolve_device", resolve_device_spy)
    if entry == "service":
        with EngineService(EngineConfig(**TINY)):
            pass
    else:
        LLM(**TINY)
    assert seen[:1] == [dict.fromkeys(CACHE_CAPACITY_ENV_VARS, str(DEFAULT_CACHE_CAPACITY))]
