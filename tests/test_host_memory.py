"""The KV pool's host memory is advised into transparent huge pages on Linux (host_memory.py):
scattered block reads then miss the TLB far less."""

import sys
from pathlib import Path

import pytest
import torch

from engine.runner.attention.host_memory import (
    HUGE_PAGE_BYTES,
    advise_huge_pages,
    zeros_in_huge_pages,
)
from engine.runner.attention.torch_backend import TorchBackend

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available on this machine",
)


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps): 'hg' = MADV_HUGEPAGE."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_in_huge_pages_is_torch_zeros():
    t = zeros_in_huge_pages((3, 1 << 20), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and not t.any()


def test_a_tensor_under_one_huge_page_is_left_alone():
    assert not advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 8, dtype=torch.float32))


@needs_thp
def test_the_kv_pool_is_advised_into_huge_pages():
    backend = TorchBackend(3, 64, 16, torch.bfloat16, torch.device("cpu"))
    # 2 layers x K/V x 3 heads x 2,048 blocks x 16 x 64 bf16: 48 MiB, many huge pages.
    layer = backend.allocate_kv_caches(num_layers=2, num_blocks=2048)[0]
    middle = layer.key.data_ptr() + layer.key.numel() * layer.key.element_size() // 2
    assert "hg" in vm_flags(middle)
    # A plain allocation of the same size is not: the advice is what the pool adds.
    plain = torch.zeros(layer.key.numel(), dtype=torch.bfloat16)
    assert "hg" not in vm_flags(plain.data_ptr() + plain.numel())
