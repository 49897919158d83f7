"""The one-call C++ decode step (kernels/cpu_decode_step.h, engine/runner/models/decode_step.py):
bit-identical hidden states to the layer-by-layer path it replaces, used for the steps it can
take and only those, built only where every piece has a C++ kernel, and bad input refused."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ANY_ROWS
from engine.runner.models.decode_step import CpuDecodeStep
from kernels import cpu_attention, cpu_fused_ops

PROMPTS = [[(7 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate([5, 19, 3, 30])]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
COMMON = dict(
    model="random:tiny", dtype="bfloat16", max_num_batched_tokens=32, num_kv_blocks=48,
    block_size=8, max_model_len=128, fused_ops=True, attention_backend="cpu",
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    for status in (cpu_fused_ops.cpu_fused_ops_status, cpu_attention.cpu_kernel_status):
        if (why := status()) is not None:
            pytest.skip(f"CPU kernels unavailable: {why}")


def _llm(quantization: str, **overrides) -> LLM:
    if quantization == "int4" and not cpu_fused_ops.has_int4_linear():
        pytest.skip("the int4 few-row kernel needs AVX-512 with VBMI")
    llm = LLM(quantization=quantization, **{**COMMON, **overrides})
    layers = llm.engine.runner.model.layers
    if quantization == "none" and layers[0].self_attn.o_proj.few_rows is None:
        # With AMX, oneDNN packs a 64-row weight (this tiny model's o_proj) in another layout
        # than the packed kernel reads: those layers keep oneDNN, and no step is built.
        pytest.skip("oneDNN packs this model's 64-row weights in another layout on this CPU")
    return llm


def _record_hidden(llm: LLM) -> list[torch.Tensor]:
    """Every forward pass's output (the final normed hidden states), in step order."""
    outputs: list[torch.Tensor] = []
    llm.engine.runner.model.register_forward_hook(lambda m, a, out: outputs.append(out.clone()))
    return outputs


_CAPSULE_NAMES: list[bytes] = []  # PyCapsule keeps a pointer to its name: keep it alive


def _capsule(name: bytes) -> object:
    """A PyCapsule named `name` around a dummy pointer."""
    _CAPSULE_NAMES.append(name)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = (
        ctypes.py_object,
        [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p],
    )
    return new(id(name), name, None)


class _CountingStep:
    """Stands in for the compiled step: counts its forward calls and the tokens of each."""

    def __init__(self, step) -> None:
        self.inner, self.tokens = step, []

    def forward(self, hidden, *args):
        self.tokens.append(hidden.shape[0])
        return self.inner.forward(hidden, *args)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_step_hidden_states_are_the_layer_paths_bit_for_bit(quantization):
    """Same kernels, same order, same arguments: every step's hidden states equal (not close
    to) those of the Python layers with their few-row calls bound, and so do the tokens."""
    runs = {}
    for use_step in (True, False):
        llm = _llm(quantization)
        model = llm.engine.runner.model
        assert isinstance(model.decode_step, CpuDecodeStep)
        # The header says what runs the layers (every step where the kernels take any rows:
        # CPUs without AVX512-BF16, prepack.own_pairs_layout).
        rows = model.decode_step.max_rows
        steps = "every step" if rows == ANY_ROWS else f"steps of <= {rows} tokens"
        assert llm.stats().layer_ops == f"cpu (fused C++ ops; {steps} in one C++ call)"
        assert all(layer.few_row_calls is not None for layer in model.layers)
        if not use_step:
            model.decode_step = None  # the layer-by-layer path, few-row calls still bound
        hidden = _record_hidden(llm)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        runs[use_step] = (tokens, hidden)
    (tokens, hidden), (ref_tokens, ref_hidden) = runs[True], runs[False]
    assert tokens == ref_tokens
    assert len(hidden) == len(ref_hidden) > PARAMS.max_tokens
    for out, ref in zip(hidden, ref_hidden, strict=True):
        assert torch.equal(out, ref)


def test_step_serves_the_few_row_steps_and_the_layers_the_rest():
    llm = _llm("int8")
    model = llm.engine.runner.model
    step = model.decode_step
    counting = _CountingStep(step.step)
    step.step = counting
    layer_calls: list[int] = []
    model.layers[0].register_forward_hook(lambda m, args, out: layer_calls.append(args[0].shape[0]))
    llm.generate(PROMPTS, PARAMS)
    # Every step (prefill chunks of <= 32 tokens, then decodes) fits the kernels' rows.
    assert step.max_rows >= COMMON["max_num_batched_tokens"]
    assert layer_calls == [] and 1 in counting.tokens and max(counting.tokens) > 4
    # Steps above max_rows go through the layers (as the few-row calls do), with no step call.
    step.max_rows = 4
    counting.tokens.clear()
    llm.generate([[11 + i for i in range(20)]], PARAMS)
    assert layer_calls and min(layer_calls) > 4
    assert counting.tokens and max(counting.tokens) <= 4


@pytest.mark.parametrize(
    ("why", "overrides"),
    [
        ("enforce_eager: the modules as written", {"enforce_eager": True}),
        ("the torch layer ops", {"fused_ops": False}),
        ("quantized K/V, stored by the torch path", {"kv_cache_dtype": "int8"}),
        ("the torch attention backend", {"attention_backend": "torch"}),
    ],
)
def test_no_step_without_every_kernel_and_the_same_tokens(why, overrides):
    reference = [o.token_ids for o in _llm("int8").generate(PROMPTS, PARAMS)]
    llm = LLM(quantization="int8", **{**COMMON, **overrides})
    assert llm.engine.runner.model.decode_step is None, why
    assert "one C++ call" not in llm.stats().layer_ops
    if "kv_cache_dtype" not in overrides:  # int8 K/V round the cache: other tokens may come
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference


def test_step_rejects_bad_inputs_naming_them():
    llm = _llm("int8")
    runner = llm.engine.runner
    step, model = runner.model.decode_step, runner.model
    ext = cpu_fused_ops.load_extension()
    arch = runner.arch
    with pytest.raises(ValueError, match="capsule"):  # another table (an older build's)
        ext.DecodeStep(_capsule(b"cpu_paged_attention.api.v0"), arch.num_heads,
                       arch.num_kv_heads, arch.head_dim, 1.0, model.norm.weight.detach(), 1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="heads"):
        ext.DecodeStep(cpu_attention.load_extension().api(), 3, 2, arch.head_dim, 1.0,
                       model.norm.weight.detach(), 1e-5)  # fmt: skip
    # One decode token of one sequence at position 0, with its slot and a one-block table.
    hidden = torch.zeros(1, arch.hidden_size, dtype=torch.bfloat16)
    positions = torch.zeros(1, dtype=torch.long)
    keys, values = [c[0] for c in runner.kv_caches], [c[1] for c in runner.kv_caches]
    table = torch.zeros(1, 1, dtype=torch.int32)
    seq_lens = torch.ones(1, dtype=torch.int32)
    query_start = torch.tensor([0, 1], dtype=torch.int32)

    def forward(keys, values, slots):
        step.step.forward(hidden, positions, model.rope_cos, model.rope_sin, keys, values,
                          slots, table, seq_lens, query_start)  # fmt: skip

    with pytest.raises(ValueError, match="one cache per layer"):
        forward(keys[:1], values[:1], positions)
    with pytest.raises(ValueError, match="slot_mapping"):  # from the attention extension
        forward(keys, values, torch.tensor([10**9]))
    # The engine goes on after the refused calls.
    assert len(llm.generate([[5, 6, 7]], PARAMS)[0].token_ids) == PARAMS.max_tokens
