"""bf16 linears in our own pairs layout (engine/runner/models/prepack.py, own_pairs_layout): on
CPUs without AVX512-BF16 oneDNN keeps the plain layout and emulates its bf16 GEMM (~4x slower
than the C++ kernel), so with the C++ ops the weights are packed for packed_bf16_linear by us
and it takes every row count. The layout is forced here (own_layout=True, or the CPU check
patched), so these run on any CPU that builds the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_close import assert_close

from engine import LLM, SamplingParams
from engine.config import ANY_ROWS
from engine.runner import model_build
from engine.runner.models import prepack
from engine.runner.models.prepack import PrepackedLinear, pairs_layout
from engine.runner.quant.linear import QuantLinear
from kernels import cpu_fused_ops

ENGINE = dict(
    model="random:tiny", dtype="bfloat16", seed=3, max_num_batched_tokens=64, num_kv_blocks=64,
    block_size=8, max_model_len=256, fused_ops=True, attention_backend="cpu",
)  # fmt: skip
PROMPTS = [[(7 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate([5, 40, 90])]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kernels():
    if (why := cpu_fused_ops.cpu_fused_ops_status()) is not None:
        pytest.skip(f"CPU fused ops unavailable: {why}")
    return cpu_fused_ops


@pytest.fixture
def no_bf16_dot(monkeypatch, kernels):
    """This CPU seen as one without AVX512-BF16 (and AMX), where own_pairs_layout applies."""
    for module in (prepack, model_build):
        monkeypatch.setattr(module, "cpu_has_bf16_dot", lambda: False)
        monkeypatch.setattr(module, "cpu_has_amx", lambda: False)


def test_pairs_layout_is_the_one_the_kernel_reads():
    """Element (n, k) at ((n // 64) * K/2 + k // 2) * 128 + (n % 64) * 2 + k % 2."""
    n, k = 128, 6
    w = torch.arange(n * k, dtype=torch.int16).view(n, k)
    flat = pairs_layout(w).reshape(-1)
    for row, col in [(0, 0), (0, 1), (1, 0), (63, 5), (64, 0), (127, 4), (70, 3)]:
        at = ((row // 64) * (k // 2) + col // 2) * 128 + (row % 64) * 2 + col % 2
        assert flat[at] == w[row, col]


# 1 (decode), 4 (a tile), 64 (a batch-64 step), 65 and 300 (past the oneDNN switch elsewhere:
# here still the kernel).
@pytest.mark.parametrize("rows", [1, 4, 64, 65, 300])
def test_every_row_count_takes_the_kernel(kernels, monkeypatch, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 576, generator=gen).bfloat16()
    b = torch.randn(192, generator=gen).bfloat16()
    layer = PrepackedLinear(w, b, kernels, own_layout=True)
    assert layer.own_layout and layer.few_rows_max == ANY_ROWS
    assert layer.packed_address == layer.packed_weight.data_ptr()
    calls = []
    inner = layer.few_rows
    layer.few_rows = lambda x: calls.append(x.shape[0]) or inner(x)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    ref = (x.float() @ w.float().T + b.float()).bfloat16()
    assert_close(layer(x), ref, torch.bfloat16)
    # A 3-D input (batch, tokens, features) goes through the kernel as rows too.
    assert_close(layer(x.view(1, rows, 576))[0], ref, torch.bfloat16)
    assert calls == [rows, rows]


# Many rows take other tiles than few (without AVX512-BF16: 6-row float32 tiles from 25 rows,
# cpu_f32_tiles.h); each row must still sum as the 4-row pairs tiles sum it. 25, 26 and 38: a
# last pairs tile of 1 or 2 rows (two accumulator sets); 35: of 3 (one); 64 and 100: none.
@pytest.mark.parametrize("rows", [25, 26, 35, 38, 64, 100])
def test_many_rows_sum_each_row_as_the_pairs_tiles_do(kernels, rows):
    if kernels.has_amx_linear():
        pytest.skip("AMX tiles take 5 rows and more here (another summation order)")
    gen = torch.Generator().manual_seed(rows)
    n, k = 128, 576
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    # Two large products that cancel, in input pairs 0 and 1: summed in one accumulator they
    # cancel early; in two (even and odd pairs apart) both sums carry them and lose their low
    # bits, which the bfloat16 outputs then show (else the order hides below their rounding).
    w[:, 0], w[:, 2], x[:, 0], x[:, 2] = 1.0, -1.0, 2.0**20, 2.0**20
    packed = pairs_layout(w)

    def product(x_rows: torch.Tensor) -> torch.Tensor:
        return kernels.packed_bf16_linear(x_rows.contiguous(), packed.data_ptr(), n, k)

    last = rows % 4 if rows % 4 < 3 else 0  # the pairs loop's last tile, if of 1-2 rows
    # a tile of 4 rows alone (one accumulator set)
    expected = [product(x[m0 : m0 + 4]) for m0 in range(0, rows - last, 4)]
    if last:
        expected.append(product(x[rows - last :]))  # 1-2 rows alone: two sets, as such a tile
    assert torch.equal(product(x), torch.cat(expected))


def test_own_layout_refuses_what_the_kernel_cannot_read(kernels):
    w = torch.randn(100, 96).bfloat16()
    with pytest.raises(ValueError, match="multiple of 64"):
        PrepackedLinear(w, None, kernels, own_layout=True)
    with pytest.raises(ValueError, match="the C\\+\\+ kernels"):
        PrepackedLinear(torch.randn(128, 96).bfloat16(), None, None, own_layout=True)
    # Left to decide by the CPU, such a shape keeps oneDNN's layout (its GEMM serves it).
    if prepack.can_prepack(torch.device("cpu"), torch.bfloat16):
        assert not PrepackedLinear(w, None, kernels).own_layout


def test_can_prepack_needs_the_kernels_without_bf16_arithmetic(no_bf16_dot, kernels):
    cpu = torch.device("cpu")
    assert prepack.can_prepack(cpu, torch.bfloat16, kernels)
    assert not prepack.can_prepack(cpu, torch.bfloat16)  # oneDNN alone: the plain layout
    assert not prepack.can_prepack(cpu, torch.float32, kernels)


def test_engine_packs_every_bf16_linear_and_runs_every_step_in_c(no_bf16_dot):
    llm = LLM(**ENGINE)
    runner = llm.engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, PrepackedLinear)]
    assert len(layers) == runner.num_prepacked_linears > 0
    assert all(m.own_layout for m in layers) and runner.model.lm_head in layers
    assert runner.model.decode_step.max_rows == ANY_ROWS
    assert llm.stats().layer_ops == "cpu (fused C++ ops; every step in one C++ call)"
    # The plain weights through F.linear (prepacking off) give the same greedy tokens.
    plain = LLM(**ENGINE, prepack_weights=False)
    assert not any(isinstance(m, PrepackedLinear) for m in plain.engine.runner.model.modules())
    outs = [[o.token_ids for o in e.generate(PROMPTS, PARAMS)] for e in (llm, plain)]
    assert outs[0] == outs[1]


def test_moved_pairs_are_read_where_they_moved(no_bf16_dot):
    """The pairs are a plain tensor, so place_weights_in_huge_pages moves them; finish_weights
    re-binds the few-row call to the new address (a change to the moved tensor shows)."""
    llm = LLM(**ENGINE)  # huge_pages=True: the default
    if llm.engine.runner.weight_huge_page_bytes == 0:
        pytest.skip("the weights did not move into huge pages here")
    layer = llm.engine.runner.model.layers[0].mlp.down_proj
    assert isinstance(layer, PrepackedLinear) and layer.own_layout
    assert layer.packed_address == layer.packed_weight.data_ptr()
    x = torch.randn(1, layer.in_features).bfloat16()
    with torch.inference_mode():
        before = layer(x)
        layer.packed_weight.zero_()
        assert not torch.equal(layer(x), before)
        assert torch.equal(layer(x), torch.zeros_like(before))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_layers_take_every_row_count(no_bf16_dot, quantization):
    """Without bf16 arithmetic, dequantize + oneDNN's emulated GEMM is the slow way at any row
    count: the C++ kernels take them all."""
    if quantization == "int4" and not cpu_fused_ops.has_int4_linear():
        pytest.skip("the int4 kernel needs AVX-512 with VBMI")
    if quantization == "int8" and not cpu_fused_ops.has_int8_rows_linear():
        pytest.skip("int8's many-row kernel needs AVX-512")
    llm = LLM(**ENGINE, quantization=quantization)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.dequant_min_rows == ANY_ROWS for m in layers)
    reference = LLM(**{**ENGINE, "fused_ops": False}, quantization=quantization)
    outs = [[o.token_ids for o in e.generate(PROMPTS, PARAMS)] for e in (llm, reference)]
    assert outs[0] == outs[1]
    x = torch.randn(300, layers[0].in_features).bfloat16()
    with torch.inference_mode():
        assert_close(layers[0](x), F.linear(x.float(), layers[0].dequantized_weight().float()).bfloat16(),
                     torch.bfloat16)  # fmt: skip
