"""ModelRunner pieces that run at start-up on a GPU, exercised on the CPU; and attention
backends plugging into the runner through the registry alone."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLM, SamplingParams
from engine.runner import attention
from engine.runner.attention.torch_backend import TorchBackend


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_profile_forward_leaves_the_cache_alone(backend):
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=8, max_model_len=128,
              attention_backend=backend)  # fmt: skip
    runner = llm.engine.runner
    before = runner.kv_caches
    runner.profile_forward(40)  # the activation probe CUDA start-up runs before sizing the KV
    assert runner.kv_caches is before
    assert llm.generate([[5, 6, 7]])[0].finished


class CountingBackend(TorchBackend):
    """A backend as a plug-in would add one: the torch backend's work, with its calls counted."""

    name = "counting"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        self.calls["kv_cache_shape"] += 1
        return super().kv_cache_shape(num_blocks)

    def build_metadata(self, inputs, kv_caches):
        self.calls["build_metadata"] += 1
        return super().build_metadata(inputs, kv_caches)

    def forward(self, q, k, v, kv_cache, meta, scale):
        self.calls["forward"] += 1
        return super().forward(q, k, v, kv_cache, meta, scale)


def test_registry_finds_backends_by_name(monkeypatch):
    monkeypatch.setattr(attention, "BACKENDS", dict(attention.BACKENDS))  # restored afterwards
    assert attention.get_backend("torch") is TorchBackend
    attention.register_backend("counting", CountingBackend)
    assert attention.get_backend("counting") is CountingBackend
    with pytest.raises(ValueError, match="attention_backend: unknown 'nope'"):
        attention.get_backend("nope")


def test_a_registered_backend_runs_the_engine_without_runner_changes(monkeypatch):
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate([5, 17, 9])]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    common = dict(model="random:tiny", dtype="float32", num_kv_blocks=16, block_size=8,
                  max_model_len=64, max_num_batched_tokens=16)  # fmt: skip
    expected = LLM(attention_backend="torch", **common).generate(prompts, params)
    # EngineConfig accepts the built-in names only, so the plug-in takes over "torch" here.
    monkeypatch.setattr(attention, "BACKENDS", dict(attention.BACKENDS))  # restored afterwards
    attention.register_backend("torch", CountingBackend)
    llm = LLM(attention_backend="torch", **common)
    backend = llm.engine.runner.attn_backend
    assert isinstance(backend, CountingBackend) and backend.calls["kv_cache_shape"] > 0
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in expected]
    num_steps = len(llm.stats().steps)
    assert backend.calls["build_metadata"] == num_steps  # once per step, not per layer
    assert backend.calls["forward"] == num_steps * llm.engine.runner.arch.num_layers
