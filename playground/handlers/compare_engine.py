"""Compare sides that are engines: two engine configurations, each in its own EngineService,
run on the same seeded requests; the block map kept at each side's peak usage.

The same code serves both sides (docs/architecture.md: baselines live in the same engine): only the
EngineConfig fields in SIDE_FIELDS differ, and the KV budget is fixed in tokens at the model
dtype's size, so a bigger block size gets fewer blocks of the same total bytes and an int8 side
more tokens in the same bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.core.block_manager import BlockSnapshot
from engine.quality import SCORE_PARAMS, held_out_text, mean_nll, perplexity, windows_of
from engine.telemetry.cost import kv_bytes_per_element
from playground.engine_client import EngineClient
from playground.handlers.compare import SideOutcome, blocks_held
from playground.handlers.loadtest import DEFAULT_WORKLOAD, BackgroundRun
from playground.loadgen import EngineTarget, Target

logger = logging.getLogger(__name__)

SIDE_FIELDS = (
    "batching",
    "kv_layout",
    "kv_cache_dtype",
    "enable_prefix_caching",
    "enable_prompt_sharing",
    "speculative_method",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "quantization",
    "quantize_lm_head",
    "int8_activations",
    "prepack_weights",
    "fused_ops",
    "enforce_eager",
    "huge_pages",
)
BLOCK_SIZES = (8, 16, 32, 64)
DEFAULT_SIDE: dict[str, Any] = {
    "batching": "continuous",
    "kv_layout": "paged",
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": False,
    "enable_prompt_sharing": True,
    "speculative_method": "off",
    "block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "quantization": "none",
    "quantize_lm_head": True,
    "int8_activations": False,
    "prepack_weights": True,
    "fused_ops": True,
    "enforce_eager": False,
    "huge_pages": True,
}
PREPACK_PRESET = "bf16 weights reordered per matmul vs prepacked"
FUSED_OPS_PRESET = "norm/RoPE/SiLU as torch ops vs fused kernels (C++ / Triton)"
EAGER_PRESET = (
    "products through nn.Module vs direct kernel calls and the one-call C++ step (enforce_eager)"
)
HUGE_PAGES_PRESET = "int4 weights and KV in 4 KiB pages vs 2 MiB huge pages (CPU)"
KV_QUANT_PRESET = "KV 16-bit vs int8 at the same memory budget"
N_SHARING_PRESET = "n=4 with vs without prompt sharing"
AWQ_PRESET = "int4 RTN vs AWQ weights (after bf16 vs int4)"
LM_HEAD_PRESET = "AWQ weights: LM head 16-bit vs int4"
DRAFT_PRESET = "speculative decoding off vs draft model"
INT8_ACTIVATIONS_PRESET = "int4 weights: bf16 vs int8 activations (W4A8), 32 requests"
# speculative_method="draft" in the side forms: the target's own weights in int8 drafts (in
# benchmarks.spec's chat runs the int8 copy was accepted 85-96 % per position, int4 31-68 %).
COMPARE_DRAFT_QUANTIZATION = "int8"
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "static vs continuous batching": (
        {"batching": "static", "max_num_seqs": 4},
        {"batching": "continuous", "max_num_seqs": 4},
    ),
    "contiguous vs paged KV": ({"kv_layout": "contiguous"}, {"kv_layout": "paged"}),
    "max_num_seqs 2 vs 8": ({"max_num_seqs": 2}, {"max_num_seqs": 8}),
    "block size 64 vs 16": ({"block_size": 64}, {"block_size": 16}),
    "prefix caching off vs on (shared prompt prefix)": (
        {"enable_prefix_caching": False},
        {"enable_prefix_caching": True},
    ),
    "speculative decoding off vs n-gram": (
        {"speculative_method": "off", "max_num_seqs": 2},
        {"speculative_method": "ngram", "max_num_seqs": 2},
    ),
    # The draft is the target's own int8 copy (side_config), one request at a time.
    DRAFT_PRESET: (
        {"speculative_method": "off", "max_num_seqs": 1},
        {"speculative_method": "draft", "max_num_seqs": 1},
    ),
    "token budget 32 vs 256 (chunked prefill)": (
        {"max_num_batched_tokens": 32},
        {"max_num_batched_tokens": 256},
    ),
    # Weight-only quantization: batch 1 (max_num_seqs 1) is where weight bytes set the speed.
    "bf16 vs int8 weights": (
        {"quantization": "none", "max_num_seqs": 1},
        {"quantization": "int8", "max_num_seqs": 1},
    ),
    "bf16 vs int4 weights": (
        {"quantization": "none", "max_num_seqs": 1},
        {"quantization": "int4", "max_num_seqs": 1},
    ),
    # The second run of "bf16 vs int4 RTN vs AWQ": the same 4-bit format and group size (64),
    # round-to-nearest at load vs AutoAWQ's activation-aware checkpoint of the same model.
    AWQ_PRESET: (
        {"quantization": "int4", "max_num_seqs": 1},
        {"quantization": "awq", "max_num_seqs": 1},
    ),
    # AutoAWQ leaves the LM head 16-bit (~21% of SmolLM2's weights, read in full every step);
    # the engine quantizes it like int4 unless told not to.
    LM_HEAD_PRESET: (
        {"quantization": "awq", "quantize_lm_head": False, "max_num_seqs": 1},
        {"quantization": "awq", "quantize_lm_head": True, "max_num_seqs": 1},
    ),
    # CPU (AVX512-VNNI): from 6 rows each int4 layer's input is rounded to int8 and multiplied
    # with integer dot products; a batch of 32 decodes, and every prefill, takes that path.
    INT8_ACTIVATIONS_PRESET: (
        {"quantization": "int4", "int8_activations": False, "max_num_seqs": 32},
        {"quantization": "int4", "int8_activations": True, "max_num_seqs": 32},
    ),
    # CPU: oneDNN's per-call weight reorder is the larger share of a matmul at batch 1.
    PREPACK_PRESET: (
        {"prepack_weights": False, "max_num_seqs": 1},
        {"prepack_weights": True, "max_num_seqs": 1},
    ),
    # CPU: a small op costs ~5 us of Python and dispatch whatever its size; at batch 1 the
    # ~60 small ops per layer are a large share of a step. GPU (Triton): CUDA graphs remove the
    # launches, not the ~30 small kernels a layer (1.73x at batch 1 on an H200, kernels/README).
    FUSED_OPS_PRESET: (
        {"fused_ops": False, "max_num_seqs": 1},
        {"fused_ops": True, "max_num_seqs": 1},
    ),
    # CPU: at batch 1 each of a layer's four products is 10-40 us of kernel, and reaching it
    # through nn.Module dispatch cost ~1 ms of a 6 ms int4 token (docs/measurements/batch1.md);
    # on a GPU the same switch turns CUDA graphs off.
    EAGER_PRESET: (
        {"enforce_eager": True, "max_num_seqs": 1},
        {"enforce_eager": False, "max_num_seqs": 1},
    ),
    # CPU on Linux: a batch-1 step streams every weight once; in 4 KiB pages each page costs
    # a TLB miss and restarts the hardware prefetcher (engine/runner/host_memory.py).
    HUGE_PAGES_PRESET: (
        {"quantization": "int4", "huge_pages": False, "max_num_seqs": 1},
        {"quantization": "int4", "huge_pages": True, "max_num_seqs": 1},
    ),
    KV_QUANT_PRESET: ({"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "int8"}),
    # 16 slots: the 4 prompts' 4 samples all run at once on both sides.
    N_SHARING_PRESET: (
        {"enable_prompt_sharing": True, "max_num_seqs": 16},
        {"enable_prompt_sharing": False, "max_num_seqs": 16},
    ),
}
DEFAULT_PRESET = "static vs continuous batching"
# Bytes per K/V element of the model dtype ("auto" runs bfloat16: model_runner.resolve_dtype).
MODEL_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_KV_BUDGET_TOKENS = 4096
DEFAULT_MAX_MODEL_LEN = 512
DEFAULT_REPEATS = 2  # runs per side: the spread of the repeats sets the noise band
# The workload form's defaults: every field of the Compare tab's form (a preset starts from
# these, so nothing one preset set carries over to the next). Small enough for a 2-core CPU.
DEFAULT_COMPARE_WORKLOAD: dict[str, Any] = {
    **DEFAULT_WORKLOAD,
    "num_prompts": 16,
    "arrival": "all at once",
    "input_kind": "uniform",
    "input_low": 16,
    "input_high": 64,
    "output_kind": "uniform",
    "output_low": 4,
    "output_high": 24,
    "seed": 0,
    "temperature": 0.0,
    "ignore_eos": True,
    "max_concurrency": 0,
    "prefix_len": 0,
}


# The quantization presets' workload: a few prompts answered one at a time, greedy.
QUANT_WORKLOAD = {
    "num_prompts": 4,
    "input_kind": "fixed",
    "input_mean": 32,
    "output_kind": "fixed",
    "output_mean": 32,
}


@dataclass(frozen=True)
class PresetDefaults:
    """What a preset sets besides the two sides: a workload where the optimization's effect is
    large and stable on a 2-core CPU (measured: see each comment), and the row that shows it."""

    headline: str  # the COMPARE_ROWS label that makes the preset's point
    workload: dict[str, Any] = field(default_factory=dict)  # over DEFAULT_COMPARE_WORKLOAD
    kv_budget_tokens: int = DEFAULT_KV_BUDGET_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN


PRESET_DEFAULTS: dict[str, PresetDefaults] = {
    # Output lengths 2..48 over 4 slots: a static batch waits for its longest request, so its
    # slots idle. Measured on the 2-core CPU (16 requests of 2..64): 2.69 vs 3.53 requests per
    # step (x1.31; with 8 slots only x1.22); 2..48 keeps two runs per side short. Counted, not timed, so stable; the tok/s ratio moved from x1.07 to
    # x1.95 between runs on the busy machine, which is why it is not the headline.
    "static vs continuous batching": PresetDefaults(
        "Mean requests per step", {"output_low": 2, "output_high": 48}
    ),
    # Contiguous reserves max_model_len (512 tokens = 32 blocks) per request up front.
    "contiguous vs paged KV": PresetDefaults("Peak KV blocks held", {"num_prompts": 8}),
    # Decode reads every weight once per step: 8 requests per step share that read. Measured:
    # 256 vs 64 steps every run; output tok/s x3.34 and x2.43 (the timing is the noisy part).
    "max_num_seqs 2 vs 8": PresetDefaults(
        "Engine steps",
        {"input_kind": "fixed", "input_mean": 32, "output_kind": "fixed", "output_mean": 32},
    ),
    # Short prompts in 64-token blocks leave most of each last block empty.
    "block size 64 vs 16": PresetDefaults(
        "Peak KV tokens held (blocks x block size)",
        {
            "num_prompts": 8,
            "input_low": 8,
            "input_high": 40,
            "output_kind": "fixed",
            "output_mean": 8,
        },
    ),
    # A 192-token shared system prompt: the 256-token budget prefills one prompt per step, so
    # each request after the first finds the prefix its predecessor computed.
    "prefix caching off vs on (shared prompt prefix)": PresetDefaults(
        "Prompt tokens computed (prefill)",
        {
            "num_prompts": 8,
            "prefix_len": 192,
            "input_kind": "fixed",
            "input_mean": 16,
            "output_kind": "fixed",
            "output_mean": 4,
        },
    ),
    # Greedy decoding of a small model repeats itself, which the n-gram drafter predicts.
    # Measured: 128 vs 78 steps (120 drafts accepted) every run; tok/s x1.33 and x2.95.
    "speculative decoding off vs n-gram": PresetDefaults(
        "Engine steps",
        {
            "num_prompts": 4,
            "input_kind": "fixed",
            "input_mean": 32,
            "output_kind": "fixed",
            "output_mean": 64,
        },
    ),
    # Not measured in this tab (its prompts are random tokens, not chat): benchmarks.spec
    # measured the same setting on chat prompts at batch 1 (docs/measurements/speculative.md).
    # Engine steps are counted, not timed: with drafts accepted each step yields several
    # tokens, so the count drops.
    DRAFT_PRESET: PresetDefaults("Engine steps", QUANT_WORKLOAD),
    # Long prompts arriving while others decode: a 32-token budget chunks each 224-token
    # prefill over 7 steps, a 256-token one does it in one. Measured on the 2-core CPU: mean
    # TTFT x0.47 and x0.31 (B / A) over two runs, while P99 ITL moved x0.83 and x0.94 (noise).
    "token budget 32 vs 256 (chunked prefill)": PresetDefaults(
        "Mean TTFT (ms)",
        {
            "num_prompts": 8,
            "arrival": "Poisson",
            "request_rate": 4.0,
            "input_kind": "fixed",
            "input_mean": 224,
            "output_kind": "fixed",
            "output_mean": 32,
        },
    ),
    # One request at a time (max_num_seqs 1): each decode step is a matrix-vector product per
    # layer, bound by weight bytes, where the weight-only kernels pay off. Headline TPOT;
    # the weight-memory and same-tokens rows show the price (docs/measurements/quantization.md).
    "bf16 vs int8 weights": PresetDefaults("Mean TPOT (ms)", QUANT_WORKLOAD),
    "bf16 vs int4 weights": PresetDefaults("Mean TPOT (ms)", QUANT_WORKLOAD),
    # Same speed expected (one kernel, one format): the point is the perplexity row.
    AWQ_PRESET: PresetDefaults("Held-out perplexity (256 tokens of pydoc text)", QUANT_WORKLOAD),
    # One request at a time: the head's bytes are a share of every step's read; the perplexity
    # and same-tokens rows show what the 4-bit head costs.
    LM_HEAD_PRESET: PresetDefaults("Mean TPOT (ms)", QUANT_WORKLOAD),
    # 32 requests at once: every decode step multiplies 32 rows per layer, past the 6-row
    # switch, where the int8 products run twice the multiply-adds per instruction. Measured by
    # benchmarks.quant at batch 64 (docs/measurements/quantization.md): decode x1.18-1.30 (int4,
    # three runs); the perplexity and same-tokens rows show the activations' rounding.
    INT8_ACTIVATIONS_PRESET: PresetDefaults(
        "Output token throughput (tok/s)",
        {
            "num_prompts": 32,
            "input_kind": "fixed",
            "input_mean": 32,
            "output_kind": "fixed",
            "output_mean": 32,
        },
    ),
    # The same workload: one request at a time, so each decode matmul has one row and the
    # weight reorder oneDNN does per call is most of it. "Same tokens as A" shows that
    # prepacking changes no number. (On a GPU or in float32 both sides run the same path.)
    PREPACK_PRESET: PresetDefaults("Mean TPOT (ms)", QUANT_WORKLOAD),
    # The same one-request-at-a-time workload. In bfloat16 the fused ops round like torch's
    # but sum in another order (and keep RoPE's tables in float32), so "Same tokens as A" can
    # show a near-tie flipped; in float32 the engine's tokens are identical (tested).
    FUSED_OPS_PRESET: PresetDefaults("Mean TPOT (ms)", QUANT_WORKLOAD),
    # The same workload; the same kernels with the same arguments on both sides, so "Same
    # tokens as A" holds (tested) and TPOT shows only the dispatch.
    EAGER_PRESET: PresetDefaults("Mean TPOT (ms)", QUANT_WORKLOAD),
    # The same workload; the same kernels on the same values, only the pages differ, so "Same
    # tokens as A" holds (tested).
    HUGE_PAGES_PRESET: PresetDefaults("Mean TPOT (ms)", QUANT_WORKLOAD),
    # Long contexts: 8 requests of 224 + 32 tokens need 128 blocks of 16. The 1152-token
    # budget is 72 blocks in bfloat16 (4 requests at a time: the rest wait or are preempted)
    # and 139 in int8 (1 byte + a 2-byte scale per 64 values: 1.94x), so all 8 run at once.
    KV_QUANT_PRESET: PresetDefaults(
        "Most requests running at once",
        {
            "num_prompts": 8,
            "input_kind": "fixed",
            "input_mean": 224,
            "output_kind": "fixed",
            "output_mean": 32,
        },
        kv_budget_tokens=1152,
    ),
    # 4 prompts x 4 samples. With sharing each prompt's 127 tokens before the fork point sit
    # once in 8 blocks (7 full ones stay shared, the partial one is copied for 3 samples);
    # without, every sample holds its own 9 blocks and computes all 128 prompt tokens.
    # Greedy (the form has no temperature): the 4 samples are alike, which leaves the blocks
    # and prompt tokens as they are and lets "same tokens as A" check the two modes agree.
    N_SHARING_PRESET: PresetDefaults(
        "Peak KV blocks held",
        {
            "num_prompts": 4,
            "n": 4,
            "input_kind": "fixed",
            "input_mean": 128,
            "output_kind": "fixed",
            "output_mean": 16,
        },
    ),
}


def preset_workload(name: str) -> dict[str, Any]:
    """Every workload field for this preset: the defaults with the preset's own values."""
    return {**DEFAULT_COMPARE_WORKLOAD, **PRESET_DEFAULTS[name].workload}


def preset_form(name: str) -> dict[str, Any]:
    """Everything the Compare form shows for a preset: both sides, the KV budget, max_model_len,
    the runs per side and the whole workload (fields the preset does not set: defaults)."""
    a, b = preset_sides(name)
    d = PRESET_DEFAULTS[name]
    return {
        "A": a,
        "B": b,
        "kv_budget": d.kv_budget_tokens,
        "max_model_len": d.max_model_len,
        "repeats": DEFAULT_REPEATS,
        "workload": preset_workload(name),
    }


def preset_sides(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if name not in PRESETS:
        raise ValueError(f"preset: pick one of {', '.join(PRESETS)}")
    a, b = PRESETS[name]
    return {**DEFAULT_SIDE, **a}, {**DEFAULT_SIDE, **b}


def kv_budget_blocks(
    base: EngineConfig, kv_cache_dtype: str, kv_budget_tokens: int, block_size: int, head_dim: int
) -> int:
    """Blocks of the KV budget for one side. The budget is in tokens at the model dtype's
    element size (what both sides get in bytes): a side storing int8 or fp8 K/V fits more
    tokens in the same bytes (the real element size, scales included: engine.telemetry.cost)."""
    model_bytes = MODEL_DTYPE_BYTES[base.dtype]
    kv_bytes = kv_bytes_per_element(kv_cache_dtype, model_bytes, head_dim)
    return int(kv_budget_tokens * model_bytes / kv_bytes) // block_size


def side_config(
    base: EngineConfig,
    side: Mapping[str, Any],
    kv_budget_tokens: Any,
    max_model_len: Any,
    *,
    head_dim: int,
) -> EngineConfig:
    """The main engine's model, device and dtype with this side's scheduling and KV fields.
    head_dim: the model's, for the int8 scales' share of the KV budget."""
    values = {}
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        v = side[name]
        if v is None or v != int(v) or v < 1:
            raise ValueError(f"{name}: must be a positive whole number, got {v!r}")
        values[name] = int(v)
    for name, v in (("KV budget", kv_budget_tokens), ("max_model_len", max_model_len)):
        if v is None or v != int(v) or v < 1:
            raise ValueError(f"{name}: must be a positive whole number, got {v!r}")
    kv_cache_dtype = side.get("kv_cache_dtype", "auto")
    num_blocks = kv_budget_blocks(
        base, kv_cache_dtype, int(kv_budget_tokens), values["block_size"], head_dim
    )
    method = side.get("speculative_method", "off")
    if method == "draft":
        # The draft (the model's own shape, int8 weights) keeps as many K/V bytes per block in
        # the same blocks: the same budget holds half the blocks, as the engine sizes it.
        num_blocks //= 2
    if num_blocks < 1:
        raise ValueError(
            f"KV budget: {kv_budget_tokens} tokens hold no block of {values['block_size']}"
        )
    prefix_caching = bool(side.get("enable_prefix_caching", False))
    if side["kv_layout"] == "contiguous" and prefix_caching:
        raise ValueError("prefix caching: needs the paged KV layout (blocks are what is shared)")
    if (
        side["kv_layout"] == "contiguous"
        and -(-int(max_model_len) // values["block_size"]) > num_blocks
    ):
        raise ValueError(
            f"KV budget: with the contiguous layout each request reserves max_model_len = "
            f"{int(max_model_len)} tokens, more than the {kv_budget_tokens}-token budget"
        )
    # The main engine's fp8 scale settings go to an fp8 side only (refused with other formats).
    return base.with_kv_cache_dtype(kv_cache_dtype).replace(
        quantization=side.get("quantization", "none"),
        quantize_lm_head=bool(side.get("quantize_lm_head", True)),
        int8_activations=bool(side.get("int8_activations", False)),
        batching=side["batching"],
        kv_layout=side["kv_layout"],
        enable_prefix_caching=prefix_caching,
        enable_prompt_sharing=bool(side.get("enable_prompt_sharing", True)),
        prepack_weights=bool(side.get("prepack_weights", True)),
        fused_ops=bool(side.get("fused_ops", True)),
        enforce_eager=bool(side.get("enforce_eager", False)),
        huge_pages=bool(side.get("huge_pages", True)),
        speculative_method=method,
        speculative_quantization=COMPARE_DRAFT_QUANTIZATION
        if method == "draft"
        else base.speculative_quantization,
        num_kv_blocks=num_blocks,
        max_model_len=int(max_model_len),
        **values,
    )


def side_label(name: str, side: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    diff = [f"{k}={side[k]}" for k in SIDE_FIELDS if side[k] != other[k]]
    return f"{name}: {', '.join(diff) if diff else 'same config'}"


class PeakPoller:
    """Polls block_snapshot() and keeps the one with the most blocks held."""

    def __init__(self, service: EngineClient, interval_s: float = 0.1) -> None:
        self.service = service
        self.interval_s = interval_s
        self.peak: BlockSnapshot = service.block_snapshot()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-poller", daemon=True)

    def start(self) -> PeakPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            snap = self.service.block_snapshot()
            if blocks_held(snap) > blocks_held(self.peak):
                self.peak = snap

    def stop(self) -> BlockSnapshot:
        """The peak: polled, or the service's own record of every step's map while polled
        (a run shorter than the interval would slip between two polls)."""
        self._stop.set()
        self._thread.join()
        recorded = self.service.peak_block_snapshot
        if recorded is not None and blocks_held(recorded) > blocks_held(self.peak):
            self.peak = recorded
        return self.peak


# Quality: one window of held-out text scored through the engine's prompt logprobs (a second or
# two on a CPU for the embedded model): enough to show what a weight or KV format costs, and
# the same on both sides. benchmarks.perplexity scores more text.
PERPLEXITY_WINDOW_TOKENS = 256


def held_out_perplexity(service: EngineClient) -> float | None:
    """Perplexity of the side's engine on PERPLEXITY_WINDOW_TOKENS tokens of held-out text
    (engine/quality.py); None when the engine cannot score them (too short a context, no
    tokenizer, a refusal), so a compare never fails for its quality row."""
    context_len = min(PERPLEXITY_WINDOW_TOKENS, service.max_model_len - 1)
    try:
        ids = service.tokenizer.encode(held_out_text(max_chars=8 * context_len),
                                       add_special_tokens=False)  # fmt: skip
        windows = windows_of(ids, context_len, 1)
        outputs = [out for window in windows for out in service.submit(window, SCORE_PARAMS)]
        return perplexity(mean_nll([out for out in outputs if out.finished], windows))
    except (ValueError, RuntimeError, AttributeError, TypeError) as e:
        logger.warning("compare: no perplexity for this side: %s", e)
        return None


class EngineSide:
    """A CompareSide that builds an engine with its config, polls its block map while the
    load test runs, keeps the run's steps and shuts the engine down."""

    starting = "loading the model"
    finishing = "shutting down"

    def __init__(
        self,
        name: str,
        label: str,
        config: EngineConfig,
        make_service: Callable[[EngineConfig], EngineClient],
    ) -> None:
        self.name = name
        self.label = label
        self.config = config
        self.make_service = make_service
        self._service: EngineClient | None = None
        self._poller: PeakPoller | None = None

    def start(self) -> Target:
        try:
            self._service = self.make_service(self.config)
        except Exception as e:  # a config the engine refuses: the compare reports it, goes on
            raise RuntimeError(f"engine did not start: {e}") from e
        try:
            self._poller = PeakPoller(self._service).start()
        except BaseException:
            self._shutdown()
            raise
        return EngineTarget(self._service)

    def finish(self, outcome: SideOutcome, run: BackgroundRun | None) -> None:
        try:
            if self._service is not None:
                outcome.weight_bytes = self._service.weight_bytes
            ran = run is not None and run.done.is_set()
            if ran:
                steps = self._service.stats().steps
                outcome.steps = [s for s in steps if s.start_time >= run.start_time]
            self._stop_poller(outcome)
            if ran:  # after the run's steps and peak are kept: scoring is not part of the run
                outcome.perplexity = held_out_perplexity(self._service)
        finally:
            self._stop_poller(outcome)
            self._shutdown()

    def _stop_poller(self, outcome: SideOutcome) -> None:
        if self._poller is not None:
            outcome.peak = self._poller.stop()
            self._poller = None

    def _shutdown(self) -> None:
        if self._service is not None:
            service, self._service = self._service, None
            service.shutdown()


def engine_sides(
    sides: list[tuple[str, str, EngineConfig]],
    make_service: Callable[[EngineConfig], EngineClient],
) -> list[EngineSide]:
    """(name, label, config) per side -> the CompareSides BackgroundCompare runs."""
    return [EngineSide(name, label, config, make_service) for name, label, config in sides]
