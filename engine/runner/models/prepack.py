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
"""

from __future__ import annotations

import torch
from torch import nn

PREPACK_DTYPES = (torch.bfloat16, torch.float16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU pack `dtype` linear weights for oneDNN."""
    if device.type != "cpu" or dtype not in PREPACK_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


class PrepackedLinear(nn.Module):
    """y = x @ W.T (+ b) with W held in oneDNN's blocked layout (unreadable as a plain matrix:
    the unpacked weight is gone after packing)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only steers the blocking; any number of rows works with it.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.register_buffer("packed_weight", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (and a tied LM head) by a PrepackedLinear; returns
    how many were packed. Call after loading and quantizing, before the first forward."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, linear in targets:
        setattr(parent, name, PrepackedLinear(linear.weight, linear.bias))
    count = len(targets)
    if getattr(model, "lm_head", "absent") is None:  # tied to the embedding table
        model.lm_head = PrepackedLinear(model.embed_tokens.weight, None)
        count += 1
    return count
