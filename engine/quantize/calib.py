"""Calibration samples for AWQ, local only, and the one AutoAWQ function that would need the
`datasets` package.

The text is the second half of engine.quality's held-out text (CPython's pydoc topics): the
perplexity harness and Compare score windows from its beginning (at most a few ten thousand
characters), so calibrating on the second half keeps the held-out measure held out.

AutoAWQ's quantizer imports `awq.utils.calib_data`, which imports `datasets` at module top
(for hub downloads we never make); `datasets` is not one of our dependencies. We register our
own `awq.utils.calib_data` before autoawq is imported: it takes token-id blocks only and
returns them as tensors, exactly what AutoAWQ's version returns for blocks of max_seq_len.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

from engine.quality import held_out_text

# Calibration starts this far into the held-out text (characters): evaluation reads its start.
CALIBRATION_START_FRACTION = 0.5


def calibration_text() -> str:
    text = held_out_text()
    return text[int(len(text) * CALIBRATION_START_FRACTION) :]


def calibration_blocks(tokenizer: Any, num_blocks: int, block_len_tokens: int) -> list[list[int]]:
    """num_blocks consecutive, non-overlapping blocks of block_len_tokens token ids."""
    if num_blocks < 1:
        raise ValueError(f"calib_samples: must be >= 1, got {num_blocks}")
    if block_len_tokens < 16:
        raise ValueError(f"calib_seq_len: must be >= 16 tokens, got {block_len_tokens}")
    ids = tokenizer.encode(calibration_text(), add_special_tokens=False)
    available = len(ids) // block_len_tokens
    if available < num_blocks:
        raise ValueError(
            f"calib_samples: the calibration text has {len(ids)} tokens, only {available} "
            f"blocks of {block_len_tokens}"
        )
    return [ids[i * block_len_tokens : (i + 1) * block_len_tokens] for i in range(num_blocks)]


def get_calib_dataset(
    data: Sequence[Sequence[int]],
    tokenizer: Any = None,
    n_samples: int = 128,
    max_seq_len: int = 512,
    split: str = "train",
    text_column: str = "text",
) -> list[torch.Tensor]:
    """AutoAWQ's get_calib_dataset for pre-cut token blocks: [1, max_seq_len] tensors."""
    if isinstance(data, str) or not data or not isinstance(data[0][0], int):
        raise ValueError("calib_data: pass token-id blocks (no data set is downloaded)")
    if any(len(block) != max_seq_len for block in data):
        raise ValueError(f"calib_data: every block must have max_calib_seq_len={max_seq_len}")
    return [torch.tensor([list(block)]) for block in data[:n_samples]]


def install_local_calib_data() -> None:
    """Register this module's get_calib_dataset as `awq.utils.calib_data` (before autoawq is
    imported: its quantizer does `from awq.utils.calib_data import get_calib_dataset`)."""
    name = "awq.utils.calib_data"
    if name in sys.modules:
        return
    module = types.ModuleType(name, "engine.quantize.calib: token blocks only, no datasets")
    module.get_calib_dataset = get_calib_dataset  # type: ignore[attr-defined]
    sys.modules[name] = module
