"""Bad input gets a clear ValueError naming the field, and loses nothing."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"device": "tpu"}, "device"),
        ({"dtype": "int3"}, "dtype"),
        ({"batching": "dynamic"}, "batching"),
        ({"kv_layout": "ring"}, "kv_layout"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"num_kv_blocks": -1}, "num_kv_blocks"),
    ],
)
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        EngineConfig(**kwargs)


def test_unknown_model_spec():
    with pytest.raises(ValueError, match=r"^model: unknown model spec"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match=r"^model: unknown random preset"):
        LLM(model="random:gpt-5")


def test_unknown_config_field():
    with pytest.raises(ValueError, match=r"^max_seqs: not an EngineConfig field"):
        LLM(model="random:tiny", max_seqs=4)


def test_bad_prompts_are_rejected_and_nothing_leaks(tiny_llm):
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match=r"^prompt: must not be empty"):
        tiny_llm.generate([""])
    with pytest.raises(ValueError, match=r"^prompt: must not be empty"):
        tiny_llm.generate([[]])
    with pytest.raises(ValueError, match=r"^prompt: 300 tokens leave no room"):
        tiny_llm.generate([[5] * 300])
    with pytest.raises(ValueError, match=r"^prompt: token ids must be integers in \[0, 49152\)"):
        tiny_llm.generate([[1, 2, 10**9]])
    # One bad prompt rejects the batch before anything is queued.
    with pytest.raises(ValueError):
        tiny_llm.generate(["fine", ""])
    assert not engine.has_unfinished()
    assert tiny_llm.stats().num_free_kv_blocks == tiny_llm.stats().num_kv_blocks


def test_request_that_never_fits_is_rejected_at_submission():
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match=r"^prompt: this request needs up to 7 KV blocks"):
        llm.generate([[1] * 90], SamplingParams(max_tokens=10))
    # Fits when it asks for fewer tokens.
    out = llm.generate([[1] * 40], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_contiguous_layout_rejects_when_one_reservation_does_not_fit():
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=4, block_size=16,
              kv_layout="contiguous", max_model_len=128)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous layout"):
        llm.generate(["hi"])
