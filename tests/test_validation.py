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
        # Issue 11: values that passed validation but overflowed or underflowed in torch and
        # failed every request of the step.
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": -1.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"temperature": 1e-50}, "temperature"),
        ({"temperature": 0.0099}, "temperature"),
        ({"temperature": 100.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 0.0099}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"top_p": 1e-300}, "top_p"),
        ({"top_p": "0.5"}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        # Issue 13: wrong types raised TypeError or were accepted.
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 5]}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": ["1"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
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
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"enable_chunked_prefill": 0}, "enable_chunked_prefill"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
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


def test_sampling_params_at_their_bounds_are_accepted():
    """The documented edges (engine/request.py) are valid; just past them is not (above)."""
    from engine.request import MAX_SEED, MAX_TOP_K

    SamplingParams(seed=0)
    SamplingParams(seed=MAX_SEED, top_k=MAX_TOP_K, temperature=0.01, repetition_penalty=0.01)
    SamplingParams(temperature=100.0, repetition_penalty=100.0, top_p=1e-6, min_p=1.0)
    SamplingParams(temperature=0, stop="x", stop_token_ids=[0])
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()


def test_bad_generate_inputs_name_the_field(tiny_llm):
    with pytest.raises(ValueError, match=r"^prompt: must be a string or a list of token ids"):
        tiny_llm.generate([1, "a"])
    with pytest.raises(ValueError, match=r"^prompts: must be a string"):
        tiny_llm.generate(None)
    with pytest.raises(ValueError, match=r"^prompts: must be a string"):
        tiny_llm.generate(5)
    with pytest.raises(ValueError, match=r"^prompt: must be a string or a list of token ids"):
        tiny_llm.engine.make_request(5)
    assert not tiny_llm.engine.has_unfinished()


def test_bad_chat_inputs_name_messages():
    llm = LLM(dtype="float32", max_model_len=256, num_kv_blocks=32)  # the embedded model
    with pytest.raises(ValueError, match=r"^messages: must be a non-empty list"):
        llm.chat([])
    with pytest.raises(ValueError, match=r"^messages: each needs a string 'content'"):
        llm.chat([{"role": "user"}])
    with pytest.raises(ValueError, match=r"^messages: role must be one of system, user"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ValueError, match=r"^messages: each needs a string 'content'"):
        llm.chat([[{"role": "user", "content": None}]])


@pytest.mark.parametrize("override", ["num_layers=-1", "layers=0", "hidden=abc", "kv_heads=0"])
def test_bad_random_model_override(override):
    with pytest.raises(ValueError, match=r"^model: (bad )?random-model override"):
        LLM(model=f"random:tiny,{override}")


@pytest.mark.slow  # a subprocess per entry point
@pytest.mark.parametrize("module", ["engine.serving.server", "app"])
def test_bad_model_path_is_one_error_line(module, tmp_path):
    """A bad --model prints `error: ...` and exits 2, without a traceback."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "config.json").write_text("{not json")
    root = Path(__file__).resolve().parents[1]
    for model in ["/no/such/model", str(tmp_path), "random:tiny,num_layers=-1"]:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--model", model, "--device", "cpu"],
            capture_output=True, text=True, timeout=120, cwd=root,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: model") or proc.stderr.startswith("error: "), (
            proc.stderr
        )
        assert "Traceback" not in proc.stderr, proc.stderr
