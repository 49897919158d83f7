"""Quantized linear layers: the weight stays in its small format; each call picks a path by the
number of rows M (tokens, or logit rows for the LM head):

- M < dequant_min_rows: the CPU weight-only kernel (kernels/weight_only_cpu.py). A decode step
  is matrix-vector work bound by weight bytes, which the kernel cuts 2-4x.
- otherwise: dequantize into a scratch shared by all layers, then the 16-bit GEMM. Many rows
  make the GEMM compute-bound, where the weight-only kernels are several times slower than the
  16-bit matmul (they do not use the blocked 16-bit GEMM paths); the dequantization costs one
  pass over the weight per call, amortized over M rows. The scratch holds the largest decoder
  layer; a bigger matrix (the LM head) is dequantized and multiplied in row chunks, so the
  scratch never holds a second 16-bit LM head.

On CUDA the weight-only path is a Triton kernel (kernels/w8a16_gemm.py, w4a16_gemm.py: the
same stored bytes, dequantized in registers, split-K for few rows); on other devices every call
takes the dequantize path.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ANY_ROWS
from engine.runner.quant.formats import Int4Weight, Int8Weight
from kernels.int4_pack import INT4_BLOCK_ROWS, pack_int4, unpack_int4
from kernels.weight_only_cpu import int4_weight_only_mm, int8_weight_only_mm

logger = logging.getLogger(__name__)


class DequantScratch:
    """One flat 16-bit buffer that every quantized layer of a model dequantizes into (one
    layer at a time: the engine runs one forward pass at a time per model)."""

    def __init__(self, num_elements: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(num_elements, dtype=dtype, device=device)

    @property
    def num_elements(self) -> int:
        return self.buffer.numel()

    def matrix(self, rows: int, cols: int) -> torch.Tensor:
        return self.buffer[: rows * cols].view(rows, cols)


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W held quantized; subclasses store W and dequantize rows."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        scratch: DequantScratch,
        dequant_min_rows: int,
    ) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.scratch = scratch
        # Rows at and above which the dequantize + GEMM path runs (0: always).
        self.dequant_min_rows = dequant_min_rows
        # Which weight-only kernel the small-M path calls: "triton" on CUDA, "cpu" (aten's)
        # otherwise; tests set "triton" on CPU to run the Triton kernels under the interpreter.
        self.weight_only_kernel = "triton" if scratch.buffer.device.type == "cuda" else "cpu"
        # The C++ CPU ops (kernels/cpu_fused_ops.py) when the model runs them (fused_ops) and
        # they take this layer's shape: one-pass dequantization for the many-rows path (and
        # int8's few-row kernel); None = the torch ops. Set with use_cpu_kernels.
        self.cpu_kernels = None
        # The few-rows call with this layer's tensors bound (set by use_cpu_kernels once the
        # weights are final), or None for weight_only_mm: at batch 1 a layer's call is ~5 us
        # of kernel, and each buffer read through nn.Module.__getattr__ costs ~0.5-1 us.
        self.few_rows = None
        # From this many rows the few-rows kernel quantizes x to int8 (use_int8_activations);
        # 0 = weight-only.
        self.int8_activations_min_rows = 0
        self.chunk_rows = self._chunk_rows()

    def use_cpu_kernels(self, kernels: ModuleType | None) -> None:
        """Run the C++ ops where they take this layer's shape (decided once, not per call);
        weight-only until use_int8_activations."""
        self.cpu_kernels = kernels if kernels is not None and self.cpu_kernels_fit() else None
        self.few_rows = None
        self.int8_activations_min_rows = 0

    def cpu_kernels_fit(self) -> bool:
        """Whether the C++ ops take this layer's shape."""
        raise NotImplementedError

    def use_int8_activations(self, min_rows: int) -> None:
        """From `min_rows` rows quantize x to int8 and multiply with integer dot products
        (kernels/cpu_int8_act_linear.h: W8A8 / W4A8), every row count through the C++ kernel
        (its many-rows products are ahead of dequantize + GEMM too). Needs the few-rows kernel
        bound (use_cpu_kernels first); the kernel falls back to weight-only products where the
        CPU or the shape does not fit."""
        if self.few_rows is None:
            raise ValueError("int8_activations: this layer has no CPU kernel bound")
        self.int8_activations_min_rows = min_rows
        self.dequant_min_rows = ANY_ROWS  # every row count takes few_rows
        self.few_rows = self._few_rows_call()

    def _few_rows_call(self):
        """The C++ few-rows call with this layer's tensors (and int8 activations) bound."""
        raise NotImplementedError

    @property
    def few_rows_max(self) -> int:
        """The most rows the few-rows call takes: those below dequant_min_rows, or ANY_ROWS
        with int8 activations."""
        rows = self.dequant_min_rows
        return ANY_ROWS if rows == ANY_ROWS else rows - 1

    def unbind_few_rows(self) -> bool:
        """Drop the few-rows call (and with it its references to the layer's tensors, so a
        tensor that moves is freed as it moves); returns whether one was bound."""
        bound = self.few_rows is not None
        self.few_rows = None
        return bound

    def rebind_few_rows(self) -> None:
        """Bind the few-rows call again, to the layer's current tensors (after they moved:
        host_memory.place_weights_in_huge_pages)."""
        self.few_rows = self._few_rows_call()

    def _chunk_rows(self) -> int:
        """Output rows dequantized at once: all, or what fits the scratch (whole int4 blocks)."""
        fit = self.scratch.num_elements // self.in_features
        if fit >= self.out_features:
            return self.out_features
        return max(INT4_BLOCK_ROWS, fit // INT4_BLOCK_ROWS * INT4_BLOCK_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] < self.dequant_min_rows and self.bias is None:
            # Decode's call, kept short: Python here costs ~1 us a line, 121 times a step.
            few_rows = self.few_rows
            if few_rows is not None:
                return few_rows(x.contiguous())
            return self.weight_only_mm(x.contiguous())
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] < self.dequant_min_rows:
            y = self.weight_only_mm(x2.contiguous())  # x's dtype: the model's, as the scales
        else:
            y = self.dequant_mm(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def dequant_mm(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if self.chunk_rows == n:
            return self.dequant_rows_mm(x, 0, n)
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, self.chunk_rows):
            end = min(n, start + self.chunk_rows)
            y[:, start:end] = self.dequant_rows_mm(x, start, end)
        return y

    def dequant_rows_mm(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """x @ W[start:end].T through the scratch: [M, end - start]."""
        w = self.dequantize_rows(start, end, self.scratch.matrix(end - start, self.in_features))
        return F.linear(x, w)

    def weight_only_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_rows(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [start, end) of W in out's dtype, written into out [end - start, K]."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """W in float32 [N, K] from the stored values: what every path multiplies by."""
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        """Bytes of the stored weight with its scales and zeros (bias excluded)."""
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))


class Int8Linear(QuantLinear):
    def __init__(self, w: Int8Weight, bias, dtype, scratch, dequant_min_rows) -> None:
        n, k = w.qweight.shape
        super().__init__(n, k, bias, scratch, dequant_min_rows)
        self.register_buffer("qweight", w.qweight.contiguous())  # int8 [N, K]
        self.register_buffer("scales", w.scales.to(dtype))  # [N], the kernel wants x's dtype
        if self.weight_only_kernel == "cpu" and dequant_min_rows > 0:  # the checks, once
            int8_weight_only_mm(torch.zeros(1, k, dtype=dtype), self.qweight, self.scales)

    def weight_only_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_only_kernel == "triton":
            from kernels.w8a16_gemm import w8a16_gemm  # imports Triton: only when used

            return w8a16_gemm(x, self.qweight, self.scales)
        if self.few_rows is not None:
            # The C++ kernel prefetches the weight rows: 2x aten's bytes/s from DRAM at batch 1
            # (kernels/cpu_fused_ops.cpp, int8_linear; bound by use_cpu_kernels).
            return self.few_rows(x)
        # aten directly: int8_weight_only_mm's checks on the weight ran once, at load (their
        # ~4 us per call were a tenth of a batch-1 step's matmul time).
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def cpu_kernels_fit(self) -> bool:
        return self.in_features % 16 == 0  # whole vectors of a row

    def use_cpu_kernels(self, kernels: ModuleType | None) -> None:
        super().use_cpu_kernels(kernels)
        if self.cpu_kernels is not None and self.weight_only_kernel == "cpu":
            self.few_rows = self._few_rows_call()

    def _few_rows_call(self):
        kernel, qweight, scales = self.cpu_kernels.int8_linear, self.qweight, self.scales
        a8_rows = self.int8_activations_min_rows
        return lambda x: kernel(x, qweight, scales, a8_rows)

    def step_linear(self) -> object | None:
        """The few-row kernel's weights for the C++ decode step (decode_step.py), or None."""
        if self.few_rows is None:
            return None
        return self.cpu_kernels.load_extension().int8_call(
            self.qweight, self.scales, self.int8_activations_min_rows
        )

    @property
    def rows_kernel(self) -> bool:
        """Whether the few-rows kernel also takes many rows (kernels/cpu_int8_rows.h: bfloat16
        on AVX-512 CPUs, whole 16-row groups and 32-input steps)."""
        return (
            self.few_rows is not None
            and self.scales.dtype == torch.bfloat16
            and self.out_features % 16 == 0
            and self.in_features % 32 == 0
            and self.cpu_kernels.has_int8_rows_linear()
        )

    def dequantize_rows(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            self.cpu_kernels.dequant_int8(out, self.qweight[start:end], self.scales[start:end])
            return out
        out.copy_(self.qweight[start:end])
        return out.mul_(self.scales[start:end, None])

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


class Int4Linear(QuantLinear):
    def __init__(self, w: Int4Weight, bias, dtype, scratch, dequant_min_rows) -> None:
        n, k = w.qweight.shape
        super().__init__(n, k, bias, scratch, dequant_min_rows)
        self.group_size = w.group_size
        self.register_buffer("packed", pack_int4(w.qweight))  # uint8 [N, K/2]
        # The kernel's convention: w = (q - 8) * s + zf, so zf = (8 - z) * s.
        zf = (8 - w.zeros.float()) * w.scales
        scale_and_zero = torch.stack([w.scales.t(), zf.t()], dim=-1)  # [K/G, N, 2]
        self.register_buffer("scale_and_zero", scale_and_zero.to(dtype).contiguous())
        if self.weight_only_kernel == "cpu" and dequant_min_rows > 0:  # the checks, once
            x = torch.zeros(1, k, dtype=dtype)
            int4_weight_only_mm(x, self.packed, self.scale_and_zero, self.group_size)

    def weight_only_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_only_kernel == "triton":
            from kernels.w4a16_gemm import w4a16_gemm, w4a16_supports  # imports Triton

            if not w4a16_supports(self.out_features, self.group_size):
                return self.dequant_mm(x)
            return w4a16_gemm(x, self.packed, self.scale_and_zero, self.group_size)
        if self.few_rows is not None:  # kernels/cpu_int4_linear.h, bound by use_cpu_kernels
            return self.few_rows(x)
        # aten directly: int4_weight_only_mm's checks ran once, at load (see Int8Linear).
        return torch._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scale_and_zero
        )

    def cpu_kernels_fit(self) -> bool:
        # The C++ dequantization writes whole 64-row blocks and 16-element vectors of a group.
        return self.out_features % INT4_BLOCK_ROWS == 0 and self.group_size % 16 == 0

    @property
    def bf16_kernel(self) -> bool:
        """Whether few rows go to kernels/cpu_int4_linear.h (else aten's kernel or Triton)."""
        return self.few_rows is not None

    def use_cpu_kernels(self, kernels: ModuleType | None) -> None:
        super().use_cpu_kernels(kernels)
        # The C++ few-rows kernel takes bfloat16 on AVX-512 CPUs with VBMI; float32 and
        # float16 models (and other CPUs) keep aten's.
        if (
            self.cpu_kernels is not None
            and self.weight_only_kernel == "cpu"
            and self.scale_and_zero.dtype == torch.bfloat16
            and self.cpu_kernels.has_int4_linear()
        ):
            # Nibbles to bfloat16 by bit operations and vdpbf16ps (kernels/cpu_int4_linear.h):
            # ~1.5x aten's kernel at batch 1, which is bound by its float32 arithmetic.
            self.few_rows = self._few_rows_call()

    def _few_rows_call(self):
        kernel, packed, params = self.cpu_kernels.int4_linear, self.packed, self.scale_and_zero
        group_size, a8_rows = self.group_size, self.int8_activations_min_rows
        return lambda x: kernel(x, packed, params, group_size, a8_rows)

    def step_linear(self) -> object | None:
        """The few-row kernel's weights for the C++ decode step (decode_step.py), or None."""
        if self.few_rows is None:
            return None
        return self.cpu_kernels.load_extension().int4_call(
            self.packed, self.scale_and_zero, self.group_size, self.int8_activations_min_rows
        )

    def dequant_rows_mm(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.cpu_kernels is None:
            return super().dequant_rows_mm(x, start, end)
        # The C++ kernel writes the weight transposed, [K, rows]: one packed k of a 64-row
        # block is 64 consecutive elements there (whole-vector stores), and x @ W.T is then a
        # plain matmul with it. (Chunks start at multiples of 64: chunk_rows.)
        wt = self.scratch.matrix(self.in_features, end - start)
        self.cpu_kernels.dequant_int4(wt, self.packed, self.scale_and_zero, self.group_size,
                                      start, end - start)  # fmt: skip
        return x @ wt

    def dequantize_rows(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        # start is a multiple of 64 (chunk_rows), so the rows' bytes are whole packed blocks
        # (plus, at the end, the tail). Unpacked straight into [rows, K] order (two strided
        # copies), then scaled per group with contiguous parameters: measured ~2x faster
        # than unpack_int4 + broadcasting strided scales on a 2-core CPU.
        rows, k, g = end - start, self.in_features, self.group_size
        full = rows // INT4_BLOCK_ROWS * INT4_BLOCK_ROWS
        q = torch.empty(rows, k, dtype=torch.uint8, device=out.device)
        if full:
            packed = self.packed[start : start + full].view(-1, k, 32)  # [blocks, K, 32]
            blocks = q[:full].view(-1, INT4_BLOCK_ROWS, k)
            blocks[:, :32] = (packed & 15).transpose(1, 2)
            blocks[:, 32:] = (packed >> 4).transpose(1, 2)
        if rows > full:
            q[full:] = unpack_int4(self.packed[start + full : end])
        params = self.scale_and_zero[:, start:end].transpose(0, 1).contiguous()  # [rows, K/G, 2]
        scales = params[..., 0:1]
        offsets = params[..., 1:2] - 8 * scales  # (q - 8) * s + zf = q * s + (zf - 8 s)
        out.copy_(q)
        out.view(rows, k // g, g).mul_(scales).add_(offsets)
        return out

    def dequantized_weight(self) -> torch.Tensor:
        q = unpack_int4(self.packed).float()
        n, k, g = self.out_features, self.in_features, self.group_size
        s = self.scale_and_zero[..., 0].float().t()[..., None]
        zf = self.scale_and_zero[..., 1].float().t()[..., None]
        return ((q.view(n, k // g, g) - 8) * s + zf).view(n, k)


@functools.cache
def cpu_int4_layout_matches() -> bool:
    """Whether aten packs int4 for its CPU kernel the way kernels/int4_pack.py does (true on
    AVX-512 builds; AVX2 builds use another layout): checked once on a probe with a tail."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (80, 64), dtype=torch.int32, generator=gen)
    aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    ok = torch.equal(aten.view(torch.uint8).view(80, 32), pack_int4(q.to(torch.uint8)))
    if not ok:
        logger.warning("int4: this CPU's kernel layout differs; using dequantize + GEMM only")
    return ok
