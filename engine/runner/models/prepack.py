"""Linear weights prepacked once for oneDNN on CPU (issue 17: fewer costs per step).

On CPU, torch runs a bfloat16/float16 `F.linear` through oneDNN, which wants the weight in its
own blocked layout: every call reorders the plain [N, K] weight into that layout first, then
multiplies. At decode's few rows the reorder is a large part of the call (it reads and writes
the whole weight again). Reordering once at load (`mkldnn._reorder_linear_weight`) and calling
`mkldnn._linear_pointwise` on the packed weight skips it; the multiplication is the same oneDNN
kernel, so the outputs are bit-identical to F.linear's (tests/test_prepack.py checks that at
1-512 rows). This is what inductor's CPU path does with `freezing=True`.

Only 16-bit weights on CPU, where F.linear already is oneDNN: float32 goes through MKL, whose
results a oneDNN kernel would not reproduce bit for bit (the parity tests run in float32).
Quantized layers keep their own kernels. A tied LM head (SmolLM2's) gets a packed copy of the
embedding table, since the embedding lookup needs the plain layout: 2 bytes x vocab x hidden
more memory (57 MB for SmolLM2-135M) for the ~10 % of a decode step the head takes.

With the fused C++ ops (layer_ops.py), a bf16 layer's few rows (up to packed_gemv_max_rows():
decode, verify steps, batch-64 decode; with AMX tiles up to 256 rows) go to a C++ kernel that
reads the same packed bytes, faster than oneDNN's own call there (kernels/README.md): same
products, summed in another order, so within a bf16 rounding of oneDNN rather than
bit-identical.
`packed_layout_matches` proves the layout per shape first; anything else stays on oneDNN.

A CPU without AVX512-BF16 (and so without AMX: Skylake-X to Ice Lake servers, or a guest whose
hypervisor hides the flag) has no bfloat16 arithmetic in hardware: there oneDNN leaves the
weight in its plain layout and emulates its bf16 GEMM. Over SmolLM2's 30 decoder layers on a
2-core cloud Xeon of that kind (2026-12-07) it took 14.8 / 241 / 1,732 ms at 1 / 64 / 512 rows,
the C++ kernel on the pairs layout (its products emulated too, cpu_simd.h) 8.6 / 59 / 458. So
with the C++ ops there (`own_pairs_layout`) the weight is packed into that layout here, by
torch, and the kernel takes every row count: no oneDNN call, and no second copy.
"""

from __future__ import annotations

import ctypes
import functools
from types import ModuleType

import torch
from torch import nn

from engine.config import ANY_ROWS

PREPACK_DTYPES = (torch.bfloat16, torch.float16)
# Rows at or below which a bf16 layer multiplies with the C++ kernel that reads oneDNN's packed
# weight in place (kernels/cpu_fused_ops.cpp, packed_bf16_linear), above them oneDNN's GEMM.
# Measured on a 2-core EPYC (AVX512-BF16, no AMX), SmolLM2's layers streamed from DRAM, the
# kernel with vdpbf16ps against oneDNN's call on the same packed weight: 1 row 8.0 vs 11.1 ms,
# 8 rows 8.7 vs 13.8, 32 rows 15.9 vs 19.7, 64 rows 27.4 vs 35.3, 128 rows 53.5 vs 54.5: so up
# to a batch-64 decode step. A CPU with AMX tiles runs oneDNN's GEMM several times faster on
# many rows: there the kernel takes decode's few rows (as first measured: 1.4x at one row,
# even at 8), and from 5 rows multiplies on AMX tiles itself (cpu_amx_linear.h, the packed
# weight read in place as the B operand) where the extension has them: SmolLM2's 30 layers
# streamed from DRAM on a 2-core Xeon, min of 9 interleaved runs, kernel vs oneDNN on the same
# packed weight: 8 rows 12.5 vs 15.5 ms, 32 rows 14.7 vs 19.2, 64 rows 19.9 vs 25.3, 128 rows
# 26.6 vs 35.8, 256 rows 39.2 vs 40.7; oneDNN ahead at 512 (84 vs 76).
PACKED_GEMV_MAX_ROWS = 64
PACKED_GEMV_MAX_ROWS_AMX = 4  # AMX CPU, extension built without tiles: oneDNN from 5 rows
PACKED_AMX_MAX_ROWS = 256  # AMX CPU and tiles in the extension
PACK_BLOCK_ROWS = 64  # output rows per block of the packed layout (see packed_layout_matches)


def can_prepack(
    device: torch.device, dtype: torch.dtype, kernels: ModuleType | None = None
) -> bool:
    """Whether `dtype` linear weights get a packed layout here: oneDNN's (this torch build and
    CPU pack them), or, on a CPU without AVX512-BF16, bf16 in ours when the C++ ops `kernels`
    run the model (oneDNN keeps the plain layout there: own_pairs_layout)."""
    if device.type != "cpu" or dtype not in PREPACK_DTYPES:
        return False
    if dtype == torch.bfloat16 and not cpu_has_bf16_dot():
        return kernels is not None
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


class PrepackedLinear(nn.Module):
    """y = x @ W.T (+ b) with W held in oneDNN's blocked layout, or in the C++ kernel's pairs
    layout on CPUs without AVX512-BF16 (unreadable as a plain matrix either way: the unpacked
    weight is gone after packing)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: ModuleType | None = None,
        own_layout: bool | None = None,
    ) -> None:
        """`own_layout`: pack into our pairs layout (True: needs `kernels`, 64-row blocks, even
        K) or oneDNN's (False); None decides by this CPU (own_pairs_layout)."""
        super().__init__()
        self.out_features, self.in_features = n, k = weight.shape
        plain = weight.detach().contiguous()
        # The C++ ops (kernels/cpu_fused_ops.py) when the model runs them and the packed layout
        # is the one their matrix-vector kernel reads: oneDNN's, or ours (own_pairs_layout).
        if own_layout is None:
            own_layout = own_pairs_layout(n, k, weight.dtype, kernels)
        if own_layout and (kernels is None or n % PACK_BLOCK_ROWS or k % 2):
            raise ValueError(
                f"own_layout: the C++ kernels and a [N, K] weight with N a multiple of "
                f"{PACK_BLOCK_ROWS} and K even are needed, got {kernels=} and [{n}, {k}]"
            )
        self.own_layout = own_layout
        self.gemv_kernels = kernels if self.own_layout else None
        if self.own_layout:
            packed = pairs_layout(plain)  # a plain tensor: it may move (huge pages), see rebind
        else:
            # The batch-size hint only steers the blocking; any number of rows works with it.
            packed = torch.ops.mkldnn._reorder_linear_weight(plain, 1)
            if kernels is not None and packed_layout_matches(n, k, weight.dtype):
                self.gemv_kernels = kernels
        self.register_buffer("packed_weight", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.few_rows_max = ANY_ROWS if self.own_layout else packed_gemv_max_rows(kernels)
        self.packed_address = 0
        # The few-rows call with this layer's arguments bound: ~1 us of attribute reads per
        # call saved, a tenth of a small layer's product at batch 1.
        self.few_rows = None
        self.rebind_few_rows()

    def unbind_few_rows(self) -> bool:
        """Drop the few-rows call (it holds the packed buffer's address); returns whether one
        was bound. Our pairs layout is a plain tensor that place_weights_in_huge_pages moves."""
        bound = self.few_rows is not None
        self.few_rows = None
        return bound

    def rebind_few_rows(self) -> None:
        """Bind the few-rows call to the packed buffer where it is now (none without kernels)."""
        if self.gemv_kernels is None:
            return
        packed = self.packed_weight
        if self.own_layout:
            self.packed_address = packed.data_ptr()
        else:  # oneDNN's opaque tensor: never moved (host_memory skips it)
            self.packed_address = torch.ops.mkldnn.data_ptr(packed)
        kernel, address = self.gemv_kernels.packed_bf16_linear, self.packed_address
        n, k = self.out_features, self.in_features
        self.few_rows = lambda x: kernel(x, address, n, k)

    def step_linear(self) -> object | None:
        """The few-row kernel's weights for the C++ decode step (decode_step.py), or None."""
        if self.few_rows is None:
            return None
        return self.gemv_kernels.load_extension().packed_bf16_call(
            self.packed_weight, self.packed_address, self.out_features, self.in_features
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = self.few_rows
        if few_rows is not None and x.dim() == 2 and x.shape[0] <= self.few_rows_max:
            y = few_rows(x)
            return y if self.bias is None else y + self.bias
        if self.own_layout:  # only the C++ kernel reads our layout: every shape goes there
            rows = x.reshape(-1, self.in_features).contiguous()
            y = few_rows(rows).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        layout = "pairs layout" if self.own_layout else "prepacked"
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}"


def prepack_linears(model: nn.Module, kernels: ModuleType | None = None) -> int:
    """Replace every nn.Linear of `model` (and a tied LM head) by a PrepackedLinear; returns
    how many were packed. Call after loading and quantizing, before the first forward.
    `kernels`: the C++ ops module when the model runs it (few-row products, see
    PACKED_GEMV_MAX_ROWS)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, linear in targets:
        setattr(parent, name, PrepackedLinear(linear.weight, linear.bias, kernels))
    count = len(targets)
    if getattr(model, "lm_head", "absent") is None:  # tied to the embedding table
        model.lm_head = PrepackedLinear(model.embed_tokens.weight, None, kernels)
        count += 1
    return count


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16."""
    return "amx_bf16" in _cpu_flags()


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16; every AMX CPU has it)."""
    return "avx512_bf16" in _cpu_flags()


def own_pairs_layout(
    out_features: int, in_features: int, dtype: torch.dtype, kernels: ModuleType | None
) -> bool:
    """Whether a bf16 [N, K] linear is packed into the C++ kernel's pairs layout by us, the
    kernel taking every row count: with the C++ ops, on a CPU without AVX512-BF16 (oneDNN's
    bf16 GEMM emulated there, ~4x slower; module docstring), whole 64-row blocks, even K."""
    return (
        kernels is not None
        and dtype == torch.bfloat16
        and not cpu_has_bf16_dot()
        and out_features % PACK_BLOCK_ROWS == 0
        and in_features % 2 == 0
    )


def pairs_layout(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the pairs layout packed_bf16_linear reads: 64-row blocks; inside a block, for
    each pair of inputs (2p, 2p + 1), the 64 rows' two values side by side."""
    n, k = weight.shape
    blocks = weight.view(n // PACK_BLOCK_ROWS, PACK_BLOCK_ROWS, k // 2, 2)
    return blocks.transpose(1, 2).contiguous()


def packed_gemv_max_rows(kernels: ModuleType | None = None) -> int:
    """Rows up to which a packed bf16 layer takes the C++ kernel of `kernels` (the fused ops'
    module; see PACKED_GEMV_MAX_ROWS)."""
    if not cpu_has_amx():
        return PACKED_GEMV_MAX_ROWS
    if kernels is not None and kernels.has_amx_linear():
        return PACKED_AMX_MAX_ROWS
    return PACKED_GEMV_MAX_ROWS_AMX


@functools.cache
def packed_layout_matches(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a bf16 [N, K] weight the way packed_bf16_linear reads it: blocks
    of 64 output rows; inside a block, for each pair of inputs (2p, 2p + 1), the 64 rows' two
    values side by side. That is oneDNN's layout for AVX512-BF16 dot products; other CPUs and
    shapes pack otherwise (or pad), so a random weight of this very shape is packed once and
    its bytes compared with that layout bit for bit. Cached per shape."""
    n, k = out_features, in_features
    if dtype != torch.bfloat16 or n % PACK_BLOCK_ROWS or k % 2:
        return False
    probe = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 7919 + k))
    probe = probe.to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(probe, 1)
    if torch.ops.mkldnn._nbytes(packed) != n * k * probe.element_size():
        return False  # padded: another blocking
    raw = (ctypes.c_int16 * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed))
    actual = torch.frombuffer(raw, dtype=torch.int16)
    expected = probe.view(n // PACK_BLOCK_ROWS, PACK_BLOCK_ROWS, k // 2, 2).transpose(1, 2)
    return bool(torch.equal(actual, expected.contiguous().view(torch.int16).view(-1)))
