"""The KV pool and the weights go into transparent huge pages on Linux (host_memory.py):
scattered block reads and weight streams then miss the TLB far less; huge_pages=False is the
before."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.llm import LLM
from engine.request import SamplingParams
from engine.runner.attention.torch_backend import TorchBackend
from engine.runner.host_memory import (
    HUGE_PAGE_BYTES,
    advise_huge_pages,
    place_weights_in_huge_pages,
    trim_heap,
    zeros_in_huge_pages,
)
from engine.runner.quant.linear import QuantLinear

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
    # (No check that a plain allocation lacks the flag: the allocator hands back memory that
    # earlier engines of this process advised, flag and all. The off path is checked by what
    # it calls: test_without_huge_pages_the_pool_is_plain_zeros.)


class TiedModel(nn.Module):
    """An embedding tied to its head (4 MiB of float32), a norm, a buffer and two buffers
    sharing one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 256)
        self.norm = nn.LayerNorm(256)
        self.head = nn.Linear(256, 4096, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(1000, dtype=torch.float32))
        both = torch.arange(64, dtype=torch.int64)
        self.register_buffer("first_half", both[:32])
        self.register_buffer("second_half", both[32:])


def _end(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size()


def test_weights_move_into_one_buffer_and_keep_their_values():
    torch.manual_seed(0)
    model = TiedModel()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    embed_param, shared_ptr = model.embed.weight, model.first_half.data_ptr()
    moved = place_weights_in_huge_pages(model)
    if moved == 0:
        pytest.skip("the kernel did not take MADV_HUGEPAGE here")
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    # The same Parameter object, still tied; the storage-sharing pair is left alone.
    assert model.embed.weight is embed_param and model.head.weight is embed_param
    assert model.first_half.data_ptr() == shared_ptr
    # Every moved tensor lies in one buffer of `moved` bytes (4 MiB + the small ones).
    inside = [model.embed.weight, model.norm.weight, model.norm.bias, model.table]
    lo, hi = min(t.data_ptr() for t in inside), max(_end(t) for t in inside)
    assert hi - lo <= moved and moved >= model.embed.weight.numel() * 4


def test_a_model_under_one_huge_page_stays_where_it_is():
    model = nn.Linear(64, 64)
    ptr = model.weight.data_ptr()
    assert place_weights_in_huge_pages(model) == 0 and model.weight.data_ptr() == ptr


@needs_thp
def test_moved_weights_are_advised_into_huge_pages():
    model = TiedModel()
    assert place_weights_in_huge_pages(model) > 0
    weight = model.embed.weight
    assert "hg" in vm_flags(weight.data_ptr() + weight.numel() * weight.element_size() // 2)


ENGINE = dict(
    model="random:tiny", dtype="bfloat16", max_model_len=128, num_kv_blocks=48, block_size=8,
    quantization_group_size=32,
)  # fmt: skip


@needs_thp
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_engine_runs_the_same_with_and_without_huge_pages(quantization):
    engine = {**ENGINE, "num_kv_blocks": 4096}  # a pool of 8 MiB: whole huge pages
    on = LLM(**engine, quantization=quantization)  # huge_pages=True: the default
    off = LLM(**engine, quantization=quantization, huge_pages=False)
    assert on.engine.runner.weight_huge_page_bytes > 0
    assert off.engine.runner.weight_huge_page_bytes == 0
    pool_on = on.engine.runner.kv_caches[0].key
    # The pool's middle (it is [layers=2, K/V, ...]: layer 0's K is its first quarter). Off,
    # the pool is plain torch.zeros (the test below); its mapping may still carry an earlier
    # allocation's advice when the allocator reuses memory, so that is not checked here.
    assert "hg" in vm_flags(pool_on.data_ptr() + 2 * pool_on.numel() * 2)
    assert on.engine.runner.attn_backend.host_huge_pages
    assert not off.engine.runner.attn_backend.host_huge_pages
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [(37 * i) % 900 + 3 for i in range(20)]
    assert on.generate([prompt], params)[0].token_ids == off.generate([prompt], params)[0].token_ids


@needs_thp
def test_quantized_layers_read_their_moved_weights():
    """The few-row calls are bound before the move (use_cpu_kernels); finish_weights re-binds
    them, so a change to a layer's current tensor shows in its output."""
    llm = LLM(**ENGINE, quantization="int4")
    assert llm.engine.runner.weight_huge_page_bytes > 0
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    bound = [m for m in layers if m.few_rows is not None]
    if not bound:
        pytest.skip("no C++ few-row kernel on this CPU")
    x = torch.randn(1, bound[0].in_features).bfloat16()
    with torch.inference_mode():
        before = bound[0](x)
        bound[0].packed.fill_(0x88)  # every weight at its zero point
        assert not torch.equal(bound[0](x), before)


def test_without_huge_pages_the_pool_is_plain_zeros(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("huge_pages=False advised the pool")

    monkeypatch.setattr("engine.runner.attention.base.zeros_in_huge_pages", refuse)
    backend = TorchBackend(3, 64, 16, torch.bfloat16, torch.device("cpu"))
    backend.host_huge_pages = False
    layer = backend.allocate_kv_caches(num_layers=2, num_blocks=64)[0]
    assert layer.key.shape[1] == 64 and not layer.key.any()


def test_compare_preset_switches_huge_pages():
    from engine import EngineConfig
    from playground.handlers.compare_engine import (
        HUGE_PAGES_PRESET,
        PRESET_DEFAULTS,
        preset_sides,
        side_config,
        side_label,
    )

    a, b = preset_sides(HUGE_PAGES_PRESET)
    base = EngineConfig(model="random:tiny", dtype="bfloat16")
    side_a, side_b = (side_config(base, s, 1024, 256, head_dim=64) for s in (a, b))
    assert side_a.huge_pages is False and side_b.huge_pages is True
    assert side_a.quantization == side_b.quantization == "int4"
    assert side_label("B", b, a) == "B: huge_pages=True"
    assert PRESET_DEFAULTS[HUGE_PAGES_PRESET].headline == "Mean TPOT (ms)"


def test_trim_heap_returns_freed_pages_where_glibc_has_it():
    # Nothing to assert about the resident size on a shared machine; the call must work on
    # glibc (a bool) and be a no-op elsewhere.
    garbage = [bytearray(1 << 16) for _ in range(64)]
    del garbage
    assert trim_heap() in (True, False)


# Steps that each allocate [64, 49152] float32 temporaries (a sampled batch-64 step's logits and
# probabilities, keep_freed_memory's docstring), eight alive at once: 100 MB, past what glibc's
# own adaptive thresholds keep (at most 64 MB), so without the settings every step faults them
# all in again. Run in a fresh interpreter: the settings are process-wide and permanent, and
# this process has long set them (every CPU engine does).
_STEPS_FAULTS = """
import resource, sys, torch
from engine.runner.host_memory import keep_freed_memory
keep = sys.argv[1] == "keep"
if keep:
    assert keep_freed_memory()
def step():
    x = [torch.ones(64, 49152) for _ in range(8)]
    return float(sum(t[0, 0] for t in x))
for _ in range(5):  # the heap grows to its working size (small allocations land in between)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def test_a_cpu_engine_keeps_its_steps_freed_memory(monkeypatch):
    import engine.runner.model_build as model_build

    calls = []
    monkeypatch.setattr(model_build, "keep_freed_memory", lambda: calls.append(1) or True)
    LLM(**ENGINE)
    assert calls, "finish_weights no longer sets the malloc thresholds on CPU"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, Linux")
def test_a_steps_freed_temporaries_are_not_faulted_in_again_next_step():
    import subprocess

    def faults_per_step(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _STEPS_FAULTS, mode], check=True,
                             capture_output=True, text=True, cwd=Path(__file__).parents[1])  # fmt: skip
        return float(out.stdout.split()[-1])

    kept = faults_per_step("keep")
    assert kept < 30, f"{kept} page faults a step with the freed memory kept"
    # The before, so this test can tell: glibc's defaults hand the 100 MB back and fault it in
    # again. Alone this reads 24,544 a step (every 4 KB page); in two full `make test` runs,
    # 9,817.6 (4 steps in 10 faulted it all in): how much glibc trims depends on where small
    # allocations land between the big ones. 100x the kept bound tells the two apart still.
    assert faults_per_step("default") > 100 * 30
